"""``DDPEngine``: one full replica of a Hugging Face model per rank, gradients all-reduced by DDP.

The worked example of docs/engine.md. Built only from verl-core's public engine toolkit:
``HFEngine`` (``verl_core.engine``) loads and runs the model, builds AdamW and the LR schedule,
offloads, exports weights and writes the Hugging Face export; what is DDP-specific is small:

- ``wrap_model``: ``DistributedDataParallel`` at world size > 1 (it broadcasts rank 0's weights);
- ``no_sync``: DDP's ``no_sync`` between micro-batches, so gradients are all-reduced once a step;
- checkpoints: replicas are identical, so rank 0 writes the model (with LoRA the adapter only:
  ``checkpointed_state``), optimiser and schedule with ``torch.save`` into the directory
  ``atomic_checkpoint`` publishes, and every rank its RNG state.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel
from verl_core.engine import (
    HFEngine,
    atomic_checkpoint,
    load_checkpoint_file,
    load_model_state,
    load_rng_state,
    move_optimizer_state,
    open_checkpoint,
    save_rng_state,
)

from verl_ddp.config import DDPConfig

BACKEND = "ddp"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
LR_SCHEDULER_FILE = "lr_scheduler.pt"


class DDPEngine(HFEngine):
    """Data parallelism with full replicas: ``DistributedDataParallel`` when ``torch.distributed`` is
    initialised with more than one rank (gloo on CPU, NCCL on GPU), the plain model otherwise."""

    options_class = DDPConfig

    def wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        module.to(self.device)
        if self.dp_size == 1:
            return module
        # DDP broadcasts rank 0's weights at construction: every replica starts identical.
        return DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self.dp_group,
            bucket_cap_mb=self.options.bucket_cap_mb,
            find_unused_parameters=self.options.find_unused_parameters,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view,
            static_graph=self.options.static_graph,
            **_buffer_sync(self.options.forward_sync_buffers),
        )

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally: DDP all-reduces only on the step's last micro-batch."""
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        module = self._initialized()
        with atomic_checkpoint(
            path, global_step=global_step, backend=BACKEND, group=self.dp_group
        ) as staging:
            if self.dp_rank == 0:  # replicas are identical: one copy of the state suffices
                torch.save(self.checkpointed_state(module.state_dict()), staging / MODEL_FILE)
                torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
                torch.save(self.lr_scheduler.state_dict(), staging / LR_SCHEDULER_FILE)
            save_rng_state(staging, self.dp_rank)

    def load_checkpoint(self, path: str) -> int:
        module = self._initialized()
        directory, info = open_checkpoint(path, backend=BACKEND)
        load_model_state(
            module,
            load_checkpoint_file(directory, MODEL_FILE),
            directory,
            self.config.model.path,
            only=self.checkpointed_state(module.state_dict()).keys() if self.config.model.lora else None,
        )
        self.optimizer.load_state_dict(load_checkpoint_file(directory, OPTIMIZER_FILE))
        move_optimizer_state(self.optimizer, self.optimizer_device)  # loading moves state to the params
        self.lr_scheduler.load_state_dict(load_checkpoint_file(directory, LR_SCHEDULER_FILE))
        load_rng_state(directory, self.dp_rank)
        return info.global_step


def _buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's per-forward buffer sync option: ``forward_sync_buffers`` since torch 2.13, before that
    ``broadcast_buffers`` (now deprecated)."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers": enabled}
