"""``FSDPEngine``: a Hugging Face model sharded over the DP group with FSDP2 (``fully_shard``).

Parameters, gradients and AdamW state are sharded on dim 0 across the ranks (DTensors); each FSDP
unit (a decoder layer, then the root) gathers its parameters for its forward and backward and
reduce-scatters its gradients. The shared mechanics come from verl-core's engine toolkit, as for
any backend: ``hf`` loads and runs the model, ``loop`` runs the micro-batches, ``optim`` builds
AdamW, the LR schedule and clips, ``checkpoint`` publishes checkpoints atomically. What is
FSDP-specific: the layout (``verl_fsdp.sharding``), skipping gradient sync between micro-batches,
resharding after inference, gathering full tensors one at a time for exports, and sharded
``torch.distributed.checkpoint`` (DCP) checkpoints that load at any world size.

Without an initialised ``torch.distributed`` the engine runs the plain model in one process (there
is nothing to shard across); checkpoints are the same DCP format either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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
from verl_core.errors import ConfigError
from verl_fsdp.config import FSDPConfig
from verl_fsdp.sharding import (
    OPTIONS_PATH,
    discard_unreduced_gradients,
    dp_mesh,
    fsdp_units,
    full_tensor,
    shard_model,
)

BACKEND = "fsdp"
#: Checkpoint layout (inside the directory ``atomic_checkpoint`` publishes): two DCP directories,
#: each holding one file per saving rank plus ``.metadata``, readable at any world size.
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"  # absent when saved before the first optimiser step
LR_SCHEDULER_FILE = "lr_scheduler.pt"


class FSDPEngine(TorchOptimizerSteps, BaseEngine):
    """Fully sharded data parallelism over the DP group (gloo on CPU, NCCL on GPU)."""

    options_class = FSDPConfig

    def __init__(self, config: EngineConfig, role: str = "lm"):
        super().__init__(config, role)
        #: The Hugging Face model; ``fully_shard`` turns it (and its units) into FSDP modules in place.
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        # Under ``cpu_offload`` FSDP keeps the optimiser state on the CPU for good.
        self._optimizer_device = torch.device("cpu") if self.options.cpu_offload else self._device

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``torch.distributed`` is initialised, at any world size)."""
        return self.dp_group is not None

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self.model is not None:
            raise RuntimeError("FSDPEngine.initialize() was already called")
        validate_optim_config(self.config.optim)  # before the (slow) model load
        if not self.sharded:
            self._refuse_options_that_need_fsdp()
        # Every rank loads the real weights on the CPU: identical by construction, buffers included.
        model = load_hf_model(self.config.model, self.role, seed=self.config.seed)
        if self.sharded:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # FSDP gathers on the current CUDA device
            shard_model(model, self.options, dp_mesh(self.dp_group, self._device))
        else:
            model.to(self._device)
        self.model = model
        self.optimizer = build_optimizer(model.parameters(), self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.offload_per_config("cpu")

    def set_model_mode(self, train: bool) -> None:
        self._initialized().train(train)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters, gradients and/or AdamW state to ``device``.

        Sharded parameters move through ``module.to`` (FSDP re-registers its shards there), which
        moves their gradients along: FSDP cannot keep the two apart. Under ``cpu_offload`` all of
        it lives on the CPU already and this does nothing.
        """
        module = self._initialized()
        if self.sharded and self.options.cpu_offload:
            return
        target = torch.device(device)
        if self.sharded and (model or grad):
            if model != grad:
                raise ValueError(
                    f"FSDPEngine.to({device!r}, model={model}, grad={grad}): FSDP keeps gradients on their "
                    "parameters' device; move both (model=True, grad=True) or neither"
                )
            module.to(target)
        elif model or grad:
            move_module(module, target, parameters=model, gradients=grad)
        if optimizer:
            move_optimizer_state(self.optimizer, target)
            self._optimizer_device = target

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        model = self._initialized()
        try:
            result = run_micro_batches(
                batch,
                forward=lambda micro_batch: forward_micro_batch(model, micro_batch, self.role),
                loss_fn=loss_fn,
                forward_only=forward_only,
                micro_batch_config=self.config.micro_batch,
                dp_group=self.dp_group,
                no_sync=self._no_sync,
                device=self._device,
            )
        except BaseException:
            if self.sharded:  # the engine stays usable: the failed step is as if it never ran
                model.reset_iter_state()
                discard_unreduced_gradients(model)
            raise
        if forward_only:
            # Backward would reshard; without one, units that keep their gathered parameters after
            # forward (the root) would leave them registered in place of the shards.
            self._reshard()
        return result

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: FSDP reduce-scatters them once, in the step's last backward."""
        if not self.sharded:
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _reshard(self) -> None:
        if self.sharded:
            for unit in fsdp_units(self.model):
                unit.reshard()

    # -- weights and checkpoints -----------------------------------------------------------------

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names, in state-dict order, gathered one at a time.

        Each gather is a collective: every rank of the DP group must iterate to the end together.
        Shards are gathered on the compute device (NCCL reduces only device tensors; offloaded
        shards live on the CPU).
        """
        for name, tensor in self._initialized().state_dict().items():
            yield name, full_tensor(tensor.detach().to(self._device))

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        model = self._initialized()
        with atomic_checkpoint(
            path, global_step=global_step, backend=BACKEND, group=self.dp_group
        ) as staging:
            dcp.save(get_model_state_dict(model), checkpoint_id=staging / MODEL_DIR, **self._dcp_group())
            # Before the first step the state is empty, and torch would fill it with a zero step
            # just to save it, changing the next real step's bias correction.
            if self.optimizer.state:
                dcp.save(
                    get_optimizer_state_dict(model, self.optimizer),
                    checkpoint_id=staging / OPTIMIZER_DIR,
                    **self._dcp_group(),
                )
            if self.dp_rank == 0:  # identical on every rank
                torch.save(self.lr_scheduler.state_dict(), staging / LR_SCHEDULER_FILE)
            save_rng_state(staging, self.dp_rank)

    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint saved at any world size: DCP reshards to this engine's layout."""
        model = self._initialized()
        directory, info = open_checkpoint(path, backend=BACKEND)
        model_state = get_model_state_dict(model)
        dcp.load(model_state, checkpoint_id=directory / MODEL_DIR, **self._dcp_group())
        set_model_state_dict(model, model_state)
        if (directory / OPTIMIZER_DIR).is_dir():
            # The template gets its state from a zero step with lr 0; the load replaces all of it.
            optimizer_state = get_optimizer_state_dict(model, self.optimizer)
            dcp.load(optimizer_state, checkpoint_id=directory / OPTIMIZER_DIR, **self._dcp_group())
            set_optimizer_state_dict(model, self.optimizer, optimizer_state)
            # Loading puts the state next to the parameters; keep it where it was (offloaded or not).
            move_optimizer_state(self.optimizer, self._optimizer_device)
        else:  # saved before the first step: so is this engine now
            self.optimizer.state.clear()
        self.lr_scheduler.load_state_dict(
            torch.load(directory / LR_SCHEDULER_FILE, map_location="cpu", weights_only=True)
        )
        load_rng_state(directory, self.dp_rank)
        return info.global_step

    def save_hf_model(self, path: str) -> None:
        """A Hugging Face directory from rank 0; the full state dict is gathered one tensor at a time
        (every rank takes part) and only rank 0 keeps it, in CPU memory."""
        model = self._initialized()
        keep = self.dp_rank == 0
        state_dict = {}
        for name, tensor in self.get_per_tensor_param():
            if keep:
                state_dict[name] = tensor.to("cpu")
        if keep:
            export_hf_model(model, path, state_dict=state_dict, tokenizer_source=self.config.model.path)
        barrier(self.dp_group)

    # -- helpers ---------------------------------------------------------------------------------

    def _initialized(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("FSDPEngine is not initialised: call initialize() first")
        return self.model

    def _dcp_group(self) -> dict[str, object]:
        """DCP's collectives run over the DP group; without one, DCP is told so (not left to guess)."""
        return {"process_group": self.dp_group, "no_dist": not self.sharded}

    def _refuse_options_that_need_fsdp(self) -> None:
        """Without a process group nothing is sharded: options that only FSDP can honour are errors."""
        requested = {
            "param_dtype": self.options.param_dtype is not None,
            "reduce_dtype": self.options.reduce_dtype is not None,
            "cpu_offload": self.options.cpu_offload,
        }
        errors = [
            (
                f"{OPTIONS_PATH}.{name}",
                f"{getattr(self.options, name)!r} needs FSDP, which needs an initialised torch.distributed "
                "process group (one rank suffices): call torch.distributed.init_process_group before "
                "initialize(), or unset it",
            )
            for name, is_set in requested.items()
            if is_set
        ]
        if errors:
            raise ConfigError(errors)
