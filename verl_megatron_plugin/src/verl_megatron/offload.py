"""Offloading the megatron engine's parameters, gradients and optimiser state to the CPU and back.

megatron-core's DDP keeps parameters and gradients in flat buffers that every parameter (and bucket)
views, so a buffer's storage is emptied onto the CPU and refilled in place (``_park``): the views stay
valid. A mixin of ``MegatronEngine``: it reads the engine's ``model`` (DDP chunks), ``chunks``,
``optimizer`` and ``device``.
"""

from __future__ import annotations

import torch

from verl_core.toolkit import move_optimizer_state


class Offload:
    """``to(device, model=, optimizer=, grad=)`` for the megatron engine."""

    @torch.no_grad()
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Offload to the CPU (``"cpu"``) or reload onto the compute device. megatron-core's DDP keeps
        parameters and gradients in flat buffers that every parameter (and bucket) views, so the
        buffers' storage is emptied and refilled in place (``_park``): the views stay valid."""
        self._initialized()
        offload = torch.device(device).type == "cpu"
        if self.device.type == "cpu":
            return  # everything lives on the CPU already
        buffered: set[int] = set()
        for chunk in self.model:
            for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
                if model and buffer.param_data is not None:
                    _park(buffer.param_data, offload)
                    buffered.update(id(p) for p in buffer.params)
                if grad:
                    _park(buffer.grad_data, offload)
        if model:
            for chunk in self.chunks:
                for param in chunk.parameters():
                    if id(param) not in buffered:
                        _park(param, offload)
                for buffer in chunk.buffers():
                    _park(buffer, offload)
        if optimizer:
            model_params = {id(p) for chunk in self.chunks for p in chunk.parameters()}
            for inner in inner_optimizers(self.optimizer):
                move_optimizer_state(inner, "cpu" if offload else self.device)
                for group in inner.param_groups:  # fp32 main copies of bf16/fp16 or sharded parameters
                    for param in group["params"]:
                        if id(param) not in model_params:
                            _park(param, offload)
            self._optimizer_device = torch.device("cpu") if offload else self.device


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimisers under megatron-core's (chained) optimiser: what steps."""
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def _park(tensor: torch.Tensor, offload: bool) -> None:
    """Move ``tensor``'s content to a CPU copy and free its device storage (``offload``), or bring it
    back into the same storage: every view of it (parameters into DDP buffers) stays valid."""
    storage = tensor.untyped_storage()
    if offload and storage.size() > 0:
        tensor._verl_offloaded = tensor.detach().to("cpu", copy=True)
        tensor._verl_storage_bytes = storage.size()
        storage.resize_(0)
    elif not offload and storage.size() == 0 and hasattr(tensor, "_verl_offloaded"):
        storage.resize_(tensor._verl_storage_bytes)
        tensor.copy_(tensor._verl_offloaded)
        del tensor._verl_offloaded
