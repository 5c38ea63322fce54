"""The megatron backend's options and the checks that need no megatron-core: the parallel layout
against a model and a world size, and the Hugging Face config translated into megatron-core terms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, Qwen2Config

from verl_core.config.validators import InvalidValue
from verl_core.errors import ConfigError
from verl_megatron.config import MegatronConfig, check_layout
from verl_megatron.hf_config import megatron_model_config

WHERE = "actor.engine.megatron"


def expected_problems(tp, pp, vpp, heads, kv_heads, layers, world_size) -> list[str]:
    """The layout rules written out: the option paths that must be reported, in order."""
    problems = []
    problems += [f"{WHERE}.tensor_model_parallel_size"] * ((heads % tp != 0) + (kv_heads % tp != 0))
    if layers % (pp * (vpp or 1)):
        problems.append(f"{WHERE}.pipeline_model_parallel_size")
    if vpp is not None and pp == 1:
        problems.append(f"{WHERE}.virtual_pipeline_model_parallel_size")
    if world_size % (tp * pp):
        problems.append(f"{WHERE}.tensor_model_parallel_size")
    return problems


@given(
    tp=st.integers(1, 8),
    pp=st.integers(1, 8),
    vpp=st.none() | st.integers(1, 4),
    kv_heads=st.integers(1, 8),
    group=st.integers(1, 4),
    layers=st.integers(1, 32),
    world_size=st.integers(1, 64),
)
def test_the_layout_is_refused_exactly_where_it_cannot_split_the_model(
    tp, pp, vpp, kv_heads, group, layers, world_size
) -> None:
    heads = kv_heads * group
    model = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers}
    options = MegatronConfig(tp, pp, vpp)
    expected = expected_problems(tp, pp, vpp, heads, kv_heads, layers, world_size)
    if not expected:
        check_layout(options, model, world_size, transformer_engine=False, where=WHERE)
        return
    with pytest.raises(ConfigError) as caught:
        check_layout(options, model, world_size, transformer_engine=False, where=WHERE)
    assert [path for path, _ in caught.value.errors] == expected


def test_layout_errors_say_what_would_work() -> None:
    model = {"num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 6}
    with pytest.raises(ConfigError) as caught:
        check_layout(MegatronConfig(3, 4), model, world_size=8, transformer_engine=False, where=WHERE)
    messages = [message for _, message in caught.value.errors]
    assert "3 does not divide the model's 4 num_key_value_heads: use one of [1, 2, 4]" in messages[0]
    assert "4 pipeline stages do not divide the model's 6 num_hidden_layers" in messages[1]
    assert "TP 3 x PP 4 = 12 does not divide the 8 ranks" in messages[2]


@pytest.mark.parametrize(
    ("options", "transformer_engine", "path", "fix"),
    [
        (MegatronConfig(2, sequence_parallel=True), False, "sequence_parallel", "needs transformer-engine"),
        (
            MegatronConfig(1, sequence_parallel=True),
            True,
            "sequence_parallel",
            "raise tensor_model_parallel_size",
        ),
        (
            MegatronConfig(transformer_impl="transformer_engine"),
            False,
            "transformer_impl",
            "use 'auto' or 'local'",
        ),
    ],
)
def test_gpu_only_features_are_refused_without_what_they_need(options, transformer_engine, path, fix) -> None:
    model = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    with pytest.raises(ConfigError) as caught:
        check_layout(options, model, world_size=2, transformer_engine=transformer_engine, where=WHERE)
    [(got_path, message)] = caught.value.errors
    assert got_path == f"{WHERE}.{path}" and fix in message


def test_sequence_parallel_with_transformer_engine_and_tp_is_accepted() -> None:
    model = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    check_layout(MegatronConfig(2, sequence_parallel=True), model, 2, transformer_engine=True)


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_sizes_must_be_positive(field) -> None:
    with pytest.raises(InvalidValue, match=f"{field}: must be > 0, got 0"):
        MegatronConfig(**{field: 0})


# -- the Hugging Face config in megatron-core's terms ----------------------------------------------


def test_qwen2_maps_with_qkv_biases_gqa_and_its_rope_base() -> None:
    hf = Qwen2Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    ).to_dict()
    mapped = megatron_model_config(hf)
    assert mapped["transformer"] == {
        "num_layers": 3,
        "hidden_size": 64,
        "ffn_hidden_size": 176,
        "num_attention_heads": 8,
        "num_query_groups": 2,
        "kv_channels": 8,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-5,
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "init_method_std": 0.02,
    }
    assert mapped["gpt"] == {
        "vocab_size": 1000,
        "max_sequence_length": 512,
        "position_embedding_type": "rope",
        "rotary_base": 1e6,
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": True,
    }


def test_llama_maps_without_biases_and_with_its_own_head_dim() -> None:
    hf = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=False,
    ).to_dict()
    mapped = megatron_model_config(hf)
    assert mapped["transformer"]["add_qkv_bias"] is False
    assert mapped["transformer"]["kv_channels"] == 32 and mapped["transformer"]["num_query_groups"] == 4
    assert mapped["gpt"]["share_embeddings_and_output_weights"] is False
    assert mapped["gpt"]["rotary_base"] == 10000.0


@pytest.mark.parametrize(
    ("hf", "named"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
        (LlamaConfig(attention_bias=True).to_dict(), "attention_bias"),
        (
            {
                **LlamaConfig().to_dict(),
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
            },
            "llama3",
        ),
        (Qwen2Config(use_sliding_window=True).to_dict(), "use_sliding_window"),
        (LlamaConfig(hidden_act="gelu").to_dict(), "hidden_act 'gelu'"),
        # a config from before transformers 5 keeps RoPE scaling in rope_scaling
        (
            {**LlamaConfig().to_dict(), "rope_parameters": None, "rope_scaling": {"type": "dynamic"}},
            "'dynamic'",
        ),
    ],
)
def test_what_megatron_core_cannot_reproduce_is_refused_by_name(hf, named) -> None:
    with pytest.raises(ConfigError) as caught:
        megatron_model_config(hf, where="actor.engine.model.path")
    [(path, message)] = caught.value.errors
    assert path == "actor.engine.model.path" and named in message
