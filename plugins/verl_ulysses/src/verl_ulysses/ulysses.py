"""DeepSpeed-Ulysses sequence parallelism on verl-core's padding-free layout.

The ``sp`` ranks of one data-parallel rank receive the same micro-batch. Each packs it (core's
``pack_sequences``: the real tokens in one row, positions restarting at every sequence) and keeps a
contiguous ``1/sp`` of the row:

1. **Labels first.** The label of packed token ``i`` is token ``i + 1`` of the *whole* row, so the
   labels are rolled on the global sequence before it is split (``shard_sequence``). Rolling each
   shard instead wraps at its boundary: the last token of a shard would predict its own shard's first
   token, not the next shard's (verl issue #6068).
2. **Padding.** The row is padded to a multiple of ``sp`` with a trailing segment of its own whose
   positions restart at 0, so that it is a sequence like any other: nothing attends across into it
   and it predicts nothing.
3. **Attention.** Everything but attention (embedding, norms, MLP, the LM or value head) runs on the
   shard. Inside every attention layer (``ulysses_attention``, a transformers attention function)
   an all-to-all turns this rank's ``[S/sp, H, D]`` queries, keys and values into ``[S, H/sp, D]``:
   the whole sequence for ``1/sp`` of the heads. KV heads fewer than ``sp`` are repeated first, each
   ``sp / KV`` times in place (``repeat_interleave``), so that SP rank ``r`` gets the KV head its query
   heads use. Attention then runs over the whole sequence, block-causal by the global sequence
   boundaries (``segment_attention``: each sequence gathered into a padded row, causal SDPA), and a
   second all-to-all sends every token's heads back to the rank that owns the token.
4. **Outputs.** Log-probs, entropy or values of the shard's positions are all-gathered into the
   whole row (``gather_sequence``). Every SP rank then holds the same outputs and computes the same
   loss; its backward keeps the gradient of its own positions only, multiplied by ``sp``: FSDP
   averages gradients over all ``dp x sp`` ranks, while the SP ranks' contributions are parts of one
   sum, so the factor makes the step equal to the unsplit run under the contract's global-token
   normalisation.

Every collective here runs over the SP group and works on gloo and NCCL (``all_to_all_single`` on
dim 0, ``all_gather``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from verl_core.data import ATTENTION_MASK, CANDIDATE_IDS, INPUT_IDS, RESPONSES, VALUES
from verl_core.toolkit import lm_head_outputs, pack_sequences, plain_head_model, scatter_positions

#: The attention implementation a model runs under at ``sp > 1`` (registered with transformers).
ULYSSES_ATTENTION = "verl_ulysses"
#: The keyword argument that carries a micro-batch's ``SequenceShard`` from the model's forward down
#: to every attention call (transformers passes unknown keyword arguments through).
SHARD_KWARG = "ulysses_shard"
#: Stands in for the attention mask of a sequence-parallel call: transformers passes a 4-D mask on
#: untouched instead of building a ``[S/sp, S/sp]`` one that would mean nothing here. Empty, so that
#: another attention function given it fails loudly.
_NO_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)


@attrs.frozen(eq=False)
class SequenceShard:
    """One micro-batch's packed row, padded and split over an SP group: this rank's part of it, and
    the layout of the whole row that attention needs.

    ``input_ids``, ``position_ids``, ``labels`` ``[S/sp]``: this rank's tokens, their positions in
    their sequences, and the token each one predicts (rolled on the whole row). ``predicting_local``:
    the positions of this shard whose label is a response token (the only ones the head runs on).
    ``rows`` ``[sequences, longest]`` / ``slots`` ``[S]``: where each token of the whole row sits in
    its sequence's padded row, for ``segment_attention`` (the padding segment included).
    """

    group: dist.ProcessGroup | None
    sp_size: int
    sp_rank: int
    total_length: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    predicting_local: torch.Tensor
    rows: torch.Tensor
    slots: torch.Tensor


def roll_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The token each position of a packed row predicts: the next one (the row's last position wraps
    to its first, and predicts nothing that is used)."""
    return torch.roll(input_ids, shifts=-1, dims=0)


def shard_sequence(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    predicting: torch.Tensor,
    group: dist.ProcessGroup | None,
    sp_size: int,
    sp_rank: int,
) -> SequenceShard:
    """Label, pad and split a packed row (``[T]`` tokens and positions, sequence boundaries
    ``cu_seq_lens`` ``[n + 1]``, the positions ``predicting`` response tokens) for SP rank ``sp_rank``
    of ``sp_size`` (in ``group``). Every rank of the group calls it with the same row and gets its own
    part; nothing here communicates."""
    labels = roll_labels(input_ids)  # on the whole row, before the split
    length = input_ids.shape[0]
    padding = -length % sp_size
    if padding:  # a trailing sequence of its own, positions from 0
        input_ids = torch.cat([input_ids, input_ids.new_zeros(padding)])
        labels = torch.cat([labels, labels.new_zeros(padding)])
        position_ids = torch.cat([position_ids, torch.arange(padding, device=position_ids.device)])
        cu_seq_lens = torch.cat([cu_seq_lens, cu_seq_lens.new_tensor([length + padding])])
    total = length + padding
    local = slice(sp_rank * (total // sp_size), (sp_rank + 1) * (total // sp_size))
    predicts = torch.zeros(total, dtype=torch.bool, device=input_ids.device)
    predicts[predicting] = True
    rows, slots = segment_layout(cu_seq_lens)
    return SequenceShard(
        group=group,
        sp_size=sp_size,
        sp_rank=sp_rank,
        total_length=total,
        input_ids=input_ids[local],
        position_ids=position_ids[local],
        labels=labels[local],
        predicting_local=predicts[local].nonzero()[:, 0],
        rows=rows,
        slots=slots,
    )


def segment_layout(cu_seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[n, longest]`` (the row index of each sequence's token ``p``; 0 past its end) and
    ``slots`` ``[T]`` (``sequence * longest + p`` of each token) for sequences bounded by
    ``cu_seq_lens``."""
    boundaries = cu_seq_lens.long()
    starts, lengths = boundaries[:-1], boundaries[1:] - boundaries[:-1]
    longest = int(lengths.max())
    p = torch.arange(longest, device=boundaries.device)[None]
    rows = torch.where(p < lengths[:, None], starts[:, None] + p, torch.zeros_like(p))
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=boundaries.device), lengths)
    slots = (
        sequence * longest + torch.arange(int(boundaries[-1]), device=boundaries.device) - starts[sequence]
    )
    return rows, slots


# -- the all-to-all around attention --------------------------------------------------------------


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[S/sp, H, D]`` on every rank -> ``[S, H/sp, D]``: rank ``r`` gets heads ``r H/sp ..`` of
    every rank's tokens, in rank (= sequence) order."""
    sp = dist.get_world_size(group)
    local, heads, dim = x.shape
    send = x.reshape(local, sp, heads // sp, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.reshape(sp * local, heads // sp, dim)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse: ``[S, H/sp, D]`` -> ``[S/sp, H, D]``."""
    sp = dist.get_world_size(group)
    total, heads, dim = x.shape
    send = x.reshape(sp, total // sp, heads, dim).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(total // sp, sp * heads, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_sequence(grad.contiguous(), ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sequence_to_heads(grad.contiguous(), ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[S/sp, H, D]`` -> ``[S, H/sp, D]`` over ``group``, differentiable (its backward is the inverse)."""
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[S, H/sp, D]`` -> ``[S/sp, H, D]`` over ``group``, differentiable."""
    return _HeadsToSequence.apply(x, group)


def repeat_kv_heads(x: torch.Tensor, sp_size: int) -> torch.Tensor:
    """``[S/sp, KV, D]`` keys or values with at least ``sp_size`` heads: fewer are repeated in place
    (head ``j`` becomes heads ``j * sp/KV ..``), so that after the all-to-all SP rank ``r`` holds KV head
    ``r KV / sp``, the one its query heads ``r H/sp ..`` attend with."""
    heads = x.shape[1]
    return x if heads % sp_size == 0 else x.repeat_interleave(sp_size // heads, dim=1)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: ``[S, h, D]`` queries, ``[S, h_kv, D]``
    keys and values, sequences laid out by ``segment_layout``; returns ``[S, h, D]``. Each sequence is
    gathered into its own padded row and SDPA runs causally there, so no token sees another sequence
    and no quadratic ``[S, S]`` mask is built."""
    sequences, longest = rows.shape

    def padded(x: torch.Tensor) -> torch.Tensor:  # [S, h, D] -> [sequences, h, longest, D]
        # index_select, whose backward is an index_add (fast on the CPU, unlike advanced indexing's).
        return x.index_select(0, rows.flatten()).view(sequences, longest, *x.shape[1:]).transpose(1, 2)

    mask = None
    if sliding_window is not None:
        positions = torch.arange(longest, device=query.device)
        offset = positions[:, None] - positions[None, :]
        mask = (offset >= 0) & (offset < sliding_window)
    output = F.scaled_dot_product_attention(
        padded(query),
        padded(key),
        padded(value),
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    output = output.transpose(1, 2).reshape(sequences * longest, *query.shape[1:])
    return output.index_select(0, slots)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``[1, H, S/sp, D]`` queries and ``[1, KV, S/sp, D]`` keys and
    values of this rank's shard (``ulysses_shard`` in the keyword arguments) -> ``[1, S/sp, H, D]``,
    attending over the whole sequence. Calls without a shard are plain ``sdpa``."""
    shard: SequenceShard | None = kwargs.pop(SHARD_KWARG, None)
    if shard is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError(f"sequence-parallel attention takes one packed row, got a batch of {query.shape[0]}")
    group = shard.group
    q = sequence_to_heads(query[0].transpose(0, 1), group)
    k = sequence_to_heads(repeat_kv_heads(key[0].transpose(0, 1), shard.sp_size), group)
    v = sequence_to_heads(repeat_kv_heads(value[0].transpose(0, 1), shard.sp_size), group)
    output = segment_attention(q, k, v, shard.rows, shard.slots, scaling, dropout, sliding_window)
    return heads_to_sequence(output, group)[None], None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
# Calls without a shard (a padded batch) need the mask sdpa needs.
AttentionMaskInterface.register(ULYSSES_ATTENTION, sdpa_mask)


# -- outputs --------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[S/sp, ...]`` into ``[S, ...]``; backward: this rank's part of the gradient times
    ``grad_scale``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, grad_scale: float) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.length, ctx.grad_scale = dist.get_rank(group), local.shape[0], grad_scale
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mine = grad[ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length]
        return mine * ctx.grad_scale, None, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, grad_scale: float) -> torch.Tensor:
    """This rank's ``[S/sp]`` outputs gathered into the whole row ``[S]`` on every rank of ``group``.

    Every SP rank computes the same loss from the gathered row; the gradient of the shard's own
    positions flows back, times ``grad_scale``. With ``grad_scale = sp`` (what the engine passes) the
    gradients equal the unsplit run's: FSDP divides the sum over all ``dp x sp`` ranks by their number,
    but the SP ranks' parts add up to one DP rank's gradient, so the division by ``sp`` is undone here.
    """
    return _GatherSequence.apply(local, group, grad_scale)


def ulysses_forward(
    model: torch.nn.Module,
    micro_batch: TensorDict,
    role: str,
    group: dist.ProcessGroup,
    logits_chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """``forward_micro_batch`` (core's, same outputs) for one micro-batch split over the SP ``group``.

    The micro-batch runs padding-free whatever ``micro_batch.packing`` says (the split works on the
    packed row), without shared prompts: a shared prompt's last token predicts several responses'
    first tokens, which one label per position cannot say. Returns ``log_probs`` (+ ``entropy``, and
    the ``[b, R, k]`` top-k and candidate outputs the micro-batch asks for) or ``values`` ``[b, R]``,
    identical on every rank of the group, 0 on padding.
    """
    responses = micro_batch[RESPONSES]
    packed = pack_sequences(micro_batch[ATTENTION_MASK], responses.shape[-1])
    shard = shard_sequence(
        micro_batch[INPUT_IDS][packed.mask],
        packed.position_ids[0],
        packed.cu_seq_lens,
        packed.predicting,
        group,
        dist.get_world_size(group),
        dist.get_rank(group),
    )
    inputs = {
        "input_ids": shard.input_ids[None],
        "position_ids": shard.position_ids[None],
        "attention_mask": _NO_MASK,
        "use_cache": False,
        SHARD_KWARG: shard,
    }
    present = packed.response_present
    if role == "lm":
        candidates = None
        if CANDIDATE_IDS in micro_batch:  # laid out like the labels: on the whole row, then this shard's part
            given = micro_batch[CANDIDATE_IDS][present]
            row = given.new_zeros(shard.total_length, given.shape[-1])
            row[packed.predicting] = given
            length = shard.input_ids.shape[0]
            candidates = row[shard.sp_rank * length : (shard.sp_rank + 1) * length]
        local = _local_log_probs(model, inputs, shard, candidates, micro_batch, logits_chunk_size)
    else:
        local = {VALUES: model(**inputs).logits[0, :, 0].float()}
    return {
        name: scatter_positions(
            gather_sequence(values, group, grad_scale=shard.sp_size)[packed.predicting], present
        )
        for name, values in local.items()
    }


def _local_log_probs(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    shard: SequenceShard,
    candidates: torch.Tensor | None,
    micro_batch: TensorDict,
    logits_chunk_size: int | None,
) -> dict[str, torch.Tensor]:
    """``lm_head_outputs`` of the shard's labels (and ``candidates`` ``[S/sp, k]``, or None) at the
    positions that predict response tokens, ``[S/sp, ...]`` with 0 elsewhere. Beyond
    ``logits_chunk_size`` predicted tokens (for models whose logits are their LM head applied to the
    last hidden state) the head runs a chunk at a time."""
    where = shard.predicting_local
    labels = shard.labels[where]
    candidates = None if candidates is None else candidates[where]
    head_model = plain_head_model(model)
    if logits_chunk_size is None or where.numel() <= logits_chunk_size or head_model is None:
        logits = model(**inputs, logits_to_keep=where).logits[0]
        outputs = lm_head_outputs(micro_batch, labels, candidates, logits=logits)
    else:
        caught: list[torch.Tensor] = []
        handle = head_model.base_model.register_forward_hook(
            lambda _module, _args, output: caught.append(output.last_hidden_state)
        )
        try:  # the head computes nothing; the final norm's output is caught on its way to it
            model(**inputs, logits_to_keep=where.new_zeros(0))
        finally:
            handle.remove()
        head = head_model.get_output_embeddings()  # read after the forward: FSDP holds it gathered
        outputs = lm_head_outputs(
            micro_batch,
            labels,
            candidates,
            hidden=caught[0][0][where],
            head=head,
            chunk_size=logits_chunk_size,
        )
    length = shard.input_ids.shape[0]
    return {
        name: value.new_zeros(length, *value.shape[1:]).index_put((where,), value)
        for name, value in outputs.items()
    }
