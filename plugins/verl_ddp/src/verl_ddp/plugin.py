"""The hook implementations verl-core discovers through the ``verl_core.plugins`` entry point.

Keep this module light: it must not import torch or the engine, so that listing plugins stays
fast. The engine and its options are named by import strings and imported only when selected.
"""

from __future__ import annotations

from verl_core import EngineBackend, hookimpl


@hookimpl
def verl_engine_backends() -> list[EngineBackend]:
    return [
        EngineBackend(
            name="ddp",
            engine="verl_ddp.engine:DDPEngine",
            config="verl_ddp.config:DDPConfig",
            roles=("lm", "value"),
            devices=("cpu", "cuda"),
            api_version=1,  # the engine API this engine implements: a core speaking another refuses it
            lora=True,  # HFEngine's LoRA (docs/lora.md)
            shared_prompts=True,  # HFEngine's packed micro-batches (docs/engine.md)
            top_k_log_probs=True,  # HFEngine's top-k and candidate log-probs (docs/engine.md)
            description="torch DistributedDataParallel: full replicas, gloo on CPU, NCCL on GPU",
        )
    ]
