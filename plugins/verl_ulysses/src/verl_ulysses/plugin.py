"""The hook implementations verl-core discovers through the ``verl_core.plugins`` entry point ``ulysses``.

Keep this module light: it must not import torch or the engine, so that listing plugins stays
fast. The engine and its options are named by import strings and imported only when selected.
"""

from __future__ import annotations

from verl_core import EngineBackend, hookimpl


@hookimpl
def verl_engine_backends() -> list[EngineBackend]:
    return [
        EngineBackend(
            name="ulysses",
            engine="verl_ulysses.engine:UlyssesEngine",
            config="verl_ulysses.config:UlyssesConfig",
            roles=("lm", "value"),
            devices=("cpu", "cuda"),
            api_version=1,  # the engine API this engine implements: a core speaking another refuses it
            # LoRA from core's toolkit (HFEngine's adapter); the kit's lora check passes at sp 2.
            lora=True,
            # Prompts shared at sp 1 (HFEngine's packing); at sp > 1 each sample's sequence is split over
            # the sp ranks, and every sample packs its own prompt.
            shared_prompts=True,
            # Top-k and candidate log-probs from core's toolkit, at sp > 1 too (each SP rank's tokens).
            top_k_log_probs=True,
            description="VeOmni-style: FSDP2 over a (dp_shard, sp) mesh with Ulysses sequence parallelism, "
            "meta-device init from rank 0, DCP checkpoints",
        )
    ]
