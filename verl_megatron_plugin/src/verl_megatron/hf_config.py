"""A Hugging Face model config translated into megatron-core's terms, for the Llama and Qwen2 families.

``megatron_model_config(hf)`` takes the config as a mapping (``PretrainedConfig.to_dict()`` or
``config.json``) and returns plain values in two groups: ``transformer`` (``TransformerConfig``
fields) and ``gpt`` (``GPTModel`` arguments); the activation is named (``"silu"``), not a function,
so that nothing here imports torch or megatron-core. What megatron-core cannot express the same way
is refused with the key that asks for it, never approximated: a model that computed something else
than its Hugging Face twin would train silently wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_core.errors import ConfigError

#: The ``model_type`` values mapped. Qwen2's q/k/v projections always have biases (no config key);
#: Llama's ``attention_bias`` would put one on the output projection too, which is refused.
FAMILIES = ("llama", "qwen2")
#: RoPE variants megatron-core computes like transformers does.
ROPE_TYPES = ("default",)


def megatron_model_config(hf: Mapping[str, Any], where: str = "model.path") -> dict[str, dict[str, Any]]:
    """``{"transformer": {...}, "gpt": {...}}`` for the model ``hf`` describes; a ``ConfigError``
    at ``where`` (the model's config path) naming each key megatron-core cannot reproduce."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            [(where, f"model_type {model_type!r}: the megatron backend maps {list(FAMILIES)} (Llama, Qwen2)")]
        )
    rope = _rope_parameters(hf)
    errors = [(where, problem) for problem in _unsupported(hf, model_type, rope)]
    if errors:
        raise ConfigError(errors)
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    transformer = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hidden,
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hidden // heads,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf["rms_norm_eps"],
        "gated_linear_unit": True,  # gate_proj and up_proj, fused into fc1
        "activation": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
        "init_method_std": hf.get("initializer_range", 0.02),
    }
    gpt = {
        "vocab_size": hf["vocab_size"],
        "max_sequence_length": hf["max_position_embeddings"],
        "position_embedding_type": "rope",
        "rotary_base": rope["rope_theta"],
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
    }
    return {"transformer": transformer, "gpt": gpt}


def _unsupported(hf: Mapping[str, Any], model_type: str, rope: Mapping[str, Any]) -> list[str]:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r}: the mapped families use 'silu' (SwiGLU)")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        problems.append(
            "attention_bias / mlp_bias: Llama's biases sit on every projection (output and MLP included), "
            "which megatron-core's add_qkv_bias does not express"
        )
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        problems.append(
            f"rope type {rope_type!r} (rope_parameters / rope_scaling): the megatron backend maps {list(ROPE_TYPES)}"
        )
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window: sliding-window attention is not mapped")
    return problems


def _rope_parameters(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 keeps RoPE in ``rope_parameters``; earlier configs in ``rope_theta`` and
    ``rope_scaling``."""
    parameters = hf.get("rope_parameters")
    if parameters:
        return parameters
    scaling = hf.get("rope_scaling") or {}
    return {
        "rope_theta": hf.get("rope_theta", 10000.0),
        "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
    }
