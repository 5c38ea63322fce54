"""``DDPEngine``: one full replica of a Hugging Face model per rank, gradients all-reduced by DDP.

The worked example of docs/engine.md. Built only from verl-core's public engine toolkit
(``verl_core.toolkit``): ``HFEngine`` loads and runs the model, builds AdamW and the LR schedule,
offloads, exports weights, writes the Hugging Face export and trains LoRA adapters; what is
DDP-specific is small:

- ``wrap_model``: ``DistributedDataParallel`` at world size > 1 (it broadcasts rank 0's weights);
- ``no_sync``: DDP's ``no_sync`` between micro-batches, so gradients are all-reduced once a step;
- checkpoints: replicas are identical, so the toolkit's ``ReplicatedCheckpoint`` fits: rank 0 writes
  the model (with LoRA the adapter only), optimiser and schedule, every rank its RNG state.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel
from verl_core.toolkit import HFEngine, ReplicatedCheckpoint

from verl_ddp.config import DDPConfig

BACKEND = "ddp"


class DDPEngine(HFEngine):
    """Data parallelism with full replicas: ``DistributedDataParallel`` when ``torch.distributed`` is
    initialised with more than one rank (gloo on CPU, NCCL on GPU), the plain model otherwise."""

    options_class = DDPConfig
    checkpoint_format = ReplicatedCheckpoint(BACKEND)

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


def _buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's per-forward buffer sync option: ``forward_sync_buffers`` since torch 2.13, before that
    ``broadcast_buffers`` (now deprecated)."""
    parameters = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers": enabled}
