"""Options every engine backend shares. Backend-specific options are the backend's own attrs class."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from verl_core.config.validators import (
    InvalidValue,
    device,
    each,
    finite,
    in_range,
    non_empty,
    non_negative,
    one_of,
    positive,
    unit_interval,
)


def _target_modules(instance: Any, attribute: attrs.Attribute[Any], value: str | list[str]) -> None:
    if isinstance(value, str):
        non_empty(instance, attribute, value)
    elif not value:
        raise InvalidValue(attribute.name, "an empty list adapts no layer: name some, or use 'all-linear'")
    else:
        each(non_empty)(instance, attribute, value)


#: The dtypes a model is loaded in (``verl_core.toolkit.model.DTYPES`` maps each to torch's): an engine's
#: ``model.dtype``, and ``rollout.dtype``.
DtypeName = Literal["float32", "bfloat16", "float16"]


@attrs.define
class ModelConfig:
    """The Hugging Face model an engine owns, loaded from a local directory (``save_pretrained`` layout)."""

    path: str = attrs.field(validator=non_empty)
    dtype: DtypeName = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    #: ``torch.compile`` each decoder layer's forward (compiled on first use; shapes that vary between
    #: micro-batches are compiled once more, as dynamic).
    compile_layers: bool = False
    #: LoRA adapter rank (docs/lora.md); 0 trains the full model. With LoRA only the adapter trains and
    #: has optimiser state, the reference policy is this model with the adapter disabled, and the
    #: rollout receives the merged weights.
    lora_rank: int = attrs.field(default=0, validator=non_negative)
    #: The adapter's scale is ``lora_alpha / lora_rank``.
    lora_alpha: int = attrs.field(default=16, validator=positive)
    #: The layers that get an adapter: ``all-linear`` (every linear layer but the LM head), or a list of
    #: module names (``[q_proj, v_proj]``); names the model lacks are refused with the ones it has.
    target_modules: str | list[str] = attrs.field(default="all-linear", validator=_target_modules)
    lora_dropout: float = attrs.field(default=0.0, validator=in_range(0, 1, include_high=False))
    #: Start from a trained adapter (a folder ``PeftModel.save_pretrained`` wrote); its rank, alpha and
    #: target modules are the adapter's own. The reference policy stays the base model.
    lora_adapter_path: str | None = attrs.field(default=None, validator=attrs.validators.optional(non_empty))

    @property
    def lora(self) -> bool:
        """Whether LoRA is on: a rank, or an adapter to start from."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    @property
    def lora_key(self) -> str:
        """The key that turned LoRA on, for messages: ``lora_rank``, or ``lora_adapter_path``."""
        return "lora_rank" if self.lora_rank else "lora_adapter_path"

    def lora_role_problem(self, role: str) -> tuple[str, str] | None:
        """``(key, message)`` when LoRA is on for a role that cannot train an adapter, else ``None``.
        LoRA trains policies (role ``lm``): a value model's head starts untrained and needs full training."""
        if not self.lora or role == "lm":
            return None
        return (
            self.lora_key,
            f"LoRA is for the policy (role 'lm'), not role {role!r} (the critic): its value head starts "
            "untrained and needs full training; remove it here (the actor can still use LoRA)",
        )


#: The learning-rate schedules after warmup (``verl_core.toolkit.optim`` has their formulas).
LrScheduler = Literal["constant", "linear", "cosine"]
LR_SCHEDULERS: tuple[str, ...] = typing.get_args(LrScheduler)


@attrs.define
class OptimConfig:
    """AdamW with gradient clipping and a warmup + decay learning-rate schedule. Its rules live here,
    in its validators and ``check()``, for config files and engines built in code alike
    (``verl_core.toolkit.validate_optim_config`` runs them at an engine's config path)."""

    lr: float = attrs.field(default=1e-6, validator=[finite, non_negative])
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), validator=each(in_range(0, 1, include_high=False))
    )
    eps: float = attrs.field(default=1e-8, validator=positive)
    weight_decay: float = attrs.field(default=0.01, validator=non_negative)
    #: Clip the global gradient norm to this value; 0 disables clipping (the norm is still reported).
    clip_grad: float = attrs.field(default=1.0, validator=non_negative)
    lr_warmup_steps: int = attrs.field(default=0, validator=non_negative)
    lr_scheduler: LrScheduler = attrs.field(
        default="constant", validator=one_of(LR_SCHEDULERS, "lr_scheduler")
    )
    #: Final learning rate of the decay, as a fraction of ``lr``.
    min_lr_ratio: float = attrs.field(default=0.0, validator=unit_interval)
    #: Length of the decay, in optimiser steps; 0: the run's length. ``load_config`` fills it in from
    #: ``trainer.total_training_steps`` when that is set, else the trainer does from the dataset length.
    total_steps: int = attrs.field(default=0, validator=non_negative)

    def check(self, *, length_required: bool = False) -> Iterator[tuple[str, str]]:
        """A decaying schedule needs ``total_steps`` beyond the warmup. A config may leave it at 0 for
        the trainer to fill in from the run's length; an engine being built needs it
        (``length_required``: ``verl_core.toolkit.validate_optim_config``)."""
        decays = self.lr_scheduler != "constant"
        if decays and (self.total_steps > 0 or length_required) and self.total_steps <= self.lr_warmup_steps:
            unset = " (0: the trainer sets it from the run's length; set it when building an engine)"
            yield (
                "total_steps",
                f"{self.total_steps}: lr_scheduler {self.lr_scheduler!r} decays after the warmup until "
                f"total_steps, which must exceed lr_warmup_steps ({self.lr_warmup_steps})"
                + (unset if self.total_steps == 0 else ""),
            )


@attrs.define
class MicroBatchConfig:
    """How an engine splits its share of a batch into micro-batches (gradient accumulation)."""

    #: Sequences per micro-batch on each rank (ignored when ``use_dynamic_bsz``).
    micro_batch_size: int = attrs.field(default=1, validator=positive)
    #: Split by a token budget instead of a sequence count.
    use_dynamic_bsz: bool = False
    #: Token budget per micro-batch on each rank: the tokens it computes (each row's ``attention_mask``
    #: tokens; with shared prompts, a group's prompt once and the samples of a prompt kept together).
    max_token_len: int = attrs.field(default=8192, validator=positive)
    #: Run each micro-batch padding-free: its sequences concatenated without pad tokens, attention
    #: kept within each sequence (engines built on ``HFEngine``; the conformance kit's ``packing``
    #: check holds a backend to the padded results); see ``share_prompts``.
    packing: bool = True
    #: Compute the log-probs and entropy of a micro-batch predicting more tokens than this from the
    #: LM head a chunk of this many tokens at a time, so that its ``[tokens, vocabulary]`` logits never
    #: exist whole (the usual out-of-memory cause with large vocabularies); same values and gradients.
    #: ``null``: always whole. Models whose head is not a plain linear layer always run whole
    #: (``verl_core.toolkit.model.PLAIN_HEAD_MODEL_TYPES``).
    logits_chunk_size: int | None = attrs.field(default=1024, validator=positive)
    #: In a packed micro-batch, compute a prompt that several rows share (the ``n`` samples of a GRPO
    #: group) once, every sample's response attending to that copy: the same log-probs and gradients,
    #: the prompt's work done once per group instead of once per sample. ``null``: where the engine
    #: backend declares it (``EngineBackend(shared_prompts=True)``); ``true`` requires it; ``false``
    #: packs every row's prompt (to compare).
    share_prompts: bool | None = None

    def check(self) -> Iterator[tuple[str, str]]:
        if self.share_prompts and not self.packing:
            yield (
                "share_prompts",
                "true needs packing: true (a shared prompt is one copy in a padding-free micro-batch); "
                "set packing: true, or unset share_prompts",
            )


@attrs.define
class EngineConfig:
    """One engine: which backend, its options, the model, optimiser, micro-batching and offload."""

    backend: str
    model: ModelConfig
    #: The backend's own options: an instance of the backend's config class (see ``EngineBackend.config``).
    options: Any = None
    optim: OptimConfig = attrs.field(factory=OptimConfig)
    micro_batch: MicroBatchConfig = attrs.field(factory=MicroBatchConfig)
    #: ``auto`` picks ``cuda`` when available, else ``cpu``; or ``cpu``, ``cuda``, ``cuda:N``, ``npu``,
    #: ``xpu``, ``mps`` (``verl_core.config.validators.DEVICE_NAMES``).
    device: str = attrs.field(default="auto", validator=device)
    #: Keep parameters / optimiser state on CPU outside ``train_mode()`` / ``eval_mode()``.
    param_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 0

    def check(self) -> Iterator[tuple[str, str]]:
        if self.micro_batch.share_prompts and self.model.attn_implementation != "sdpa":
            yield (
                "micro_batch.share_prompts",
                f"true needs model.attn_implementation: sdpa, not {self.model.attn_implementation!r}: "
                "variable-length kernels (flash attention) take one contiguous sequence per sample, "
                "which a shared prompt is not; unset share_prompts to pack every prompt",
            )
