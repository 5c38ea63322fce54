"""Where each token of a padding-free (packed) micro-batch goes.

A micro-batch of the batch contract is ``[b, L]``: left-padded prompts, then right-padded responses
(``L = P + R``). Packed, its real tokens form one row of ``T`` tokens, row by row, prompt then
response, with the positions each token has in its own sequence. Rows whose prompts are identical
(the ``n`` samples of a GRPO group) may share one copy of the prompt: only the first of them packs
it, and the others' responses attend to that copy. The computation is the same as on the padded
batch (every response sees its prompt and its own earlier tokens), minus the repeated prompts.

``PackedSequences`` describes the layout both ways: ``rows`` lays the packed tokens out again as
one padded sequence per sample (for attention, ``verl_core.toolkit.varlen``), and ``slots`` says which
of those padded positions computes each packed token's output.
"""

from __future__ import annotations

import attrs
import torch

from verl_core.data.batch import prompt_groups  # noqa: F401 (docs/engine.md names it here)


@attrs.frozen
class PackedSequences:
    """A packed micro-batch's layout.

    - ``mask`` ``[b, L]``: the tokens of the padded batch that are packed, in row-major order.
    - ``position_ids`` ``[1, T]``: each packed token's position in its sample's sequence.
    - ``rows`` ``[b, longest]``: the packed index of sample ``i``'s token at position ``p`` (its
      prompt's copy for a shared prompt); 0 after the sample's end (causal attention never reads it).
    - ``slots`` ``[T]``: ``i * longest + p`` for the sample ``i`` that packed the token.
    - ``cu_seq_lens`` (int32 ``[b + 1]``, as variable-length attention kernels take them): where
      each sample's tokens start, when no prompt is shared (each sample is contiguous); else ``None``.
    - ``response_present`` ``[b, R]``: True where response token ``t`` of row ``i`` exists;
      ``predicting`` holds, for each of those in row-major order, the packed index of the token
      whose logits predict it.
    """

    mask: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor
    longest: int
    cu_seq_lens: torch.Tensor | None
    predicting: torch.Tensor
    response_present: torch.Tensor


def pack_sequences(
    attention_mask: torch.Tensor, response_length: int, groups: torch.Tensor | None = None
) -> PackedSequences:
    """The layout of a packed micro-batch; rows with equal ``groups`` ids (which must have identical
    prompts: ``prompt_groups``) share their prompt. Without ``groups`` every row packs its own."""
    mask = attention_mask.bool()
    batch, width = mask.shape
    device = mask.device
    row = torch.arange(batch, device=device)
    prompt_width = width - response_length
    prompt_lengths = mask[:, :prompt_width].sum(dim=-1)
    response_lengths = mask[:, prompt_width:].sum(dim=-1)
    lengths = prompt_lengths + response_lengths
    if groups is None:
        owner = row
    else:  # the first row of each group packs the prompt
        first = torch.full((int(groups.max()) + 1,), batch, device=device, dtype=torch.long)
        owner = first.scatter_reduce(0, groups, row, reduce="amin")[groups]
    owns_prompt = owner == row
    packed_mask = mask & torch.cat(
        [owns_prompt[:, None].expand(batch, prompt_width), mask.new_ones(batch, response_length)], dim=1
    )
    counts = packed_mask.sum(dim=-1)
    starts = torch.cumsum(counts, dim=0) - counts
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    position_ids = positions[packed_mask][None]

    # Sample i's position p: its prompt's copy (packed by its owner) or its own response token.
    longest = int(lengths.max()) if batch else 0
    p = torch.arange(longest, device=device)[None]
    response_start = starts + prompt_lengths * owns_prompt
    rows = torch.where(
        p < prompt_lengths[:, None],
        starts[owner][:, None] + p,
        response_start[:, None] + p - prompt_lengths[:, None],
    )
    rows = torch.where(p < lengths[:, None], rows, torch.zeros_like(rows))
    packing_row = row[:, None].expand(batch, width)[packed_mask]
    slots = packing_row * longest + position_ids[0]

    steps = torch.arange(response_length, device=device)[None]
    present = steps < response_lengths[:, None]
    predicting = rows.gather(1, (prompt_lengths[:, None] + steps - 1).clamp(0, max(longest - 1, 0)))
    contiguous = groups is None or bool(owns_prompt.all())
    cu_seq_lens = torch.cat([counts.new_zeros(1), torch.cumsum(counts, dim=0)]).to(torch.int32)
    return PackedSequences(
        mask=packed_mask,
        position_ids=position_ids,
        rows=rows,
        slots=slots,
        longest=longest,
        cu_seq_lens=cu_seq_lens if contiguous else None,
        predicting=predicting[present],
        response_present=present,
    )
