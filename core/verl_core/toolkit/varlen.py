"""Attention for padding-free (packed) micro-batches that costs what padded attention costs.

A packed micro-batch (``verl_core.toolkit.packing``) is one row of ``T`` real tokens whose positions
restart at every sequence. Flash-attention's variable-length kernels run it as it is (transformers
passes the sequence boundaries, ``cu_seq_lens_q``, to ``flash_attention_*``). ``sdpa`` has no such
kernel: transformers builds a ``[T, T]`` block-diagonal mask and attends over the whole row,
quadratic in ``T``, which on CPU cost more than the padding it saved. ``VARLEN_SDPA`` runs only the
attention padded: queries, keys and values are gathered into ``[samples, heads, longest, head_dim]``
by the layout's ``rows``, SDPA runs causally there, and each packed token's output is taken from its
``slots`` entry, while every other layer (projections, MLP, norms, the LM head) runs on the real
tokens alone. Right padding needs no mask: under the causal mask a real query sees only earlier
positions of its own sample, so what fills the positions after a sample's end (``rows`` holds 0
there) is never attended to, and no output or gradient comes from them. Because keys are gathered, several samples can read one packed copy of
a shared prompt (its gradient is the sum over them), which a ``cu_seq_lens`` layout cannot express.

Calls without a packed layout (ordinary padded batches, decoding with a cache) go to transformers'
``sdpa`` unchanged, so a model loaded with ``VARLEN_SDPA`` computes what ``sdpa`` computes
everywhere else. ``load_hf_model`` loads ``sdpa`` models this way when ``micro_batch.packing`` is on;
``packed_model_inputs`` gives what a packed forward passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from verl_core.toolkit.packing import PackedSequences

#: The attention implementation a packed ``sdpa`` model is loaded with (registered with transformers).
VARLEN_SDPA = "verl_varlen_sdpa"
#: Stands in for the attention mask of a packed call: transformers passes a 4-D mask through
#: untouched instead of building the ``[T, T]`` one, and ``varlen_sdpa_attention`` never reads it.
#: Empty, so that any other attention function given it fails loudly instead of computing with it.
_NO_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)


def attn_implementation_for(name: str, packing: bool) -> str:
    """The implementation to load a model with: ``VARLEN_SDPA`` in place of ``sdpa`` when packing."""
    return VARLEN_SDPA if packing and name == "sdpa" else name


def shares_prompts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention can read one packed copy of a prompt from several samples."""
    return _implementation(model) == VARLEN_SDPA


def packed_model_inputs(model: torch.nn.Module, packed: PackedSequences) -> dict[str, Any]:
    """Keyword arguments for ``model(input_ids=..., **these)`` on a packed micro-batch: positions,
    the layout for ``VARLEN_SDPA``, sequence boundaries for variable-length kernels, and the
    attention mask that suits ``model``'s attention implementation (``eager`` and other
    implementations without a variable-length path get ``None``: transformers then builds the
    block-diagonal mask from the restarting positions, correct but quadratic)."""
    inputs: dict[str, Any] = {"position_ids": packed.position_ids, "use_cache": False}
    if _implementation(model) == VARLEN_SDPA:
        return inputs | {"attention_mask": _NO_MASK, "packed_rows": packed.rows, "packed_slots": packed.slots}
    if packed.cu_seq_lens is None:
        raise ValueError(
            f"this packed micro-batch shares prompts between samples, which only {VARLEN_SDPA!r} attention "
            "reads; pack it without prompt groups"
        )
    return inputs | {
        "attention_mask": None,
        "cu_seq_lens_q": packed.cu_seq_lens,
        "cu_seq_lens_k": packed.cu_seq_lens,
        "max_length_q": packed.longest,
        "max_length_k": packed.longest,
    }


def varlen_sdpa_attention(
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
    """A transformers attention function: ``[1, heads, T, head_dim]`` packed inputs with their
    layout (``packed_rows`` and ``packed_slots`` of ``PackedSequences``), anything ``sdpa`` takes
    otherwise (transformers' own packed calls included: it builds their mask); returns
    ``[1, T, heads, head_dim]``."""
    rows, slots = kwargs.get("packed_rows"), kwargs.get("packed_slots")
    if rows is None:
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
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    samples, longest = rows.shape
    mask = None
    if sliding_window is not None:
        positions = torch.arange(longest, device=query.device)
        offset = positions[:, None] - positions[None, :]
        mask = (offset >= 0) & (offset < sliding_window)
    output = torch.nn.functional.scaled_dot_product_attention(
        _gather_padded(query, rows),
        _gather_padded(key, rows),
        _gather_padded(value, rows),
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    # [samples, heads, longest, dim] -> each packed token's slot, [1, T, heads, dim].
    output = output.transpose(1, 2).reshape(samples * longest, *output.shape[1:2], output.shape[-1])
    return output.index_select(0, slots)[None], None


def _implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "module", model).config, "_attn_implementation", None)


def _gather_padded(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[1, heads, T, dim]`` -> ``[samples, heads, longest, dim]`` by ``rows``."""
    tokens = packed[0]
    # index_select, not tokens[:, rows]: its backward is an index_add, which on the CPU is ~10x
    # faster than the accumulating index_put of advanced indexing.
    gathered = tokens.index_select(1, rows.flatten()).view(tokens.shape[0], *rows.shape, tokens.shape[2])
    return gathered.transpose(0, 1)


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
