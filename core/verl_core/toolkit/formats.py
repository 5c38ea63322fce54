"""How an ``HFEngine`` lays out its checkpoints: the toolkit's two formats, so that backends share one
implementation of what every checkpoint needs instead of copying it.

Both write into the directory ``atomic_checkpoint`` publishes (a crash mid-save leaves nothing that
``load_checkpoint`` would trust) and hold the model state the engine's adapter checkpoints (every
weight, or a LoRA adapter only: ``Adapter.checkpointed_state``), the optimiser state (absent when saved
before the first step), the LR schedule, and each rank's RNG state:

- ``ReplicatedCheckpoint``: every rank of the engine's ``state_group`` holds the whole state (DDP's
  replicas), so rank 0 writes it with ``torch.save``; loads at any world size;
- ``DistributedCheckpoint``: the state is sharded over ``state_group`` (FSDP2's DTensors), so every
  rank writes its shards with ``torch.distributed.checkpoint`` (DCP), which reshards on load: a
  checkpoint loads at another world size or layout.

An engine sets one as its class attribute ``checkpoint_format`` (``DistributedCheckpoint("fsdp")``);
the name it is given is the backend's, recorded in the checkpoint so that another backend's
checkpoint is refused by name.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verl_core.config.engine import EngineConfig
from verl_core.distributed import group_size
from verl_core.toolkit.checkpoint import (
    atomic_checkpoint,
    load_checkpoint_file,
    load_model_state,
    open_checkpoint,
    reading_checkpoint,
)
from verl_core.toolkit.lora import Adapter
from verl_core.toolkit.offload import move_optimizer_state
from verl_core.toolkit.seed import load_rng_state, save_rng_state

#: The LR schedule's state, identical on every rank: written once.
LR_SCHEDULER_FILE = "lr_scheduler.pt"


class EngineState(Protocol):
    """What a checkpoint format reads and restores of an engine (an initialised ``HFEngine`` has it all)."""

    config: EngineConfig
    #: The Hugging Face model (its state dict has the names checkpoints hold).
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    #: Where the optimiser state lives (restored there after a load).
    optimizer_device: torch.device
    adapter: Adapter

    @property
    def state_group(self) -> torch.distributed.ProcessGroup | None: ...

    @property
    def state_rank(self) -> int: ...

    def checkpointed_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class CheckpointFormat(abc.ABC):
    """One way to lay an engine's state out in a checkpoint directory; ``backend`` is the name
    checkpoints are marked with (and refused by, when another backend's). Subclass it for a format of
    your own: ``save_state`` and ``load_state`` write and read the model and optimiser state, the rest
    (atomic publication, the LR schedule, RNG state, the adapter's identity) is done here."""

    def __init__(self, backend: str):
        self.backend = backend

    def save(self, engine: EngineState, path: str, global_step: int) -> None:
        """``engine.save_checkpoint``: a collective of ``engine.state_group``."""
        model = engine.module
        with atomic_checkpoint(
            path, global_step=global_step, backend=self.backend, group=engine.state_group
        ) as staging:
            self.save_state(engine, model, staging)
            if engine.state_rank == 0:  # identical on every rank
                torch.save(engine.lr_scheduler.state_dict(), staging / LR_SCHEDULER_FILE)
                engine.adapter.save_checkpoint_info(staging)
            save_rng_state(staging, engine.state_rank)

    def load(self, engine: EngineState, path: str) -> int:
        """``engine.load_checkpoint``: the checkpoint's global step. A checkpoint of another backend, of
        another adapter or damaged is a ``CheckpointError`` naming it."""
        model = engine.module
        directory, info = open_checkpoint(path, backend=self.backend)
        engine.adapter.check_checkpoint(directory)
        with reading_checkpoint(directory, engine.config.model.path):
            self.load_state(engine, model, directory)
        # Loading puts the state next to the parameters; keep it where it was (offloaded or not).
        move_optimizer_state(engine.optimizer, engine.optimizer_device)
        engine.lr_scheduler.load_state_dict(load_checkpoint_file(directory, LR_SCHEDULER_FILE))
        load_rng_state(directory, engine.state_rank)
        return info.global_step

    @abc.abstractmethod
    def save_state(self, engine: EngineState, model: torch.nn.Module, staging: Path) -> None:
        """Write the model state ``engine.checkpointed_state`` keeps and the optimiser state."""

    @abc.abstractmethod
    def load_state(self, engine: EngineState, model: torch.nn.Module, directory: Path) -> None:
        """Restore what ``save_state`` wrote (inside ``reading_checkpoint``)."""


class ReplicatedCheckpoint(CheckpointFormat):
    """Every rank holds the whole state: rank 0 writes the model (``model.pt``) and the optimiser
    (``optimizer.pt``) with ``torch.save``; every rank loads both."""

    MODEL_FILE = "model.pt"
    OPTIMIZER_FILE = "optimizer.pt"

    def save_state(self, engine: EngineState, model: torch.nn.Module, staging: Path) -> None:
        if engine.state_rank == 0:
            torch.save(engine.checkpointed_state(model.state_dict()), staging / self.MODEL_FILE)
            torch.save(engine.optimizer.state_dict(), staging / self.OPTIMIZER_FILE)

    def load_state(self, engine: EngineState, model: torch.nn.Module, directory: Path) -> None:
        full_state = model.state_dict()
        kept = engine.checkpointed_state(full_state).keys()
        load_model_state(
            model,
            load_checkpoint_file(directory, self.MODEL_FILE),
            directory,
            engine.config.model.path,
            only=None if kept == full_state.keys() else kept,
        )
        engine.optimizer.load_state_dict(load_checkpoint_file(directory, self.OPTIMIZER_FILE))


class DistributedCheckpoint(CheckpointFormat):
    """The state sharded over ``state_group``: two DCP directories (``model``, ``optimizer``), each one
    file per saving rank plus ``.metadata``, readable at any world size or layout."""

    MODEL_DIR = "model"
    OPTIMIZER_DIR = "optimizer"

    def save_state(self, engine: EngineState, model: torch.nn.Module, staging: Path) -> None:
        model_state = engine.checkpointed_state(get_model_state_dict(model))
        dcp.save(model_state, checkpoint_id=staging / self.MODEL_DIR, **_dcp_group(engine))
        # Before the first step the state is empty, and torch would fill it with a zero step just to
        # save it, changing the next real step's bias correction.
        if engine.optimizer.state:
            dcp.save(
                get_optimizer_state_dict(model, engine.optimizer),
                checkpoint_id=staging / self.OPTIMIZER_DIR,
                **_dcp_group(engine),
            )

    def load_state(self, engine: EngineState, model: torch.nn.Module, directory: Path) -> None:
        full_state = get_model_state_dict(model)
        model_state = engine.checkpointed_state(full_state)
        dcp.load(model_state, checkpoint_id=directory / self.MODEL_DIR, **_dcp_group(engine))
        # Weights a checkpoint does not hold (LoRA's base) stay as loaded from the model folder.
        partial = model_state.keys() != full_state.keys()
        set_model_state_dict(model, model_state, options=StateDictOptions(strict=not partial))
        if (directory / self.OPTIMIZER_DIR).is_dir():
            # The template gets its state from a zero step with lr 0; the load replaces all of it.
            optimizer_state = get_optimizer_state_dict(model, engine.optimizer)
            dcp.load(optimizer_state, checkpoint_id=directory / self.OPTIMIZER_DIR, **_dcp_group(engine))
            set_optimizer_state_dict(model, engine.optimizer, optimizer_state)
        else:  # saved before the first step: so is this engine now
            engine.optimizer.state.clear()


def _dcp_group(engine: EngineState) -> dict[str, object]:
    """DCP's collectives run over the engine's ``state_group``; an engine alone (no group, or one rank)
    saves and loads without any."""
    group = engine.state_group
    return {"process_group": group, "no_dist": group is None or group_size(group) == 1}
