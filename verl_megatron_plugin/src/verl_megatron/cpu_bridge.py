"""Running megatron-core on a machine without CUDA, for tests and development: explicit and opt-in.

megatron-core assumes CUDA throughout: tensors made with ``device="cuda"`` or ``.cuda()`` (masks,
schedules, optimisers, checkpoint exchange), ``torch.cuda.current_device()`` as a device, the CUDA
RNG for its tensor-parallel RNG tracker, ``torch.cuda.synchronize()``, and dtype checks spelled
``tensor.type() == "torch.cuda.FloatTensor"``. ``enable()`` bridges exactly those, process-wide:

- a ``TorchFunctionMode`` that turns a CUDA device argument of any torch call into the CPU, makes
  ``Tensor.cuda()`` a no-op and answers ``Tensor.type()`` for a CPU tensor with the CUDA type name;
- ``torch.cuda.current_device()`` answers the CPU; ``synchronize`` and ``empty_cache`` do nothing;
- megatron-core's RNG tracker keeps CPU generator states instead of CUDA ones (same semantics:
  ``fork()`` swaps the process's CPU RNG state with the tracker's).

Nothing here runs on import, and ``enable()`` refuses a machine where CUDA is available: production
code on GPUs runs megatron-core unpatched. The engine calls it only when ``engine.megatron.cpu_bridge``
is set (docs/backends/megatron.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


class BridgeRefused(RuntimeError):
    """The bridge would patch a process that has CUDA."""


def enable() -> None:
    """Bridge megatron-core's CUDA assumptions for this process (idempotent). Raises
    ``BridgeRefused`` when CUDA is available: there megatron-core runs as it is."""
    global _enabled
    if _enabled:
        return
    if torch.cuda.is_available():
        raise BridgeRefused(
            "verl_megatron.cpu_bridge.enable(): CUDA is available on this machine, and megatron-core runs "
            "unpatched there: unset engine.megatron.cpu_bridge (it is for machines without a GPU)"
        )
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _nothing
    torch.cuda.empty_cache = _nothing
    _install_rng_tracker()
    _CUDAOnCPU().__enter__()  # for the rest of the process: megatron-core may run at any time
    _enabled = True


def is_enabled() -> bool:
    return _enabled


def _cpu_device(*args: Any, **kwargs: Any) -> torch.device:
    return torch.device("cpu")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


class _CUDAOnCPU(TorchFunctionMode):
    """CUDA device arguments become the CPU; ``.cuda()`` keeps a tensor where it is; ``.type()`` of a
    CPU tensor says ``torch.cuda.*`` (megatron-core's float32 checks compare those strings)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


class _CPURNGStatesTracker:
    """megatron-core's ``CudaRNGStatesTracker`` over the CPU generator: named RNG states that
    ``fork()`` swaps in for the block it guards (dropout in tensor-parallel regions, initialisation)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.reset()

    def is_initialized(self) -> bool:
        return self._initialized

    def reset(self) -> None:
        self._initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker = _CPURNGStatesTracker
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    random._CUDA_RNG_STATE_TRACKER = _CPURNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
