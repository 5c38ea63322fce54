"""The hook implementations verl-core discovers through the ``verl_core.plugins`` entry point ``megatron``.

Keep this module light: it must not import torch, megatron-core or the engine, so that listing
plugins stays fast. The engine and its options are named by import strings and imported only when
selected.
"""

from __future__ import annotations

from verl_core import EngineBackend, hookimpl


@hookimpl
def verl_engine_backends() -> list[EngineBackend]:
    return [
        EngineBackend(
            name="megatron",
            engine="verl_megatron.engine:MegatronEngine",
            config="verl_megatron.config:MegatronConfig",
            roles=("lm", "value"),
            devices=("cpu", "cuda"),
            api_version=1,  # the engine API this engine implements: a core speaking another refuses it
            # No top_k_log_probs: the vocabulary is split over the tensor-parallel ranks, so a top-k
            # and log-probs at given ids would need collectives of their own (docs/engine.md).
            description="megatron-core GPTModel: tensor, pipeline (virtual stages) and data parallelism, "
            "Llama and Qwen2 families",
        )
    ]
