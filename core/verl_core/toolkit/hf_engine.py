"""``HFEngine``: what every engine that owns a Hugging Face model and a ``torch.optim`` optimiser shares.

A backend built on it supplies its parallel layout and little else:

- ``wrap_model(module)`` (required): lay the loaded model out over ``dp_group`` on ``self.device``
  and return what runs forward (``DistributedDataParallel(module)``, the FSDP-sharded module, or
  ``module`` itself);
- ``load_model()``: the model this rank starts from (default: ``load_hf_model`` on the CPU; a
  backend whose ranks receive the weights from another builds it on the meta device instead);
- ``no_sync()``: skip gradient synchronisation between micro-batches (default: nothing to skip);
- ``move_model(device, parameters, gradients)``: offload and reload (default: ``move_module``);
- ``full_tensor(tensor)``: a whole weight from what ``module.state_dict()`` holds (default: as is;
  sharded engines gather);
- ``save_checkpoint`` / ``load_checkpoint``: the backend's own checkpoint format.

The rest is written once, here: construction state, ``initialize`` (optimiser config checked before
the slow model load, AdamW and the LR schedule over the wrapped model's parameters, offload per
config), ``set_model_mode``, ``forward_backward_batch`` through ``run_micro_batches``, the optimiser
half of ``to``, ``get_per_tensor_param`` in Hugging Face order, and ``save_hf_model`` (rank 0 writes,
every rank returns once the export exists). docs/engine.md walks through it with the DDP template.

What the engine trains of its model is its ``adapter`` (``verl_core.toolkit.lora``): every weight, or
with ``config.model.lora_rank`` (docs/lora.md) a LoRA adapter, which ``initialize`` puts on the loaded
model before ``wrap_model`` (so ``module`` is the ``PeftModel``). The optimiser holds what requires
gradients; the weight export, the Hugging Face export, ``reference()`` and ``checkpointed_state`` ask
the adapter, so a backend gets LoRA without code of its own.

Checkpoints: set ``checkpoint_format`` to one of the toolkit's (``ReplicatedCheckpoint`` for replicas,
``DistributedCheckpoint`` for sharded state: ``verl_core.toolkit.formats``), or override
``save_checkpoint`` and ``load_checkpoint``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig
from verl_core.engine.base import BaseEngine, ForwardBackwardResult, LossFn
from verl_core.engine.loop import run_micro_batches
from verl_core.toolkit.export import save_hf_model_from_params
from verl_core.toolkit.formats import CheckpointFormat
from verl_core.toolkit.forward import forward_micro_batch
from verl_core.toolkit.lora import Adapter, adapter_for
from verl_core.toolkit.model import load_hf_model
from verl_core.toolkit.offload import move_module, move_optimizer_state
from verl_core.toolkit.optim import (
    TorchOptimizerSteps,
    build_lr_scheduler,
    build_optimizer,
    validate_optim_config,
)


class HFEngine(TorchOptimizerSteps, BaseEngine):
    """An engine over one Hugging Face model per rank (``lm`` or ``value`` role), AdamW, and
    ``run_micro_batches``; subclass it, implement ``wrap_model`` and set ``checkpoint_format``."""

    #: How ``save_checkpoint`` / ``load_checkpoint`` lay a checkpoint out (``verl_core.toolkit.formats``);
    #: a backend with a format of its own overrides the two methods instead.
    checkpoint_format: ClassVar[CheckpointFormat | None] = None

    def __init__(self, config: EngineConfig, role: str = "lm", *, config_path: str = "engine"):
        super().__init__(config, role, config_path=config_path)
        #: What trains: every weight, or a LoRA adapter (``config.model.lora``).
        self.adapter: Adapter = adapter_for(config.model, self.role, f"{self.config_path}.model")
        own_checkpoints = type(self).save_checkpoint is not HFEngine.save_checkpoint
        if self.checkpoint_format is None and not own_checkpoints:
            raise TypeError(
                f"{type(self).__name__} has no checkpoint format: set the class attribute checkpoint_format "
                "(verl_core.toolkit.ReplicatedCheckpoint for replicas, DistributedCheckpoint for sharded "
                "state), or override save_checkpoint and load_checkpoint"
            )
        #: The Hugging Face model itself: its state dict has Hugging Face names.
        self.module: torch.nn.Module | None = None
        #: What runs forward: ``wrap_model``'s result.
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        #: Where the optimiser state lives now (the compute device, or the CPU when offloaded).
        self.optimizer_device: torch.device = self.device

    # -- the backend's part ----------------------------------------------------------------------

    @abc.abstractmethod
    def wrap_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Lay ``module`` (loaded on the CPU, in train mode) out over ``dp_group`` on ``self.device``;
        return what runs forward. Called once, by ``initialize``, on every rank (a collective where
        the wrapper's construction is one: DDP broadcasts rank 0's weights)."""

    def load_model(self) -> torch.nn.Module:
        """The Hugging Face model for this rank, before ``wrap_model``: by default loaded from
        ``config.model`` on the CPU, in train mode."""
        return load_hf_model(
            self.config.model,
            self.role,
            seed=self.config.seed,
            where=f"{self.config_path}.model",
            packing=self.config.micro_batch.packing,
        )

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Entered around every micro-batch but the step's last: accumulate gradients locally."""
        return contextlib.nullcontext()

    def move_model(self, device: torch.device, parameters: bool, gradients: bool) -> None:
        """Move the model's parameters (and buffers) and/or gradients to ``device``, in place."""
        move_module(self.module, device, parameters=parameters, gradients=gradients)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole weight from a ``module.state_dict()`` value; replicated engines hold it already."""
        return tensor

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        if self.module is not None:
            raise RuntimeError(f"{type(self).__name__}.initialize() was already called")
        validate_optim_config(self.config.optim, f"{self.config_path}.optim")  # before the slow load
        module = self.adapter.wrap(self.load_model(), self.config.seed)
        self.model = self.wrap_model(module)
        self.module = module
        # Frozen weights (LoRA's base) get no optimiser state.
        trainable = (parameter for parameter in self.model.parameters() if parameter.requires_grad)
        self.optimizer = build_optimizer(trainable, self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.offload_per_config("cpu")

    def set_model_mode(self, train: bool) -> None:
        self._initialized().train(train)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        self._initialized()
        target = torch.device(device)
        if model or grad:
            self.move_model(target, parameters=model, gradients=grad)
        if optimizer:
            move_optimizer_state(self.optimizer, target)
            self.optimizer_device = target

    # -- compute ---------------------------------------------------------------------------------

    def forward_backward_batch(
        self, batch: TensorDict, loss_fn: LossFn | None, forward_only: bool
    ) -> ForwardBackwardResult:
        self._initialized()
        return run_micro_batches(
            batch,
            forward=lambda micro_batch: forward_micro_batch(
                self.model,
                micro_batch,
                self.role,
                packing=self.config.micro_batch.packing,
                logits_chunk_size=self.config.micro_batch.logits_chunk_size,
                share_prompts=self.config.micro_batch.share_prompts is not False,
            ),
            loss_fn=loss_fn,
            forward_only=forward_only,
            micro_batch_config=self.config.micro_batch,
            dp_group=self.dp_group,
            no_sync=self.no_sync,
            device=self.device,
        )

    # -- the reference policy --------------------------------------------------------------------

    @property
    def serves_reference(self) -> bool:
        """With LoRA the base model is the reference policy: ``reference()`` runs it, no second copy."""
        return self.adapter.serves_reference

    def reference(self) -> contextlib.AbstractContextManager:
        if not self.serves_reference:
            return super().reference()
        return self.adapter.reference(self._initialized())

    # -- weights ---------------------------------------------------------------------------------

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, whole, under its Hugging Face name, in state-dict order, one at a time; with
        LoRA merged with the adapter as it is now.

        On sharded engines each ``full_tensor`` is a collective: every rank iterates to the end.
        """
        return self.adapter.weights(self._initialized(), self.full_tensor)

    def save_hf_model(self, path: str) -> None:
        """The Hugging Face export, written by rank 0 of ``state_group``; with LoRA the merged model,
        and the adapter in ``lora_adapter/``."""
        layout, also_write = self.adapter.export(self._initialized(), self.full_tensor)
        save_hf_model_from_params(
            layout,
            self.get_per_tensor_param(),
            path,
            rank=self.state_rank,
            group=self.state_group,
            tokenizer_source=self.config.model.path,
            also_write=also_write,
        )

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def state_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold one copy of the model and optimiser state between them: checkpoints and
        exports are collectives over it. The DP group by default (replicas and FSDP shards); an engine
        sharding over more ranks (sequence parallelism) returns those."""
        return self.dp_group

    @property
    def state_rank(self) -> int:
        """This rank's index in ``state_group``: rank 0 writes what is written once."""
        return self.dp_rank

    def checkpointed_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of a model state dict (``module``'s names) that checkpoints hold: all of them;
        with LoRA the adapter's only, as the base weights are ``config.model.path``'s and never change."""
        return self.adapter.checkpointed_state(self._initialized(), state_dict)

    def save_checkpoint(self, path: str, global_step: int = 0) -> None:
        self._initialized()
        self.checkpoint_format.save(self, path, global_step)

    def load_checkpoint(self, path: str) -> int:
        self._initialized()
        return self.checkpoint_format.load(self, path)

    # -- helpers ---------------------------------------------------------------------------------

    def _initialized(self) -> torch.nn.Module:
        """The Hugging Face model, or a clear error before ``initialize()``."""
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised: call initialize() first")
        return self.module
