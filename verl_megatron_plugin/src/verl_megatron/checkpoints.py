"""The megatron engine's checkpoints: megatron-core ``dist_checkpointing`` directories of the model
chunks and the optimiser (loadable at another TP/PP/DP layout), with the LR schedule's position and
each rank's RNG state (megatron-core's CUDA RNG tracker included) beside them, inside core's
``atomic_checkpoint``.

A mixin of ``MegatronEngine``: it reads the engine's ``model``, ``optimizer``, ``lr_scheduler`` state,
``config`` and ``_parallel_state()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_core.toolkit import (
    RNG_FILE,
    atomic_checkpoint,
    load_checkpoint_file,
    move_optimizer_state,
    open_checkpoint,
    reading_checkpoint,
    rng_state,
    set_rng_state,
)
from verl_megatron.offload import inner_optimizers

BACKEND = "megatron"
#: Inside a checkpoint: megatron-core's distributed checkpoint, and the rest of the engine's state.
DIST_CHECKPOINT_DIR = "dist_checkpoint"
ENGINE_FILE = "engine_state.pt"  # the LR schedule's position, whether the optimiser state was saved


class Checkpoints:
    """``save_checkpoint`` / ``load_checkpoint`` for the megatron engine."""

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        from megatron.core import dist_checkpointing

        self._initialized()
        rank = dist.get_rank()
        # Before the first step the optimiser has no state, and megatron-core would fill it with zero
        # moments and no step count to save it, which the next real step cannot use.
        with_optimizer = self._optimizer_has_state()
        with atomic_checkpoint(
            path, global_step=global_step, backend=BACKEND, group=dist.group.WORLD
        ) as staging:
            directory = staging / DIST_CHECKPOINT_DIR
            if rank == 0:
                directory.mkdir()
            dist.barrier()
            dist_checkpointing.save(self._sharded_state_dict(with_optimizer, loading=False), str(directory))
            if rank == 0:
                torch.save(
                    {"schedule_steps": self.schedule_steps, "optimizer": with_optimizer},
                    staging / ENGINE_FILE,
                )
            torch.save(self._rng_state(), staging / RNG_FILE.format(rank=rank))

    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint saved at any TP/PP/DP layout of the same model."""
        from megatron.core import dist_checkpointing

        self._initialized()
        directory, info = open_checkpoint(path, backend=BACKEND)
        saved = load_checkpoint_file(directory, ENGINE_FILE)
        with reading_checkpoint(directory, self.config.model.path):
            state = dist_checkpointing.load(
                self._sharded_state_dict(saved["optimizer"], loading=True),
                str(directory / DIST_CHECKPOINT_DIR),
            )
            for index, chunk in enumerate(self.chunks):
                chunk.load_state_dict(state[_model_key(index, len(self.chunks))], strict=True)
            inners = inner_optimizers(self.optimizer)
            if saved["optimizer"]:
                self.optimizer.load_state_dict(state["optimizer"])
                for inner in inners:
                    move_optimizer_state(inner, self._optimizer_device)
            else:  # saved before the first step: so is this engine now
                for inner in inners:
                    inner.state.clear()
        self.schedule_steps = int(saved["schedule_steps"])
        self._apply_lr()
        rng_file = directory / RNG_FILE.format(rank=dist.get_rank())
        if rng_file.is_file():  # resuming on more ranks than were saved: the extra ranks keep theirs
            self._set_rng_state(load_checkpoint_file(directory, rng_file.name))
        return info.global_step

    def _sharded_state_dict(self, with_optimizer: bool, loading: bool) -> dict[str, Any]:
        """Model chunks (and optimiser) as megatron-core sharded tensors: global shapes and each rank's
        piece, so that another layout loads them. Loading needs a fresh one (and initialises the
        optimiser state it loads into)."""
        model = {
            _model_key(index, len(self.chunks)): chunk.sharded_state_dict()
            for index, chunk in enumerate(self.chunks)
        }
        state: dict[str, Any] = dict(model)
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
        return state

    def _optimizer_has_state(self) -> bool:
        return any(inner.state for inner in inner_optimizers(self.optimizer))

    def _rng_state(self) -> dict[str, Any]:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return {**rng_state(), "tracker": get_cuda_rng_tracker().get_states()}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        set_rng_state(state)
        get_cuda_rng_tracker().set_states(state["tracker"])


def _model_key(index: int, chunks: int) -> str:
    return "model" if chunks == 1 else f"model{index}"
