"""Which device an engine computes on (moving a model there is the toolkit's ``offload``)."""

from __future__ import annotations

import os

import torch

from verl_core.deprecation import moved_names
from verl_core.errors import ConfigError


def device_type(name: str, where: str = "engine.device") -> str:
    """The device type an ``EngineConfig.device`` names: ``auto`` is ``cuda`` when available, else ``cpu``."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(name).type
    except RuntimeError as error:
        raise ConfigError([(where, f"{name!r} is not a device ({error}); use auto, cpu or cuda")]) from None


def resolve_device(name: str, where: str = "engine.device") -> torch.device:
    """The ``torch.device`` this process computes on for ``EngineConfig.device``.

    A bare ``cuda`` means this process's GPU: ``LOCAL_RANK`` (modulo the visible GPUs) when the
    launcher sets it (torchrun), else the current CUDA device (Ray gives each worker its own GPU).
    """
    kind = device_type(name, where)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError([(where, f"{name!r} needs CUDA, which is not available here; use cpu or auto")])
    device = torch.device(kind) if name == "auto" else torch.device(name)
    if device.type == "cuda" and device.index is None:
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) % torch.cuda.device_count() if local_rank else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return device


__getattr__ = moved_names(
    __name__, {"move_module": "verl_core.toolkit:move_module"}, since="0.2.0", removed_in="0.4.0"
)
