"""Options every engine backend shares. Backend-specific options are the backend's own attrs class."""

from __future__ import annotations

from typing import Any, Literal

import attrs


@attrs.define
class ModelConfig:
    """The Hugging Face model an engine owns, loaded from a local directory (``save_pretrained`` layout)."""

    path: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False


@attrs.define
class OptimConfig:
    """AdamW with gradient clipping and a warmup + decay learning-rate schedule."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    #: Clip the global gradient norm to this value; 0 disables clipping (the norm is still reported).
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    #: Final learning rate of the decay, as a fraction of ``lr``.
    min_lr_ratio: float = 0.0
    #: Length of the decay; the trainer fills it in from the run length when left at 0.
    total_steps: int = 0


@attrs.define
class MicroBatchConfig:
    """How an engine splits its share of a batch into micro-batches (gradient accumulation)."""

    #: Sequences per micro-batch on each rank (ignored when ``use_dynamic_bsz``).
    micro_batch_size: int = 1
    #: Split by a token budget instead of a sequence count.
    use_dynamic_bsz: bool = False
    #: Token budget per micro-batch on each rank (counts ``attention_mask`` tokens).
    max_token_len: int = 8192


@attrs.define
class EngineConfig:
    """One engine: which backend, its options, the model, optimiser, micro-batching and offload."""

    backend: str
    model: ModelConfig
    #: The backend's own options: an instance of the backend's config class (see ``EngineBackend.config``).
    options: Any = None
    optim: OptimConfig = attrs.field(factory=OptimConfig)
    micro_batch: MicroBatchConfig = attrs.field(factory=MicroBatchConfig)
    #: ``auto`` picks ``cuda`` when available, else ``cpu``.
    device: str = "auto"
    #: Keep parameters / optimiser state on CPU outside ``train_mode()`` / ``eval_mode()``.
    param_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 0
