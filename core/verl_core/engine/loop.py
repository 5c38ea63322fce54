"""The micro-batch loop every backend runs inside ``forward_backward_batch``.

A backend supplies how to run its model on one micro-batch and how to skip gradient
synchronisation (DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync(False)``); the loop does the
rest the same way for all of them: global counts for loss normalisation, splitting, forward, loss,
backward, collecting outputs in batch order, and reducing the reported loss over the DP group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from verl_core.config.engine import MicroBatchConfig
from verl_core.data.batch import INPUT_IDS, attach_global_counts, compute_global_counts
from verl_core.data.microbatch import split_micro_batches
from verl_core.distributed import all_reduce_sum, group_size
from verl_core.engine.base import ForwardBackwardResult, LossFn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Runs the model on one micro-batch (already on the compute device) and returns its outputs.
ForwardFn = Callable[[TensorDict], "dict[str, torch.Tensor]"]


def run_micro_batches(
    batch: TensorDict,
    forward: ForwardFn,
    loss_fn: LossFn | None,
    forward_only: bool,
    micro_batch_config: MicroBatchConfig,
    dp_group: ProcessGroup | None = None,
    no_sync: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    device: torch.device | str = "cpu",
) -> ForwardBackwardResult:
    """Run ``forward`` (and ``loss_fn`` + backward unless ``forward_only``) over ``batch``'s micro-batches.

    ``batch`` is this rank's share of the step; every rank of ``dp_group`` must call this together
    (counts and the loss are all-reduced). ``no_sync()`` is entered around every micro-batch but the
    last, so gradients are synchronised once per step. Outputs come back detached, in batch order,
    on the device ``batch`` was on.
    """
    if loss_fn is None and not forward_only:
        raise ValueError("a backward pass needs a loss_fn: pass one, or forward_only=True")
    if loss_fn is not None:
        # On a shallow copy: the caller's batch does not keep this step's counts.
        batch = attach_global_counts(batch.copy(), compute_global_counts(batch, dp_group))
    split = split_micro_batches(batch, micro_batch_config, dp_group)
    output_device = batch[INPUT_IDS].device

    outputs: dict[str, list[torch.Tensor]] = {}
    metrics: dict[str, list[float]] = {}
    local_loss = 0.0
    last = len(split.micro_batches) - 1
    grad_mode = torch.no_grad if forward_only else torch.enable_grad
    for index, micro_batch in enumerate(split.micro_batches):
        sync_context = no_sync() if index != last and not forward_only else contextlib.nullcontext()
        with grad_mode(), sync_context:
            micro_batch = micro_batch.to(device)
            model_output = forward(micro_batch)
            if loss_fn is not None:
                loss, loss_metrics = loss_fn(model_output, micro_batch, dp_group)
                if not forward_only:
                    loss.backward()
                local_loss += float(loss.detach())
                for name, value in loss_metrics.items():
                    metrics.setdefault(name, []).append(float(value))
        for name, value in model_output.items():
            outputs.setdefault(name, []).append(value.detach().to(output_device))

    restored = {name: split.restore(values) for name, values in outputs.items()}
    return ForwardBackwardResult(
        outputs=TensorDict(restored, batch_size=batch.batch_size[:1], device=None),
        # Each rank's losses carry a factor of the DP size (see ForwardBackwardResult).
        loss=all_reduce_sum(local_loss, dp_group) / group_size(dp_group) if loss_fn is not None else None,
        metrics=metrics,
    )
