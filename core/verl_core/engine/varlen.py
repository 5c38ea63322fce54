"""Attention for padding-free (packed) micro-batches that costs what padded attention costs.

A packed micro-batch (``pack_sequences``) is one row of ``T`` real tokens whose positions restart at
every sequence. Flash-attention's variable-length kernels run it as it is (transformers passes the
sequence boundaries, ``cu_seq_lens_q``, to ``flash_attention_*``). ``sdpa`` has no such kernel:
transformers builds a ``[T, T]`` block-diagonal mask and attends over the whole row, quadratic in
``T``, which on CPU cost more than the padding it saved. ``VARLEN_SDPA`` runs only the attention
padded: queries, keys and values are scattered into ``[sequences, heads, longest, head_dim]``, SDPA
runs causally there, and the outputs are gathered back, while every other layer (projections, MLP,
norms, the LM head) runs on the real tokens alone. Right padding needs no mask: under the causal
mask a real query sees only earlier positions of its own sequence.

Calls without sequence boundaries (ordinary padded batches, decoding with a cache) go to
transformers' ``sdpa`` unchanged, so a model loaded with ``VARLEN_SDPA`` computes what ``sdpa``
computes everywhere else. ``load_hf_model`` loads ``sdpa`` models this way when
``micro_batch.packing`` is on; ``packed_model_inputs`` gives what a packed forward passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:
    from verl_core.engine.hf import PackedSequences

#: The attention implementation a packed ``sdpa`` model is loaded with (registered with transformers).
VARLEN_SDPA = "verl_varlen_sdpa"
#: Implementations whose kernels take ``cu_seq_lens_q`` themselves.
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
#: Stands in for the attention mask of a packed call: transformers passes a 4-D mask through
#: untouched instead of building the ``[T, T]`` one, and ``varlen_sdpa_attention`` never reads it.
#: Empty, so that any other attention function given it fails loudly instead of computing with it.
_NO_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)


def attn_implementation_for(name: str, packing: bool) -> str:
    """The implementation to load a model with: ``VARLEN_SDPA`` in place of ``sdpa`` when packing."""
    return VARLEN_SDPA if packing and name == "sdpa" else name


def packed_model_inputs(model: torch.nn.Module, packed: PackedSequences) -> dict[str, Any]:
    """Keyword arguments for ``model(input_ids=..., **these)`` on a packed micro-batch: positions,
    sequence boundaries for variable-length kernels, and the attention mask that suits ``model``'s
    attention implementation (``eager`` and other implementations without a variable-length path
    get ``None``: transformers then builds the block-diagonal mask, correct but quadratic)."""
    implementation = getattr(getattr(model, "module", model).config, "_attn_implementation", None)
    boundaries = packed.cu_seq_lens
    longest = packed.longest
    return {
        "position_ids": packed.position_ids,
        "attention_mask": _NO_MASK if implementation == VARLEN_SDPA else None,
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
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
    """A transformers attention function: ``[1, heads, T, head_dim]`` packed inputs when
    ``cu_seq_lens_q`` is given, anything ``sdpa`` takes otherwise; returns ``[1, T, heads, head_dim]``."""
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None:
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
    longest = int(kwargs["max_length_q"])
    index, sequences = _padded_index(boundaries.to(query.device), query.shape[2], longest)
    mask = None
    if sliding_window is not None:
        positions = torch.arange(longest, device=query.device)
        offset = positions[:, None] - positions[None, :]
        mask = (offset >= 0) & (offset < sliding_window)
    output = torch.nn.functional.scaled_dot_product_attention(
        _to_padded(query, index, sequences, longest),
        _to_padded(key, index, sequences, longest),
        _to_padded(value, index, sequences, longest),
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    # [sequences, heads, longest, dim] -> the packed tokens' rows, [1, T, heads, dim].
    output = output.transpose(1, 2).reshape(sequences * longest, *output.shape[1:2], output.shape[-1])
    return output[index][None], None


def _padded_index(boundaries: torch.Tensor, tokens: int, longest: int) -> tuple[torch.Tensor, int]:
    """For every packed token, its row in the flattened ``[sequences * longest]`` padded layout."""
    boundaries = boundaries.long()
    sequences = boundaries.numel() - 1
    sequence = torch.repeat_interleave(
        torch.arange(sequences, device=boundaries.device),
        boundaries[1:] - boundaries[:-1],
        output_size=tokens,
    )
    position = torch.arange(tokens, device=boundaries.device) - boundaries[:-1][sequence]
    return sequence * longest + position, sequences


def _to_padded(packed: torch.Tensor, index: torch.Tensor, sequences: int, longest: int) -> torch.Tensor:
    """``[1, heads, T, dim]`` -> ``[sequences, heads, longest, dim]``, zeros after each sequence."""
    tokens = packed[0].transpose(0, 1)  # [T, heads, dim]
    padded = tokens.new_zeros(sequences * longest, *tokens.shape[1:]).index_copy(0, index, tokens)
    return padded.view(sequences, longest, *tokens.shape[1:]).transpose(1, 2)


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
