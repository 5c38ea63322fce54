"""Hugging Face exports of an engine's model: one writer's atomic ``save_pretrained`` with the
tokenizer files beside it, and ``save_hf_model`` for any engine from its per-tensor export.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    PreTrainedModel,
)

from verl_core.distributed import barrier
from verl_core.toolkit.checkpoint import atomic_directory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Every Hugging Face model directory has it: what makes an earlier export replaceable.
HF_CONFIG_FILE = "config.json"

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


def export_hf_model(
    model: PreTrainedModel,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer_source: str | Path | None = None,
    also_write: Callable[[Path], None] | None = None,
) -> None:
    """Write ``model`` (or ``state_dict``, e.g. gathered from shards) as a Hugging Face safetensors
    directory, with the tokenizer files of ``tokenizer_source`` when it has any. Call on one rank.
    ``also_write(folder)`` adds files of its own (a LoRA adapter) to the folder before it appears.

    The directory appears complete or not at all (a crash mid-write leaves no half-written model for
    a later run to load); an earlier export at ``path`` is replaced.
    """
    with atomic_directory(path, replaceable=HF_CONFIG_FILE) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        if also_write is not None:
            also_write(staging)
        if tokenizer_source is not None:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_source) / name
                if source.is_file():
                    shutil.copy2(source, staging / name)


def save_hf_model_from_params(
    model: PreTrainedModel,
    params: Iterable[tuple[str, torch.Tensor]],
    path: str | Path,
    *,
    rank: int,
    group: ProcessGroup | None = None,
    tokenizer_source: str | Path | None = None,
    also_write: Callable[[Path], None] | None = None,
) -> None:
    """``save_hf_model`` for any engine: a collective over ``group``, every rank returns once the
    export exists.

    Every rank iterates ``params`` (the engine's ``get_per_tensor_param()``: a collective for sharded
    engines); rank 0 keeps each full tensor on the CPU and writes ``model``'s config with that state
    dict (``export_hf_model``, atomic). ``model`` only supplies the config and the file layout (a
    meta-device model does).
    """
    keep = rank == 0
    state_dict = {}
    for name, tensor in params:
        if keep:
            state_dict[name] = tensor.detach().to("cpu")
    if keep:
        export_hf_model(
            model, path, state_dict=state_dict, tokenizer_source=tokenizer_source, also_write=also_write
        )
    barrier(group)  # no rank returns before the export exists
