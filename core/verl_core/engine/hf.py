"""Hugging Face models for engines: load one for a role, run it on a micro-batch, export it.

Roles (``verl_core.descriptors.MODEL_ROLES``): ``lm`` is a causal LM whose outputs are per-token
log-probs of the response (policy, reference); ``value`` is a token-classification model with one
label, a scalar per token (the critic, as in verl), initialised from the same causal-LM checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tensordict import TensorDict
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from verl_core.config.engine import ModelConfig
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES, VALUES
from verl_core.descriptors import MODEL_ROLES
from verl_core.engine.base import COMPUTE_ENTROPY, TEMPERATURE
from verl_core.engine.checkpoint import atomic_directory
from verl_core.engine.logprob import log_probs_and_entropy
from verl_core.engine.seed import seeded

#: Every Hugging Face model directory has it: what makes an earlier export replaceable.
HF_CONFIG_FILE = "config.json"

LOG_PROBS = "log_probs"
ENTROPY = "entropy"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Files of a model directory that describe the tokenizer; copied along with an export so that the
#: exported directory is usable on its own (by the rollout, by ``from_pretrained`` + tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def load_hf_model(config: ModelConfig, role: str = "lm", seed: int = 0) -> PreTrainedModel:
    """Load ``config.path`` for ``role`` on CPU, in ``config.dtype``, in train mode.

    Weights the checkpoint lacks (the value head of a critic built from a causal LM) are initialised
    from ``seed``, identically on every rank.
    """
    if role not in MODEL_ROLES:
        raise ValueError(f"role={role!r}: expected one of {MODEL_ROLES}")
    if config.dtype not in DTYPES:
        raise ValueError(f"model.dtype={config.dtype!r}: expected one of {sorted(DTYPES)}")
    hf_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
    if role == "value":
        hf_config.num_labels = 1
        # The head's dropout would make values differ between train and eval passes.
        hf_config.classifier_dropout = 0.0
    model_class = AutoModelForCausalLM if role == "lm" else AutoModelForTokenClassification
    with seeded(seed):
        model = model_class.from_pretrained(
            config.path,
            config=hf_config,
            dtype=DTYPES[config.dtype],
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
        )
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works under DDP/FSDP; transformers renamed the method in v5.
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})
    model.train()
    return model


def forward_micro_batch(
    model: torch.nn.Module, micro_batch: TensorDict, role: str
) -> dict[str, torch.Tensor]:
    """Run ``model`` (possibly wrapped, e.g. by DDP) on one micro-batch of the batch contract.

    Returns ``{"log_probs": [b, R]}`` plus ``{"entropy": [b, R]}`` when the batch's
    ``compute_entropy`` is set, for ``lm``; ``{"values": [b, R]}`` for ``value``. Response token
    ``t`` is predicted from the logits at column ``P + t - 1`` (``P = L - R``, the prompt length).
    """
    response_length = micro_batch[RESPONSES].shape[-1]
    # Logits of the last R + 1 columns suffice; models that ignore ``logits_to_keep`` return all L.
    output = model(
        input_ids=micro_batch[INPUT_IDS],
        attention_mask=micro_batch[ATTENTION_MASK],
        position_ids=micro_batch[POSITION_IDS],
        use_cache=False,
        **({"logits_to_keep": response_length + 1} if role == "lm" else {}),
    )
    response_logits = output.logits[:, -response_length - 1 : -1]
    if role == "value":
        return {VALUES: response_logits.squeeze(-1).float()}
    temperature = float(_non_tensor(micro_batch, TEMPERATURE, 1.0))
    compute_entropy = bool(_non_tensor(micro_batch, COMPUTE_ENTROPY, False))
    log_probs, entropy = log_probs_and_entropy(
        response_logits, micro_batch[RESPONSES], temperature, compute_entropy
    )
    return {LOG_PROBS: log_probs} if entropy is None else {LOG_PROBS: log_probs, ENTROPY: entropy}


def export_hf_model(
    model: PreTrainedModel,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer_source: str | Path | None = None,
) -> None:
    """Write ``model`` (or ``state_dict``, e.g. gathered from shards) as a Hugging Face safetensors
    directory, with the tokenizer files of ``tokenizer_source`` when it has any. Call on one rank.

    The directory appears complete or not at all (a crash mid-write leaves no half-written model for
    a later run to load); an earlier export at ``path`` is replaced.
    """
    with atomic_directory(path, replaceable=HF_CONFIG_FILE) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        if tokenizer_source is not None:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_source) / name
                if source.is_file():
                    shutil.copy2(source, staging / name)


def _non_tensor(batch: TensorDict, key: str, default: object) -> object:
    value = batch.get_non_tensor(key, default)
    return value.item() if isinstance(value, torch.Tensor) else value
