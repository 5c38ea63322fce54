"""Hugging Face <-> megatron-core weights (``verl_megatron.weights``), without megatron-core: the
layouts against their rules written out, exact round trips at every TP size, and a map for every
tensor of the Hugging Face models, in state-dict order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from verl_core.testing.tiny import TinyModelSpec
from verl_megatron.weights import Heads, TensorMap, hf_order, padded_vocab_size, tensor_maps

HIDDEN = 6


@st.composite
def attention(draw):
    """Heads, query groups, channels per head, and a TP size that divides the groups."""
    groups = draw(st.integers(1, 4))
    heads = Heads(groups * draw(st.integers(1, 3)), groups, draw(st.integers(1, 3)))
    tp = draw(st.sampled_from([d for d in range(1, groups + 1) if groups % d == 0]))
    return heads, tp


def numbered(*shape: int, start: int = 0) -> torch.Tensor:
    """Distinct values: any misplaced element shows."""
    return torch.arange(start, start + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)


def qkv_tensors(heads: Heads, bias: bool) -> list[torch.Tensor]:
    rest = () if bias else (HIDDEN,)
    q = numbered(heads.num_attention_heads * heads.head_dim, *rest)
    k = numbered(heads.num_query_groups * heads.head_dim, *rest, start=10_000)
    v = numbered(heads.num_query_groups * heads.head_dim, *rest, start=20_000)
    return [q, k, v]


@settings(max_examples=60, deadline=None)
@given(layout=attention(), bias=st.booleans())
def test_qkv_shards_hold_whole_query_groups_laid_out_q_k_v(layout, bias):
    heads, tp = layout
    q, k, v = qkv_tensors(heads, bias)
    qkv = TensorMap(("q", "k", "v"), "linear_qkv", "qkv", 0)
    d, per_group = heads.head_dim, heads.num_attention_heads // heads.num_query_groups
    groups_per_rank = heads.num_query_groups // tp
    for rank in range(tp):
        shard = qkv.to_megatron([q, k, v], rank, tp, heads)
        expected = []
        for group in range(rank * groups_per_rank, (rank + 1) * groups_per_rank):
            expected += [
                q[(group * per_group + h) * d : (group * per_group + h + 1) * d] for h in range(per_group)
            ]
            expected += [k[group * d : (group + 1) * d], v[group * d : (group + 1) * d]]
        assert torch.equal(shard, torch.cat(expected))


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), rows=st.integers(1, 3))
def test_fc1_shards_hold_their_rows_of_gate_then_of_up(tp, rows):
    gate, up = numbered(tp * rows, HIDDEN), numbered(tp * rows, HIDDEN, start=10_000)
    fc1 = TensorMap(("gate", "up"), "linear_fc1", "fc1", 0)
    for rank in range(tp):
        part = slice(rank * rows, (rank + 1) * rows)
        assert torch.equal(fc1.to_megatron([gate, up], rank, tp, None), torch.cat([gate[part], up[part]]))


@settings(max_examples=60, deadline=None)
@given(
    layout=attention(),
    bias=st.booleans(),
    split=st.sampled_from(["qkv", "fc1", "column", "row", "replicated"]),
)
def test_every_layout_round_trips_exactly(layout, bias, split):
    heads, tp = layout
    if split == "qkv":
        hf = qkv_tensors(heads, bias)
    elif split == "fc1":
        hf = [numbered(4 * tp, HIDDEN), numbered(4 * tp, HIDDEN, start=10_000)]
    else:
        hf = [numbered(2 * tp, 3 * tp)]
    tensor_map = TensorMap(tuple(f"t{i}" for i in range(len(hf))), "p", split, 0)
    shards = [tensor_map.to_megatron(hf, rank, tp, heads) for rank in range(tp)]
    back = tensor_map.to_hf(shards, heads)
    assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf, strict=True))


def test_a_layout_that_fuses_q_k_v_whole_is_not_what_megatron_core_reads():
    # With more than one query group the per-group layout differs from plain concatenation: the
    # engine's logits test catches the latter (test_megatron_engine.py).
    heads = Heads(4, 2, 2)
    q, k, v = qkv_tensors(heads, bias=False)
    qkv = TensorMap(("q", "k", "v"), "linear_qkv", "qkv", 0)
    assert not torch.equal(qkv.to_megatron([q, k, v], 0, 1, heads), torch.cat([q, k, v]))


def hf_names(arch: str, role: str, tied: bool) -> list[str]:
    spec = TinyModelSpec(arch=arch)
    config = spec.hf_config(num_labels=1 if role == "value" else None)
    config.tie_word_embeddings = tied
    model_class = AutoModelForTokenClassification if role == "value" else AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(config)
    return list(model.state_dict())


@pytest.mark.parametrize(
    ("arch", "role", "tied"),
    [("qwen2", "lm", False), ("qwen2", "lm", True), ("qwen2", "value", False), ("llama", "lm", False)],
)
def test_every_hugging_face_tensor_has_one_map_in_state_dict_order(arch, role, tied):
    names = hf_names(arch, role, tied)
    maps = tensor_maps(2, role, tied_embeddings=tied, qkv_bias=arch == "qwen2")
    ordered = hf_order(maps, names)
    assert [name for name, _, _ in ordered] == names
    assert {name for m in maps for name in m.hf_names} == set(names)
    if tied and role == "lm":
        (head,) = [m for name, m, _ in ordered if name == "lm_head.weight"]
        assert head.megatron_name == "embedding.word_embeddings.weight" and head.stage == "first"


def test_a_tensor_without_a_map_is_named():
    maps = tensor_maps(1, "lm", tied_embeddings=False, qkv_bias=False)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_norm.weight"):
        hf_order(maps, ["model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight"])


def test_transformer_engine_layers_hold_the_norms_in_their_linear_layers():
    maps = {m.hf_names[0]: m.megatron_name for m in tensor_maps(1, "lm", False, False, fused_norms=True)}
    assert (
        maps["model.layers.0.input_layernorm.weight"]
        == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        maps["model.layers.0.post_attention_layernorm.weight"]
        == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), tp=st.sampled_from([1, 2, 4, 8]))
def test_a_vocabulary_tp_does_not_divide_is_padded_with_zero_rows_and_cut_back(rows, tp):
    padded = padded_vocab_size(rows, tp)
    assert padded % tp == 0 and rows <= padded < rows + tp
    embedding = numbered(rows, HIDDEN, start=1)
    tensor_map = tensor_maps(1, "lm", False, False, vocab=(rows, padded))[0]
    shards = [tensor_map.to_megatron([embedding], rank, tp, None) for rank in range(tp)]
    assert all(shard.shape == (padded // tp, HIDDEN) for shard in shards)
    assert torch.equal(torch.cat(shards)[rows:], torch.zeros(padded - rows, HIDDEN, dtype=embedding.dtype))
    assert torch.equal(tensor_map.to_hf(shards, None)[0], embedding)
