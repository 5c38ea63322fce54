"""Meta-device initialisation: the model built on ``meta`` on every rank, sharded, then filled from rank 0.

Every rank builds the architecture on the meta device (core's ``load_hf_model(..., on_meta=True)``:
no weights read, no memory), applies ``fully_shard`` per decoder layer and to the root, and allocates
its shards with ``to_empty``. Then, one tensor at a time in the model's own order:

- rank 0 reads the tensor from the checkpoint's safetensors files (``safe_open``, one tensor in
  memory at a time) and ``distribute_tensor(..., src_data_rank=0)`` scatters it, each rank receiving
  only its shard (a replicated dimension, HSDP's, broadcasts);
- buffers in the state dict are broadcast whole.

``to_empty`` leaves every buffer uninitialised, and the non-persistent ones (the rotary ``inv_freq``)
are in no checkpoint: they are **recomputed** on every rank, by building the module that owns them
again from the model's config (cheap: a rotary embedding holds a few hundred floats). A garbage
``inv_freq`` moves a tiny model's loss by only ~5e-5, so the tests compare every buffer bitwise.

A checkpoint that lacks a tensor the model has (a critic's value head in a causal LM's checkpoint, a
LoRA adapter) or names tensors otherwise (older layouts that transformers converts on load, a
``PeftModel``'s names) cannot be streamed by name: rank 0 then loads the model through core's
``load_hf_model`` (``from_pretrained``, the new head seeded as every other backend seeds it), puts the
engine's adapter on it as every rank did on the meta model (the same seed: the same initial adapter
as any other backend's), and scatters from that instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor
from verl_core.config import ModelConfig
from verl_core.toolkit import Adapter, check_model_dir, load_hf_model

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """The tensors of a Hugging Face checkpoint by name, read one at a time (rank 0 only)."""

    def __init__(self, directory: Path):
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SAFETENSORS_FILE).is_file():
            with safe_open(directory / SAFETENSORS_FILE, framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), directory / SAFETENSORS_FILE)
        else:
            self.files = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def pop(self, name: str) -> torch.Tensor:
        with safe_open(self.files.pop(name), framework="pt") as handle:
            return handle.get_tensor(name)


def tensors_to_fill(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint fills: every parameter (tied ones once, under their first name) and every
    buffer in the state dict, in one order on every rank."""
    persistent = set(model.state_dict(keep_vars=True))
    return [
        *model.named_parameters(),
        *((name, buffer) for name, buffer in model.named_buffers() if name in persistent),
    ]


def load_from_rank0(
    model: torch.nn.Module,
    config: ModelConfig,
    role: str,
    seed: int,
    device: torch.device,
    where: str,
    adapter: Adapter,
) -> str:
    """Fill the sharded, ``to_empty``-allocated ``model`` (``adapter.wrap`` of the meta model) on every
    rank of the job from the checkpoint of ``config`` that rank 0 reads, and recompute the
    non-persistent buffers. A collective over the world group. Returns how rank 0 read the weights:
    ``"safetensors"`` (streamed by name) or ``"from_pretrained"`` (the fallback)."""
    targets = tensors_to_fill(model)
    source: SafetensorsReader | dict[str, torch.Tensor] | None = None
    decision = [None]
    if dist.get_rank() == 0:
        source = SafetensorsReader(check_model_dir(config.path, f"{where}.path"))
        streamable = all(name in source for name, _ in targets)
        if not streamable:  # a new value head, or names transformers converts: load it the usual way
            loaded = load_hf_model(config, role, seed=seed, where=where)
            source = dict(tensors_to_fill(adapter.wrap(loaded, seed)))
        decision = ["safetensors" if streamable else "from_pretrained"]
    dist.broadcast_object_list(decision, src=0)
    with torch.no_grad():
        for name, target in targets:
            if source is not None:  # rank 0: dropped from ``source`` once sent
                full = source.pop(name).to(device=device, dtype=target.dtype)
            else:
                full = torch.empty(target.shape, dtype=target.dtype, device=device)
            if isinstance(target, DTensor):
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
                target.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(full, src=0)
                target.copy_(full)
            del full
    recompute_non_persistent_buffers(model, device)
    return decision[0]


def non_persistent_buffers(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s own buffers that are not in its state dict."""
    in_state = {name for name in module.state_dict(keep_vars=True) if "." not in name}
    return [name for name, _ in module.named_buffers(recurse=False) if name not in in_state]


def recompute_non_persistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Give every buffer outside the state dict (the rotary ``inv_freq``, garbage after ``to_empty``)
    its real value: the module that owns it is built again from its config on the CPU and its buffers
    are copied over. A module that cannot be rebuilt so is an error naming the buffer: silently
    keeping garbage is what this function exists to prevent."""
    for module_name, module in model.named_modules():
        names = non_persistent_buffers(module)
        if not names:
            continue
        try:
            fresh = type(module)(module.config)
        except (AttributeError, TypeError) as error:
            raise RuntimeError(
                f"cannot recompute the buffers {names} of {module_name} ({type(module).__name__}) after "
                f"meta-device initialisation: the module is not built from a config alone ({error}); "
                "the ulysses backend supports models whose only non-persistent buffers are such modules' "
                "(rotary embeddings)"
            ) from error
        for name in names:
            # Assigning a tensor to a buffer's name replaces the buffer (it stays non-persistent).
            setattr(
                module, name, fresh.get_buffer(name).to(device=device, dtype=module.get_buffer(name).dtype)
            )
