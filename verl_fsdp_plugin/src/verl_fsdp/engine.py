"""``FSDPEngine``: a Hugging Face model sharded over the DP group with FSDP2 (``fully_shard``).

Parameters, gradients and AdamW state are sharded on dim 0 across the ranks (DTensors); each FSDP
unit (a decoder layer, then the root) gathers its parameters for its forward and backward and
reduce-scatters its gradients. Everything a Hugging Face engine shares comes from verl-core's
``HFEngine``; what is FSDP-specific: the layout (``verl_fsdp.sharding``), skipping gradient sync
between micro-batches, resharding after inference and recovering from a failed step, gathering full
tensors one at a time for exports. Checkpoints are the toolkit's ``DistributedCheckpoint``: sharded
``torch.distributed.checkpoint`` (DCP) directories that load at any world size.

With nothing to shard across (no process group, or a group of one rank) the engine runs the plain
model: FSDP's hooks and gather copies would only cost time (1.10x a plain loop on one rank). An
option only FSDP honours (``param_dtype``, ``reduce_dtype``, ``cpu_offload``) shards a one-rank group
anyway, and is refused without a process group. Checkpoints are the same DCP format either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from verl_core.config import EngineConfig
from verl_core.engine import ForwardBackwardResult, LossFn
from verl_core.errors import ConfigError
from verl_core.toolkit import DistributedCheckpoint, HFEngine, load_hf_model, move_module
from verl_fsdp.config import FSDPConfig
from verl_fsdp.loading import full_state, load_from_rank0
from verl_fsdp.sharding import (
    check_shard_size,
    discard_unreduced_gradients,
    dp_mesh,
    fsdp_units,
    full_tensor,
    shard_model,
)

BACKEND = "fsdp"


class FSDPEngine(HFEngine):
    """Fully sharded data parallelism over the DP group (gloo on CPU, NCCL on GPU)."""

    options_class = FSDPConfig
    checkpoint_format = DistributedCheckpoint(BACKEND)

    def __init__(self, config: EngineConfig, role: str = "lm", *, config_path: str = "engine"):
        super().__init__(config, role, config_path=config_path)
        # Under ``cpu_offload`` FSDP keeps the optimiser state on the CPU for good.
        if self.options.cpu_offload:
            self.optimizer_device = torch.device("cpu")

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded: more than one DP rank, or an option only FSDP honours."""
        return self.dp_group is not None and (self.dp_size > 1 or bool(self._options_that_need_fsdp()))

    # -- layout ----------------------------------------------------------------------------------

    def load_model(self) -> torch.nn.Module:
        """Under ``load_on_rank0`` only DP rank 0 reads the weights; the others build the model on
        the meta device and receive their shards in ``wrap_model``."""
        if self._receives_weights and self.dp_rank != 0:
            return load_hf_model(
                self.config.model,
                self.role,
                where=f"{self.config_path}.model",
                packing=self.config.micro_batch.packing,
                on_meta=True,
            )
        return super().load_model()

    def wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.dp_group is None:
            self._refuse_options_that_need_fsdp()
        check_shard_size(self.options.shard_size, self.dp_size, self._options_path)
        if not self.sharded:
            return module.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # FSDP gathers on the current CUDA device
        mesh = dp_mesh(self.dp_group, self.device, self.options.shard_size, where=self._options_path)
        if not self._receives_weights:
            # Every rank loaded the real weights on the CPU: identical by construction, buffers included.
            return shard_model(module, self.options, mesh, where=self._options_path)
        state = full_state(module) if self.dp_rank == 0 else None
        model = shard_model(module, self.options, mesh, where=self._options_path)
        load_from_rank0(model, state, self.dp_group, self.device, shards_on_cpu=self.options.cpu_offload)
        return model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: FSDP reduce-scatters them once, in the step's last backward.
        Under ``keep_params_gathered`` the units keep their parameters gathered too, until then."""
        if not self.sharded:
            yield
            return
        keep_gathered = self.options.keep_params_gathered
        self.model.set_requires_gradient_sync(False)
        if keep_gathered:
            self.model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            if keep_gathered:
                self.model.set_reshard_after_backward(True)

    def move_model(self, device: torch.device, parameters: bool, gradients: bool) -> None:
        """Sharded parameters move through ``module.to`` (FSDP re-registers its shards there), which
        moves their gradients along: FSDP cannot keep the two apart. Under ``cpu_offload`` all of it
        lives on the CPU already and this does nothing."""
        if not self.sharded:
            move_module(self.module, device, parameters=parameters, gradients=gradients)
            return
        if self.options.cpu_offload:
            return
        if parameters != gradients:
            raise ValueError(
                f"FSDPEngine.to({str(device)!r}, model={parameters}, grad={gradients}): FSDP keeps gradients on "
                "their parameters' device; move both (model=True, grad=True) or neither"
            )
        self.module.to(device)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        if self.sharded and self.options.cpu_offload:
            return  # parameters, gradients and optimiser state live on the CPU for good
        super().to(device, model=model, optimizer=optimizer, grad=grad)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gathered on the compute device (NCCL reduces only device tensors; offloaded shards live on
        the CPU): a collective, every rank of the DP group must call it."""
        return full_tensor(tensor.to(self.device))

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        try:
            result = super().forward_backward_batch(batch, loss_fn, forward_only)
        except BaseException:
            if self.sharded:  # the engine stays usable: the failed step is as if it never ran
                self.model.reset_iter_state()
                discard_unreduced_gradients(self.model)
                self._reshard()
            raise
        if forward_only:
            # Backward would reshard; without one, units that keep their gathered parameters after
            # forward (the root; every unit under keep_params_gathered) would leave them registered
            # in place of the shards.
            self._reshard()
        return result

    def _reshard(self) -> None:
        if self.sharded:
            for unit in fsdp_units(self.model):
                unit.reshard()

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def _receives_weights(self) -> bool:
        """Whether the ranks but the first get their weights from rank 0 (``load_on_rank0``)."""
        return self.options.load_on_rank0 and self.sharded

    @property
    def _options_path(self) -> str:
        """Where the options sit in a run config: ``actor.engine.fsdp``."""
        return f"{self.config_path}.{BACKEND}"

    def _options_that_need_fsdp(self) -> list[str]:
        requested = {
            "param_dtype": self.options.param_dtype is not None,
            "reduce_dtype": self.options.reduce_dtype is not None,
            "cpu_offload": self.options.cpu_offload,
        }
        return [name for name, is_set in requested.items() if is_set]

    def _refuse_options_that_need_fsdp(self) -> None:
        """Without a process group nothing is sharded: options that only FSDP can honour are errors."""
        errors = [
            (
                f"{self._options_path}.{name}",
                f"{getattr(self.options, name)!r} needs FSDP, which needs an initialised torch.distributed "
                "process group (one rank suffices): call torch.distributed.init_process_group before "
                "initialize(), or unset it",
            )
            for name in self._options_that_need_fsdp()
        ]
        if errors:
            raise ConfigError(errors)
