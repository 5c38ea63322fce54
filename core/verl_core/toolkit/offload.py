"""Offload: moving an engine's parameters, gradients and optimiser state between devices in place, so
that the optimiser and the wrappers that hold them (DDP) stay valid."""

from __future__ import annotations

import torch


def move_module(
    module: torch.nn.Module, device: torch.device | str, parameters: bool = True, gradients: bool = True
) -> None:
    """Move a replicated module's parameters and buffers and/or gradients to ``device``, in place.

    Swapping ``.data`` keeps every ``Parameter`` object, so the optimiser and wrappers holding them
    (DDP) stay valid: this is how an engine offloads to and reloads from CPU.
    """
    device = torch.device(device)
    if parameters:
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = tensor.data.to(device)
    if gradients:
        for parameter in module.parameters():
            if parameter.grad is not None:
                parameter.grad.data = parameter.grad.data.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every state tensor of ``optimizer`` (AdamW moments) to ``device``.

    Scalar ``step`` counters stay where they are: non-capturable Adam keeps them on the CPU.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)
