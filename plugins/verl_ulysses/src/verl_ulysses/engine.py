"""``UlyssesEngine``: a VeOmni-style engine. It owns its parallel plan: a ``(dp_replicate, dp_shard, sp)``
mesh, the model built on the meta device and filled from rank 0, FSDP2 per decoder layer, Ulysses
sequence parallelism around attention, and its own ``torch.distributed.checkpoint`` checkpoints.

Built on verl-core's ``HFEngine`` like the DDP template; what it overrides:

- ``check_before_start``: the layout against the model's config.json and the job's size
  (``check_layout``), which core checks before any rank starts;
- ``initialize``: checks the layout again in the job it is in, builds the mesh's groups, then lets
  ``HFEngine`` load, wrap and build AdamW and the LR schedule;
- ``load_model``: the architecture on the meta device (attention switched to Ulysses at ``sp > 1``);
- ``wrap_model``: ``fully_shard`` per decoder layer and root over ``dp_shard x sp``, ``to_empty``,
  weights from rank 0, non-persistent buffers recomputed (``verl_ulysses.loading``);
- ``forward_backward_batch``: core's ``run_micro_batches`` with the sequence-parallel forward
  (``verl_ulysses.ulysses``) at ``sp > 1``, ``HFEngine``'s forward otherwise; resharding after
  inference; outputs only on SP rank 0;
- the topology: ``dp_group`` is the ranks of this SP rank across DP ranks (it excludes the other SP
  ranks), ``is_output_rank`` is SP rank 0;
- ``no_sync``, ``move_model``, ``full_tensor``: FSDP2's gradient sync switch, moving shards, gathering;
- ``state_group``: every rank of the job (the state is sharded over ``dp_shard x sp``), so the
  toolkit's ``DistributedCheckpoint`` checkpoints (DCP, loadable at another ``(dp, sp)`` layout) and
  the Hugging Face export (one writer for the job) are collectives over the world, not ``dp_group``;
- LoRA comes from the toolkit (``HFEngine``'s adapter), as for any engine built on it.

Without ``torch.distributed`` the engine runs the plain model (``sp_size`` must be 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig
from verl_core.config import EngineConfig
from verl_core.engine import ForwardBackwardResult, LossFn, run_micro_batches
from verl_core.errors import ConfigError
from verl_core.toolkit import (
    DTYPES,
    DistributedCheckpoint,
    HFEngine,
    check_model_dir,
    load_hf_model,
    move_module,
)

from verl_ulysses import ulysses
from verl_ulysses.config import HEADS, MeshShape, UlyssesConfig, check_layout
from verl_ulysses.loading import load_from_rank0
from verl_ulysses.mesh import ParallelMesh, build_mesh

BACKEND = "ulysses"


class UlyssesEngine(HFEngine):
    """FSDP2 over ``dp_shard x sp`` with Ulysses sequence parallelism (gloo on CPU, NCCL on GPU)."""

    options_class = UlyssesConfig
    checkpoint_format = DistributedCheckpoint(BACKEND)

    def __init__(self, config: EngineConfig, role: str = "lm", *, config_path: str = "engine"):
        super().__init__(config, role, config_path=config_path)
        #: The mesh and its groups, from ``initialize()`` on (None without torch.distributed).
        self.mesh: ParallelMesh | None = None
        #: How rank 0 read the weights (``"safetensors"``, ``"from_pretrained"``) or None (plain load).
        self.loaded_from: str | None = None

    # -- topology --------------------------------------------------------------------------------

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's SP rank of every DP rank: SP ranks are not data parallel."""
        return self.mesh.dp_group if self.mesh is not None else super().dp_group

    @property
    def is_output_rank(self) -> bool:
        """SP rank 0 of each DP rank (every SP rank computes the same gathered outputs)."""
        return self.mesh is None or self.mesh.sp_rank == 0

    @property
    def sp_size(self) -> int:
        return self.mesh.shape.sp if self.mesh is not None else 1

    @property
    def state_group(self) -> dist.ProcessGroup | None:
        """Every rank of the job: the state is sharded over ``dp_shard x sp``, so checkpoints, exports
        and weight loading are collectives over the world."""
        return dist.group.WORLD if self.mesh is not None else None

    @property
    def state_rank(self) -> int:
        return self.mesh.rank if self.mesh is not None else 0

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self.module is not None:
            raise RuntimeError(f"{type(self).__name__}.initialize() was already called")
        distributed = dist.is_available() and dist.is_initialized()
        shape = self._check_layout(dist.get_world_size() if distributed else 1, distributed)
        if distributed:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL groups and FSDP's gathers use the current device
            self.mesh = build_mesh(shape, self.device.type)
        super().initialize()

    @classmethod
    def check_before_start(
        cls,
        config: EngineConfig,
        *,
        role: str,
        model_config: Mapping[str, Any],
        world_size: int,
        config_path: str,
    ) -> list[tuple[str, str]]:
        """The layout against the model and the job (``check_layout``) and what ``sp_size > 1`` asks of
        the model section, every problem under its key: core runs it before any rank starts (the model's
        config.json, the run's world size), ``initialize()`` again in the job it is in."""
        options = config.options if config.options is not None else UlyssesConfig()
        where = f"{config_path}.{BACKEND}"
        if HEADS not in model_config:
            return [
                (
                    f"{where}.sp_size",
                    f"the model's config.json has no {HEADS}, which this backend splits over the SP ranks; "
                    "use a model whose config states it (Llama, Qwen2, Mistral, ...)",
                )
            ]
        errors: list[tuple[str, str]] = []
        try:
            check_layout(options, model_config, world_size, where)
        except ConfigError as error:
            errors += error.errors
        model = config.model
        if options.sp_size > 1 and model.attn_implementation != "sdpa":
            errors.append(
                (
                    f"{config_path}.model.attn_implementation",
                    f"{model.attn_implementation!r}: at sp_size > 1 attention runs this backend's "
                    "Ulysses attention (SDPA over the whole sequence); set 'sdpa', or sp_size: 1",
                )
            )
        if options.sp_size > 1 and model.compile_layers:
            errors.append(
                (
                    f"{config_path}.model.compile_layers",
                    "compiles the decoder layers, whose attention at sp_size > 1 runs all-to-alls "
                    "across ranks, which this backend has not proven under torch.compile: unset it, "
                    "or sp_size: 1",
                )
            )
        return errors

    def _check_layout(self, world_size: int, distributed: bool) -> MeshShape:
        """The mesh, or every reason it cannot be, at once, each under its key."""
        model = self.config.model
        hf_config = AutoConfig.from_pretrained(
            check_model_dir(model.path, f"{self.config_path}.model.path"),
            trust_remote_code=model.trust_remote_code,
            local_files_only=True,
        ).to_dict()
        errors = self.check_before_start(
            self.config,
            role=self.role,
            model_config=hf_config,
            world_size=world_size,
            config_path=self.config_path,
        )
        if self.options.sp_size > 1 and not distributed:
            errors.append(
                (
                    f"{self._options_path}.sp_size",
                    f"{self.options.sp_size} needs a torch.distributed process group of that many ranks "
                    "or more: in the trainer set trainer.workers=ray; embedding the engine, call "
                    "torch.distributed.init_process_group before initialize()",
                )
            )
        if not distributed:
            for name in ("param_dtype", "reduce_dtype"):
                if getattr(self.options, name) is not None:
                    errors.append(
                        (
                            f"{self._options_path}.{name}",
                            f"{getattr(self.options, name)!r} is FSDP's mixed precision, which needs an "
                            "initialised torch.distributed process group (one rank suffices); unset it",
                        )
                    )
        if errors:
            raise ConfigError(errors)
        return check_layout(self.options, hf_config, world_size, self._options_path)

    def load_model(self) -> torch.nn.Module:
        """The architecture on the meta device; its weights arrive in ``wrap_model``. Without a process
        group, the model loaded as usual."""
        if self.mesh is None:
            return super().load_model()
        model = load_hf_model(
            self.config.model,
            self.role,
            where=f"{self.config_path}.model",
            packing=self.config.micro_batch.packing,
            on_meta=True,
        )
        if self.sp_size > 1:
            model.set_attn_implementation(ulysses.ULYSSES_ATTENTION)
        return model

    def wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.mesh is None:
            return module.to(self.device)
        policy = MixedPrecisionPolicy(
            param_dtype=DTYPES.get(self.options.param_dtype),
            reduce_dtype=DTYPES.get(self.options.reduce_dtype),
        )
        common = {"mesh": self.mesh.fsdp_mesh, "mp_policy": policy}
        for layer in decoder_layers(module):  # children before the root
            fully_shard(layer, reshard_after_forward=self.options.reshard_after_forward, **common)
        # The root's parameters (the head) are needed again as soon as backward starts.
        fully_shard(module, reshard_after_forward=False, **common)
        module.to_empty(device=self.device)
        self.loaded_from = load_from_rank0(
            module,
            self.config.model,
            self.role,
            self.config.seed,
            self.device,
            where=f"{self.config_path}.model",
            adapter=self.adapter,
        )
        return module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: FSDP reduces them once, in the step's last backward."""
        if self.mesh is None:
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def move_model(self, device: torch.device, parameters: bool, gradients: bool) -> None:
        """Sharded parameters move with ``module.to`` (FSDP re-registers its shards there), and their
        gradients with them: FSDP cannot keep the two apart."""
        if self.mesh is None:
            move_module(self.module, device, parameters=parameters, gradients=gradients)
            return
        if parameters != gradients:
            raise ValueError(
                f"UlyssesEngine.to({str(device)!r}, model={parameters}, grad={gradients}): FSDP keeps gradients "
                "on their parameters' device; move both (model=True, grad=True) or neither"
            )
        self.module.to(device)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole weight, gathered over the mesh on the compute device: a collective of every rank."""
        return tensor.to(self.device).full_tensor() if isinstance(tensor, DTensor) else tensor

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        self._initialized()
        try:
            if self.sp_size == 1:
                result = super().forward_backward_batch(batch, loss_fn, forward_only)
            else:
                result = run_micro_batches(
                    batch,
                    forward=lambda micro_batch: ulysses.ulysses_forward(
                        self.model,
                        micro_batch,
                        self.role,
                        self.mesh.sp_group,
                        self.config.micro_batch.logits_chunk_size,
                    ),
                    loss_fn=loss_fn,
                    forward_only=forward_only,
                    micro_batch_config=self.config.micro_batch,
                    dp_group=self.dp_group,
                    no_sync=self.no_sync,
                    device=self.device,
                )
        except BaseException:
            if self.mesh is not None:  # leave FSDP ready for the next step (its gradients are not cleaned)
                self.model.reset_iter_state()
                self._reshard()
            raise
        if forward_only:
            # The root keeps its gathered parameters after forward until a backward that never comes.
            self._reshard()
        if not self.is_output_rank:
            result = attrs.evolve(result, outputs=None)
        return result

    def _reshard(self) -> None:
        if self.mesh is not None:
            for unit in self.model.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def _options_path(self) -> str:
        """Where the options sit in a run config: ``actor.engine.ulysses``."""
        return f"{self.config_path}.{BACKEND}"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (the classes of its ``_no_split_modules``), children before parents."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in classes][::-1]
