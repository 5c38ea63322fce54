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

LoRA (``config.model.lora_rank``, docs/lora.md) comes with it: ``initialize`` wraps the loaded model
in a ``PeftModel`` before ``wrap_model`` (so ``module`` is the ``PeftModel``), the optimiser holds the
adapter only, the weight export is merged, ``reference()`` disables the adapter, and
``checkpointed_state`` tells the backend's checkpoints to hold the adapter only.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig
from verl_core.engine.base import BaseEngine, ForwardBackwardResult, LossFn
from verl_core.engine.device import move_module
from verl_core.engine.hf import forward_micro_batch, load_hf_model, save_hf_model_from_params
from verl_core.engine.loop import run_micro_batches
from verl_core.engine.lora import (
    LORA_ADAPTER_DIR,
    adapter_disabled,
    adapter_params,
    apply_lora,
    check_lora_role,
    merged_params,
    save_adapter,
)
from verl_core.engine.optim import (
    TorchOptimizerSteps,
    build_lr_scheduler,
    build_optimizer,
    move_optimizer_state,
    validate_optim_config,
)


class HFEngine(TorchOptimizerSteps, BaseEngine):
    """An engine over one Hugging Face model per rank (``lm`` or ``value`` role), AdamW, and
    ``run_micro_batches``; subclass it and implement ``wrap_model`` and the checkpoint methods."""

    def __init__(self, config: EngineConfig, role: str = "lm", *, config_path: str = "engine"):
        super().__init__(config, role, config_path=config_path)
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
        check_lora_role(self.config.model, self.role, f"{self.config_path}.model")
        module = self.load_model()
        if self.config.model.lora:
            module = apply_lora(module, self.config.model, self.config.seed, f"{self.config_path}.model")
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
        return self.config.model.lora

    def reference(self) -> contextlib.AbstractContextManager:
        if not self.serves_reference:
            return super().reference()
        return adapter_disabled(self._initialized())

    # -- weights ---------------------------------------------------------------------------------

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, whole, under its Hugging Face name, in state-dict order, one at a time; with
        LoRA merged with the adapter as it is now.

        On sharded engines each ``full_tensor`` is a collective: every rank iterates to the end.
        """
        module = self._initialized()
        if self.config.model.lora:
            yield from merged_params(module, self.full_tensor)
            return
        for name, tensor in module.state_dict().items():
            yield name, self.full_tensor(tensor.detach())

    def save_hf_model(self, path: str) -> None:
        """The Hugging Face export; with LoRA the merged model, and the adapter in ``lora_adapter/``."""
        module = self._initialized()
        write_adapter = None
        if self.config.model.lora:
            adapter = adapter_params(module, self.full_tensor)  # a collective: every rank gathers
            module = module.get_base_model()  # the config and file layout of the merged model

            def write_adapter(staging: Path) -> None:
                save_adapter(self.module, adapter, staging / LORA_ADAPTER_DIR)

        save_hf_model_from_params(
            module,
            self.get_per_tensor_param(),
            path,
            rank=self.dp_rank,
            group=self.dp_group,
            tokenizer_source=self.config.model.path,
            also_write=write_adapter,
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpointed_state(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of a model state dict (``module``'s names) that checkpoints hold: all of them;
        with LoRA the adapter's only, as the base weights are ``config.model.path``'s and never change."""
        if not self.config.model.lora:
            return state_dict
        trainable = {
            name for name, parameter in self._initialized().named_parameters() if parameter.requires_grad
        }
        return {name: value for name, value in state_dict.items() if name in trainable}

    # -- helpers ---------------------------------------------------------------------------------

    def _initialized(self) -> torch.nn.Module:
        """The Hugging Face model, or a clear error before ``initialize()``."""
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__} is not initialised: call initialize() first")
        return self.module
