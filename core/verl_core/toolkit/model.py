"""Hugging Face models for engines: load one for a role (the forward pass is ``forward``, the export
``export``).

Roles (``verl_core.ModelRole``): ``lm`` is a causal LM whose outputs are per-token
log-probs of the response (policy, reference); ``value`` is a token-classification model with one
label, a scalar per token (the critic, as in verl), initialised from the same causal-LM checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from verl_core.config.engine import ModelConfig
from verl_core.descriptors import ModelRole
from verl_core.errors import ConfigError
from verl_core.toolkit.export import HF_CONFIG_FILE
from verl_core.toolkit.seed import seeded
from verl_core.toolkit.varlen import attn_implementation_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_dir(path: str, where: str = "model.path") -> Path:
    """``path`` as a local Hugging Face model directory, or a ``ConfigError`` at ``where`` saying what
    it is instead (missing, a file, a hub id, a folder without ``config.json``) and how to fix it.

    Models load from local folders only: nothing here reaches the network.
    """
    directory = Path(path).expanduser()
    if directory.is_dir():
        if (directory / HF_CONFIG_FILE).is_file():
            return directory
        problem = (
            f"{path!r} is a folder without {HF_CONFIG_FILE}, so it is not a Hugging Face model: point it at "
            "the folder that save_pretrained() wrote (the one holding config.json and the weights)"
        )
    elif directory.exists():
        problem = f"{path!r} is a file; give the model's folder (the one holding {HF_CONFIG_FILE})"
    else:
        problem = f"{path!r} does not exist (relative paths are relative to {Path.cwd()})"
        if _looks_like_hub_id(path):
            problem += (
                "; if it is a Hugging Face hub id: models load from local folders only (never from the "
                f"network), so download it first, e.g. `hf download {path} --local-dir "
                f"models/{path.split('/')[-1]}`, and give that folder"
            )
    raise ConfigError([(where, problem)])


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def load_hf_model(
    config: ModelConfig,
    role: ModelRole | str = ModelRole.LM,
    seed: int = 0,
    where: str = "model",
    packing: bool = False,
    on_meta: bool = False,
) -> PreTrainedModel:
    """Load ``config.path`` (a local folder) for ``role`` on CPU, in ``config.dtype``, in train mode.

    With ``packing`` (the engine runs ``forward_micro_batch(..., packing=True)``) an ``sdpa`` model
    gets ``verl_core.toolkit.varlen``'s attention, which keeps packed attention as cheap as padded.
    With ``on_meta`` only the architecture is built, on the meta device, without reading the weights:
    for a rank that receives them from another (its buffers are meta tensors too, to be filled).

    Weights the checkpoint lacks (the value head of a critic built from a causal LM) are initialised
    from ``seed``, identically on every rank. ``where`` is the config path of ``config`` for errors
    (``actor.engine.model``).
    """
    role = ModelRole(role)
    if config.dtype not in DTYPES:
        raise ConfigError([(f"{where}.dtype", f"{config.dtype!r}: expected one of {sorted(DTYPES)}")])
    path = str(check_model_dir(config.path, f"{where}.path"))
    hf_config = AutoConfig.from_pretrained(
        path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    if role == "value":
        hf_config.num_labels = 1
        # The head's dropout would make values differ between train and eval passes.
        hf_config.classifier_dropout = 0.0
    model_class = AutoModelForCausalLM if role == "lm" else AutoModelForTokenClassification
    common = {
        "dtype": DTYPES[config.dtype],
        "attn_implementation": attn_implementation_for(config.attn_implementation, packing),
        "trust_remote_code": config.trust_remote_code,
    }
    if on_meta:
        with torch.device("meta"):
            model = model_class.from_config(hf_config, **common)
    else:
        with seeded(seed):
            model = model_class.from_pretrained(path, config=hf_config, local_files_only=True, **common)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works under DDP/FSDP; transformers renamed the method in v5.
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})
    if config.compile_layers:
        compile_decoder_layers(model, f"{where}.compile_layers")
    model.train()
    return model


def compile_decoder_layers(model: PreTrainedModel, where: str = "model.compile_layers") -> None:
    """``torch.compile`` the forward of each decoder layer (the classes of the model's
    ``_no_split_modules``), in place. Only ``forward`` is compiled, not the module call: the hooks
    that DDP and FSDP put on the layers keep running eagerly around it."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ConfigError(
            [
                (
                    where,
                    f"{type(model).__name__} names no decoder layer classes (_no_split_modules): turn it off",
                )
            ]
        )
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
