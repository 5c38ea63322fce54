"""The batch contract: a ``tensordict.TensorDict`` with verl's key names, and its global counts.

Every key of the contract is a constant of this module, the one vocabulary of batches that the
trainer, the workers, the engines, the rollouts and the kits share (docs/engine.md has the table).
Layout (B sequences, P prompt tokens left-padded, R response tokens right-padded, L = P + R):

=========================  ===================  ==========  ============================================
constant                   key                  shape       meaning
=========================  ===================  ==========  ============================================
``INPUT_IDS``              ``input_ids``        [B, L]      prompt followed by response
``ATTENTION_MASK``         ``attention_mask``   [B, L]      1 for real tokens, 0 for padding
``POSITION_IDS``           ``position_ids``     [B, L]      positions of real tokens (cumsum of the mask - 1)
``RESPONSES``              ``responses``        [B, R]      the response tokens (last R columns of ``input_ids``)
``RESPONSE_MASK``          ``response_mask``    [B, R]      1 for tokens that count in losses (0: padding, tool output)
``ROLLOUT_LOG_PROBS``      ``rollout_log_probs`` [B, R]     the rollout's log-probs of its sampled tokens
``OLD_LOG_PROBS``          ``old_log_probs``    [B, R]      log-probs of the behaviour policy (before the update)
``REF_LOG_PROB``           ``ref_log_prob``     [B, R]      log-probs of the reference policy
``ADVANTAGES``             ``advantages``       [B, R]
``RETURNS``                ``returns``          [B, R]
``VALUES``                 ``values``           [B, R]      critic values (also a value engine's output)
``TOKEN_LEVEL_REWARDS``    ``token_level_rewards`` [B, R]
``SCORES``                 ``scores``           [B]         each response's score from the reward function
``UID``                    ``uid``              [B]         group of each sample: its prompt's index in the step
``ENVIRONMENT_REWARDS``    ``environment_rewards`` [B]      multi-turn: the environment's reward, NaN where it gave none
``TEMPERATURE``            ``temperature``      non-tensor  forward option: temperature of log-probs and entropy
``COMPUTE_ENTROPY``        ``compute_entropy``  non-tensor  forward option: also return ``entropy``
``TOP_K``                  ``top_k``            non-tensor  forward option: also return the ``k`` likeliest tokens
``CANDIDATE_IDS``          ``candidate_ids``    [B, R, k]   forward input: also return the log-probs of these tokens
``TEACHER_LOG_PROBS``      ``teacher_log_probs`` [B, R]     distillation: a teacher's log-probs of the response tokens
``TEACHER_TOP_K_LOG_PROBS`` ``teacher_top_k_log_probs`` [B, R, k] distillation: the teacher's ``k`` likeliest tokens' log-probs
``TEACHER_TOP_K_IDS``      ``teacher_top_k_ids`` [B, R, k]  distillation: those tokens, likeliest first
``GLOBAL_COUNTS``          ``global_counts``    non-tensor  the step's ``GlobalCounts``, for loss normalisation
``LOG_PROBS``              ``log_probs``        [B, R]      model output: log-probs of the response tokens
``ENTROPY``                ``entropy``          [B, R]      model output: entropy at the response tokens
``TOP_K_LOG_PROBS``        ``top_k_log_probs``  [B, R, k]   model output (``TOP_K``): the likeliest tokens' log-probs, descending
``TOP_K_IDS``              ``top_k_ids``        [B, R, k]   model output (``TOP_K``): those tokens' ids
``CANDIDATE_LOG_PROBS``    ``candidate_log_probs`` [B, R, k] model output (``CANDIDATE_IDS``): their log-probs
=========================  ===================  ==========  ============================================
"""

from __future__ import annotations

from collections.abc import Sequence

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
#: The rollout's per-token log-probs of the sampled tokens.
ROLLOUT_LOG_PROBS = "rollout_log_probs"
#: Each response's score from the reward function.
SCORES = "scores"
#: Each response's group: its prompt's index within the step (GRPO's groups).
UID = "uid"
#: Multi-turn rollouts: each response's reward from its environment, NaN where it gave none (the
#: reward function scores those).
ENVIRONMENT_REWARDS = "environment_rewards"
#: ``[B, R]`` int64: the policy version (updates applied) of the weights that generated each response
#: token; asynchronous training reads the staleness from it (docs/training.md).
ROLLOUT_POLICY_VERSIONS = "rollout_policy_versions"

#: Non-tensor keys of a batch that steer the forward pass (``engine.base.forward_options`` reads them).
TEMPERATURE = "temperature"
COMPUTE_ENTROPY = "compute_entropy"
#: ``int``, 0 by default: with ``k > 0`` an ``lm`` forward pass also returns ``TOP_K_LOG_PROBS`` and
#: ``TOP_K_IDS``, the ``k`` likeliest tokens at each response position (a teacher's, for GKD); only
#: engines whose backend declares ``EngineBackend(top_k_log_probs=True)``.
TOP_K = "top_k"
#: ``[B, R, k]`` int64 token ids: an ``lm`` forward pass also returns ``CANDIDATE_LOG_PROBS``, the
#: log-probs of these tokens at each response position (the student's, at its teacher's top-k).
CANDIDATE_IDS = "candidate_ids"

#: Distillation: a teacher's log-probs of the sampled response tokens ``[B, R]``, and (GKD) its ``k``
#: likeliest tokens at each response position, likeliest first ``[B, R, k]``.
TEACHER_LOG_PROBS = "teacher_log_probs"
TEACHER_TOP_K_LOG_PROBS = "teacher_top_k_log_probs"
TEACHER_TOP_K_IDS = "teacher_top_k_ids"

#: The output keys of a forward pass of the batch contract (with ``VALUES`` for a value head).
LOG_PROBS = "log_probs"
ENTROPY = "entropy"
#: Outputs of ``TOP_K`` (log-probs descending, their token ids) and of ``CANDIDATE_IDS``: ``[B, R, k]``.
TOP_K_LOG_PROBS = "top_k_log_probs"
TOP_K_IDS = "top_k_ids"
CANDIDATE_LOG_PROBS = "candidate_log_probs"

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


def join_prompts_and_responses(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    response_attention_mask: torch.Tensor | None = None,
) -> TensorDict:
    """The batch contract from left-padded ``prompts`` ``[B, P]`` and right-padded ``responses``
    ``[B, R]`` with their masks (1 on real tokens): ``input_ids`` and ``attention_mask`` are the two
    side by side, ``position_ids`` count real tokens only (padding repeats position 0).

    A multi-turn response also holds environment tokens (tool results), which the model reads but did
    not produce: ``response_attention_mask`` is then 1 on every real token of the response and
    ``response_mask`` on the model's only. By default they are the same."""
    if response_attention_mask is None:
        response_attention_mask = response_mask
    attention_mask = torch.cat([prompt_mask, response_attention_mask], dim=-1).to(torch.int64)
    return TensorDict(
        {
            INPUT_IDS: torch.cat([prompts, responses], dim=-1),
            ATTENTION_MASK: attention_mask,
            POSITION_IDS: (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
            RESPONSES: responses,
            RESPONSE_MASK: response_mask.to(torch.int64),
        },
        batch_size=[prompts.shape[0]],
    )


def responses_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    pad_token_id: int,
    *,
    model_masks: Sequence[Sequence[int]] | None = None,
) -> TensorDict:
    """The batch contract of a rollout's output from plain lists: ``prompts`` left-padded,
    ``responses`` right-padded, with ``ROLLOUT_LOG_PROBS`` (each response's sampling log-probs, 0 on
    padding).

    ``model_masks`` marks, per response, the tokens the model produced (1) among those an environment
    added (0) in a multi-turn response; it becomes ``RESPONSE_MASK`` while every real token is attended
    to (``join_prompts_and_responses``). By default every response token is the model's."""
    prompt_ids, prompt_mask = left_pad([list(prompt) for prompt in prompts], pad_token_id)
    width = max([1, *(len(response) for response in responses)])
    response_ids = torch.full((len(responses), width), pad_token_id, dtype=torch.int64)
    real = torch.zeros(len(responses), width, dtype=torch.int64)
    rollout_log_probs = torch.zeros(len(responses), width)
    for row, (response, row_log_probs) in enumerate(zip(responses, log_probs, strict=True)):
        response_ids[row, : len(response)] = torch.as_tensor(response, dtype=torch.int64)
        real[row, : len(response)] = 1
        rollout_log_probs[row, : len(response)] = torch.as_tensor(row_log_probs, dtype=torch.float32)
    model = real
    if model_masks is not None:
        model = torch.zeros_like(real)
        for row, mask in enumerate(model_masks):
            model[row, : len(mask)] = torch.as_tensor(mask, dtype=torch.int64)
    batch = join_prompts_and_responses(
        prompt_ids, prompt_mask, response_ids, model, response_attention_mask=real
    )
    batch[ROLLOUT_LOG_PROBS] = rollout_log_probs
    return batch


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """``[b]`` ids, equal for rows whose prompts are identical (tokens and padding): the samples of one
    prompt, which a packed micro-batch may compute once (``micro_batch.share_prompts``)."""
    width = input_ids.shape[1] - response_length
    mask = attention_mask[:, :width]
    prompts = torch.cat([input_ids[:, :width] * mask, mask], dim=1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def groups_without_one_prompt(batch: TensorDict) -> dict[int, list[int]]:
    """The ``UID`` groups whose rows do not all hold the same prompt (tokens and padding), each with its
    rows: a rollout or collector that changed some samples' prompts. Sharing goes by the tokens
    (``prompt_groups``), so these rows are computed with their own prompts, never a sibling's."""
    if UID not in batch.keys():
        return {}
    prompts = prompt_groups(batch[INPUT_IDS], batch[ATTENTION_MASK], batch[RESPONSES].shape[-1]).tolist()
    members: dict[int, dict[int, list[int]]] = {}
    for row, (group, prompt) in enumerate(zip(batch[UID].tolist(), prompts, strict=True)):
        members.setdefault(group, {}).setdefault(prompt, []).append(row)
    return {
        group: sorted(row for rows in by_prompt.values() for row in rows)
        for group, by_prompt in members.items()
        if len(by_prompt) > 1
    }


def left_pad(
    sequences: list[list[int]] | list[torch.Tensor], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, max length]`` token ids padded on the left with ``pad_token_id``, and the mask of real tokens."""
    width = max((len(sequence) for sequence in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            ids[row, width - len(sequence) :] = torch.as_tensor(sequence, dtype=torch.int64)
            mask[row, width - len(sequence) :] = 1
    return ids, mask


#: Keys of ``[B, P + R]`` tensors; every other 2-D tensor of a batch is ``[B, R]``.
SEQUENCE_KEYS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)


def concat_batches(batches: list[TensorDict], pad_token_id: int = 0) -> TensorDict:
    """Batches of the contract with different prompt widths ``P`` and response widths ``R`` as one:
    prompts left-padded and responses right-padded to the widest, ``position_ids`` recomputed.

    ``[B, P + R]`` keys pad their prompt part on the left and response part on the right; other 2-D
    tensors are ``[B, R]`` and pad on the right, as do those with more dimensions ``[B, R, ...]``
    (``TEACHER_TOP_K_IDS``, say: more per response token); 1-D tensors (per-sample values) concatenate
    as they are. ``input_ids`` pad with ``pad_token_id``, everything else with 0. One batch comes back as a
    shallow copy of itself (its tensors shared, not copied).
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0].copy()
    widths = [(b[INPUT_IDS].shape[-1] - b[RESPONSES].shape[-1], b[RESPONSES].shape[-1]) for b in batches]
    prompt_width = max(p for p, _ in widths)
    response_width = max(r for _, r in widths)
    padded = []
    for batch, (p, r) in zip(batches, widths, strict=True):
        items = {}
        for key, value in batch.items():
            fill = pad_token_id if key in (INPUT_IDS, RESPONSES) else 0
            if key in SEQUENCE_KEYS:
                value = torch.nn.functional.pad(value, (prompt_width - p, response_width - r), value=fill)
            elif value.dim() >= 2:  # [B, R, ...]: pad dimension 1 on the right
                trailing = (0, 0) * (value.dim() - 2)
                value = torch.nn.functional.pad(value, (*trailing, 0, response_width - r), value=fill)
            items[key] = value
        padded.append(TensorDict(items, batch_size=batch.batch_size[:1]))
    merged = torch.cat(padded, dim=0)
    merged[POSITION_IDS] = (merged[ATTENTION_MASK].cumsum(dim=-1) - 1).clamp(min=0)
    return merged


def select_rows(batch: TensorDict, index: torch.Tensor) -> TensorDict:
    """``batch[index]`` (``index``: 1-d row positions); when ``index`` is every row in order (one DP
    rank, one mini- or micro-batch) a shallow copy, which shares the tensors instead of copying them."""
    rows = batch.batch_size[0]
    if index.numel() == rows and bool((index == torch.arange(rows, device=index.device)).all()):
        return batch.copy()
    return batch[index]


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
