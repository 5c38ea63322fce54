"""Descriptors of core's built-in rollout backends, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import RolloutBackend

ROLLOUT_BACKENDS: tuple[RolloutBackend, ...] = (
    RolloutBackend(
        name="hf",
        rollout="verl_core.rollout.hf:HFRollout",
        config="verl_core.rollout.config:HFRolloutConfig",
        devices=("cpu", "cuda"),
        description="Hugging Face causal LMs with core's own KV-cache decoding loop; weights synced in memory",
    ),
)
