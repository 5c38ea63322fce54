"""The hook implementations verl-core discovers through the ``verl_core.plugins`` entry point ``fsdp``.

Keep this module light: it must not import torch or the engine, so that listing plugins stays
fast. The engine and its options are named by import strings and imported only when selected.
"""

from __future__ import annotations

from verl_core import EngineBackend, hookimpl


@hookimpl
def verl_engine_backends() -> list[EngineBackend]:
    return [
        EngineBackend(
            name="fsdp",
            engine="verl_fsdp.engine:FSDPEngine",
            config="verl_fsdp.config:FSDPConfig",
            roles=("lm", "value"),
            devices=("cpu", "cuda"),
            api_version=1,  # the engine API this engine implements: a core speaking another refuses it
            lora=True,  # HFEngine's LoRA (docs/lora.md)
            shared_prompts=True,  # HFEngine's packed micro-batches (docs/engine.md)
            top_k_log_probs=True,  # HFEngine's top-k and candidate log-probs (docs/engine.md)
            description="PyTorch FSDP2 (fully_shard): sharded parameters, gradients and optimiser state",
        )
    ]
