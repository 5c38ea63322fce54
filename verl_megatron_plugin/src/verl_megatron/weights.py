"""Hugging Face <-> megatron-core weights for the Llama and Qwen2 families, tensor-parallel shards.

Every Hugging Face tensor belongs to one ``TensorMap``: the Hugging Face names it joins, the
megatron-core parameter they become (its name inside one ``GPTModel`` chunk), and how that parameter
is laid out over the TP ranks:

- ``replicated``: the same on every TP rank (norms, the value head);
- ``column``: split on dim 0 (embedding and output rows: the vocabulary);
- ``row``: split on dim 1 (the attention output and MLP down projections);
- ``qkv``: q, k and v fused per query group, ``[q heads of group g, k_g, v_g]`` for each group g, then
  split on dim 0 by whole groups (weights and Qwen2's biases alike);
- ``fc1``: gate and up fused, each TP rank holding ``[its rows of gate, its rows of up]``.

``to_megatron`` cuts this rank's shard from the Hugging Face tensors; ``to_hf`` joins the shards of
every TP rank back into the Hugging Face tensors, exactly (only copies and reshapes). Nothing here
imports megatron-core: the engine supplies which layers a pipeline stage holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

Split = Literal["replicated", "column", "row", "qkv", "fc1"]


@attrs.frozen
class Heads:
    """What the ``qkv`` layout needs: query heads, query groups (KV heads), channels per head."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    @classmethod
    def of(cls, transformer: Mapping[str, Any]) -> Heads:
        """From ``hf_config.megatron_model_config(...)["transformer"]``."""
        return cls(
            transformer["num_attention_heads"], transformer["num_query_groups"], transformer["kv_channels"]
        )


@attrs.frozen
class TensorMap:
    """Hugging Face tensors ``hf_names`` <-> the megatron-core parameter ``megatron_name``.

    ``stage`` says which pipeline position holds it: ``"first"`` (embedding), ``"last"`` (final norm
    and head), or the global index of the decoder layer.
    """

    hf_names: tuple[str, ...]
    megatron_name: str
    split: Split
    stage: str | int
    #: For the vocabulary's rows (embedding, LM head): ``(rows, padded rows)``. megatron-core splits
    #: them evenly over the TP ranks, so a vocabulary that TP does not divide gets zero rows appended
    #: (never looked up, their logits cut off: they change nothing and stay zero).
    vocab: tuple[int, int] | None = None

    def to_megatron(
        self, hf: Sequence[torch.Tensor], tp_rank: int, tp_size: int, heads: Heads
    ) -> torch.Tensor:
        """This TP rank's shard of the megatron-core parameter, from the Hugging Face tensors."""
        if self.split == "replicated":
            return hf[0]
        if self.vocab is not None:
            rows, padded = self.vocab
            hf = [torch.cat([hf[0], hf[0].new_zeros(padded - rows, *hf[0].shape[1:])])]
        if self.split in ("column", "row"):
            return hf[0].chunk(tp_size, dim=0 if self.split == "column" else 1)[tp_rank]
        if self.split == "fc1":
            gate, up = hf
            return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        return _fuse_qkv(*hf, heads).chunk(tp_size)[tp_rank]

    def to_hf(self, shards: Sequence[torch.Tensor], heads: Heads) -> list[torch.Tensor]:
        """The Hugging Face tensors from every TP rank's shard, in TP rank order."""
        if self.split == "replicated":
            return [shards[0]]
        if self.vocab is not None:
            return [torch.cat(list(shards))[: self.vocab[0]]]
        if self.split in ("column", "row"):
            return [torch.cat(list(shards), dim=0 if self.split == "column" else 1)]
        if self.split == "fc1":
            halves = [shard.chunk(2) for shard in shards]
            return [torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves])]
        return _split_qkv(torch.cat(list(shards)), heads)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Heads) -> torch.Tensor:
    groups = heads.num_query_groups
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    per_group = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, heads: Heads) -> list[torch.Tensor]:
    groups, dim = heads.num_query_groups, heads.head_dim
    q_rows = heads.num_attention_heads // groups * dim
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, q_rows + 2 * dim, *rest).split([q_rows, dim, dim], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary megatron-core holds: the next multiple of the TP size."""
    return -(-vocab_size // tp_size) * tp_size


def tensor_maps(
    num_layers: int,
    role: str,
    tied_embeddings: bool,
    qkv_bias: bool,
    fused_norms: bool = False,
    vocab: tuple[int, int] | None = None,
) -> list[TensorMap]:
    """Every tensor of the Hugging Face model, in the order of its state dict.

    ``role``: ``lm`` (``lm_head``) or ``value`` (``score``, a one-label token-classification head);
    ``fused_norms``: transformer-engine layers, which hold the pre-attention and pre-MLP norms inside
    ``linear_qkv`` and ``linear_fc1``; ``vocab``: ``(vocab_size, padded_vocab_size(...))`` when they
    differ. A tied ``lm_head`` maps to the embedding (``first``).
    """
    vocab = vocab if vocab is not None and vocab[0] != vocab[1] else None
    embedding = TensorMap(
        ("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "column", "first", vocab
    )
    maps = [embedding]
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"
    for layer in range(num_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        qkv = ("q_proj", "k_proj", "v_proj")
        layer_maps = [
            TensorMap(
                tuple(f"{hf}self_attn.{p}.weight" for p in qkv),
                f"{mg}self_attention.linear_qkv.weight",
                "qkv",
                layer,
            )
        ]
        if qkv_bias:
            layer_maps.append(
                TensorMap(
                    tuple(f"{hf}self_attn.{p}.bias" for p in qkv),
                    f"{mg}self_attention.linear_qkv.bias",
                    "qkv",
                    layer,
                )
            )
        layer_maps += [
            TensorMap(
                (f"{hf}self_attn.o_proj.weight",), f"{mg}self_attention.linear_proj.weight", "row", layer
            ),
            TensorMap(
                (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
                f"{mg}mlp.linear_fc1.weight",
                "fc1",
                layer,
            ),
            TensorMap((f"{hf}mlp.down_proj.weight",), f"{mg}mlp.linear_fc2.weight", "row", layer),
            TensorMap((f"{hf}input_layernorm.weight",), f"{mg}{input_norm}", "replicated", layer),
            TensorMap((f"{hf}post_attention_layernorm.weight",), f"{mg}{mlp_norm}", "replicated", layer),
        ]
        maps += layer_maps
    maps.append(TensorMap(("model.norm.weight",), "decoder.final_layernorm.weight", "replicated", "last"))
    if role == "value":
        maps += [
            TensorMap(("score.weight",), "output_layer.weight", "replicated", "last"),
            TensorMap(("score.bias",), "output_layer.bias", "replicated", "last"),
        ]
    elif tied_embeddings:
        maps.append(
            TensorMap(("lm_head.weight",), "embedding.word_embeddings.weight", "column", "first", vocab)
        )
    else:
        maps.append(TensorMap(("lm_head.weight",), "output_layer.weight", "column", "last", vocab))
    return maps


def hf_order(maps: Sequence[TensorMap], hf_names: Sequence[str]) -> list[tuple[str, TensorMap, int]]:
    """``(hf_name, map, index in map.hf_names)`` for each of ``hf_names`` (a Hugging Face state dict's
    keys, in order); a name without a map is a ``KeyError`` naming it."""
    by_name = {name: (m, index) for m in maps for index, name in enumerate(m.hf_names)}
    missing = [name for name in hf_names if name not in by_name]
    if missing:
        raise KeyError(f"no megatron-core parameter maps the Hugging Face tensors {missing}")
    return [(name, *by_name[name]) for name in hf_names]
