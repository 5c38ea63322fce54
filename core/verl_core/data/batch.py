"""The batch contract: a ``tensordict.TensorDict`` with verl's key names, and its global counts.

Layout (B sequences, P prompt tokens left-padded, R response tokens right-padded, L = P + R):

===================  ==========  ==================================================================
key                  shape       meaning
===================  ==========  ==================================================================
``input_ids``        [B, L]      prompt followed by response
``attention_mask``   [B, L]      1 for real tokens, 0 for padding
``position_ids``     [B, L]      positions of real tokens (cumsum of the mask - 1)
``responses``        [B, R]      the response tokens (the last R columns of ``input_ids``)
``response_mask``    [B, R]      1 for response tokens that count in losses (0: padding, tool output)
``old_log_probs``    [B, R]      log-probs of the behaviour policy (before the update)
``ref_log_prob``     [B, R]      log-probs of the reference policy
``advantages``       [B, R]
``returns``          [B, R]
``values``           [B, R]      critic values
``token_level_rewards`` [B, R]
``uid``              non-tensor  group id of each sample (GRPO-style groups)
===================  ==========  ==================================================================
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.distributed import collective_device, group_size

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROB = "ref_log_prob"
ADVANTAGES = "advantages"
RETURNS = "returns"
VALUES = "values"
TOKEN_LEVEL_REWARDS = "token_level_rewards"

#: Non-tensor key under which engines attach the step's ``GlobalCounts`` to every micro-batch.
GLOBAL_COUNTS = "global_counts"


@attrs.frozen
class GlobalCounts:
    """Counts over the whole step (all micro-batches on all DP ranks), for loss normalisation.

    ``num_tokens``: response tokens that count (``response_mask`` ones); ``num_seqs``: sequences;
    ``max_response_len``: the response length R (for ``seq-mean-token-sum-norm``);
    ``dp_size``: data-parallel ranks, by which each rank scales its loss to undo gradient averaging.
    """

    num_tokens: int
    num_seqs: int
    dp_size: int = 1
    max_response_len: int = 0


def compute_global_counts(
    batch: TensorDict, dp_group: dist.ProcessGroup | None = None, mask_key: str = RESPONSE_MASK
) -> GlobalCounts:
    """Count ``batch``'s tokens and sequences and sum them over ``dp_group`` (one all-reduce)."""
    mask = batch[mask_key]
    counts = torch.tensor(
        [int(mask.sum().item()), mask.shape[0]], dtype=torch.int64, device=collective_device(dp_group)
    )
    dp_size = group_size(dp_group)
    if dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
    num_tokens, num_seqs = (int(v) for v in counts.tolist())
    return GlobalCounts(num_tokens, num_seqs, dp_size, int(mask.shape[-1]))


def attach_global_counts(batch: TensorDict, counts: GlobalCounts) -> TensorDict:
    """Store ``counts`` on ``batch`` (survives ``split``, indexing and ``torch.cat``)."""
    batch.set_non_tensor(GLOBAL_COUNTS, counts)
    return batch


def get_global_counts(batch: TensorDict) -> GlobalCounts:
    """The counts an engine attached; a loss function reads them to normalise globally."""
    try:
        counts = batch.get_non_tensor(GLOBAL_COUNTS)
    except KeyError:
        counts = None
    if not isinstance(counts, GlobalCounts):
        raise KeyError(
            f"micro-batch has no {GLOBAL_COUNTS!r}: loss functions run inside an engine's "
            "forward_backward_batch, which attaches them (or call attach_global_counts yourself)"
        )
    return counts
