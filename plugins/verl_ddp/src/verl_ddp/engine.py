"""``DDPEngine``: one full replica of a Hugging Face model per rank, gradients all-reduced by DDP.

Built only from verl-core's public engine toolkit: ``hf`` loads and runs the model, ``loop`` runs
the micro-batches, ``optim`` builds AdamW and the LR schedule, ``checkpoint`` publishes checkpoints
atomically. What is DDP-specific is small: wrapping the model, ``no_sync`` between micro-batches,
and rank 0 writing the (full, replicated) state.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch.nn.parallel import DistributedDataParallel
from verl_core.config.engine import EngineConfig
from verl_core.distributed import barrier
from verl_core.engine.base import BaseEngine, ForwardBackwardResult, LossFn
from verl_core.engine.checkpoint import atomic_checkpoint, open_checkpoint
from verl_core.engine.device import move_module
from verl_core.engine.hf import export_hf_model, forward_micro_batch, load_hf_model
from verl_core.engine.loop import run_micro_batches
from verl_core.engine.optim import (
    TorchOptimizerSteps,
    build_lr_scheduler,
    build_optimizer,
    move_optimizer_state,
    validate_optim_config,
)
from verl_core.engine.seed import load_rng_state, save_rng_state

from verl_ddp.config import DDPConfig

BACKEND = "ddp"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
LR_SCHEDULER_FILE = "lr_scheduler.pt"


class DDPEngine(TorchOptimizerSteps, BaseEngine):
    """Data parallelism with full replicas: ``DistributedDataParallel`` when ``torch.distributed`` is
    initialised with more than one rank (gloo on CPU, NCCL on GPU), the plain model otherwise."""

    options_class = DDPConfig

    def __init__(self, config: EngineConfig, role: str = "lm"):
        super().__init__(config, role)
        self.module: torch.nn.Module | None = None  # the Hugging Face model itself
        self.model: torch.nn.Module | None = None  # what runs forward: DDP-wrapped at world size > 1
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._optimizer_device = self._device

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self.module is not None:
            raise RuntimeError("DDPEngine.initialize() was already called")
        validate_optim_config(self.config.optim)  # before the (slow) model load
        self.module = load_hf_model(self.config.model, self.role, seed=self.config.seed).to(self._device)
        if self.dp_size > 1:
            # DDP broadcasts rank 0's weights at construction: every replica starts identical.
            self.model = DistributedDataParallel(
                self.module,
                device_ids=[self._device.index] if self._device.type == "cuda" else None,
                process_group=self.dp_group,
                bucket_cap_mb=self.options.bucket_cap_mb,
                find_unused_parameters=self.options.find_unused_parameters,
                gradient_as_bucket_view=self.options.gradient_as_bucket_view,
                static_graph=self.options.static_graph,
                **_buffer_sync(self.options.forward_sync_buffers),
            )
        else:
            self.model = self.module
        self.optimizer = build_optimizer(self.module.parameters(), self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.offload_per_config("cpu")

    def set_model_mode(self, train: bool) -> None:
        self._initialized().train(train)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        target = torch.device(device)
        if model or grad:
            move_module(self._initialized(), target, parameters=model, gradients=grad)
        if optimizer:
            move_optimizer_state(self.optimizer, target)
            self._optimizer_device = target

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        self._initialized()
        return run_micro_batches(
            batch,
            forward=lambda micro_batch: forward_micro_batch(self.model, micro_batch, self.role),
            loss_fn=loss_fn,
            forward_only=forward_only,
            micro_batch_config=self.config.micro_batch,
            dp_group=self.dp_group,
            no_sync=self._no_sync,
            device=self._device,
        )

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally: DDP all-reduces only on the step's last micro-batch."""
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    # -- weights and checkpoints -----------------------------------------------------------------

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Every rank holds the full model: its state dict already uses Hugging Face names and order.
        for name, tensor in self._initialized().state_dict().items():
            yield name, tensor.detach()

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        module = self._initialized()
        with atomic_checkpoint(
            path, global_step=global_step, backend=BACKEND, group=self.dp_group
        ) as staging:
            if self.dp_rank == 0:  # replicas are identical: one copy of the state suffices
                torch.save(module.state_dict(), staging / MODEL_FILE)
                torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
                torch.save(self.lr_scheduler.state_dict(), staging / LR_SCHEDULER_FILE)
            save_rng_state(staging, self.dp_rank)

    def load_checkpoint(self, path: str) -> int:
        module = self._initialized()
        directory, info = open_checkpoint(path, backend=BACKEND)
        module.load_state_dict(_load(directory / MODEL_FILE))
        self.optimizer.load_state_dict(_load(directory / OPTIMIZER_FILE))
        move_optimizer_state(self.optimizer, self._optimizer_device)  # loading moves state to the params
        self.lr_scheduler.load_state_dict(_load(directory / LR_SCHEDULER_FILE))
        load_rng_state(directory, self.dp_rank)
        return info.global_step

    def save_hf_model(self, path: str) -> None:
        module = self._initialized()
        if self.dp_rank == 0:
            export_hf_model(module, path, tokenizer_source=self.config.model.path)
        barrier(self.dp_group)

    # -- helpers ---------------------------------------------------------------------------------

    def _initialized(self) -> torch.nn.Module:
        if self.module is None:
            raise RuntimeError("DDPEngine is not initialised: call initialize() first")
        return self.module


def _buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's per-forward buffer sync option: ``forward_sync_buffers`` since torch 2.13, before that
    ``broadcast_buffers`` (now deprecated)."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers": enabled}


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)
