"""The megatron engine's weights in Hugging Face terms: filling this rank's shards from a Hugging Face
state dict at ``initialize``, and giving every tensor back whole, under its Hugging Face name and in
the Hugging Face order, for the rollout (``get_per_tensor_param``) and for ``save_hf_model``.

A mixin of ``MegatronEngine``: it reads the engine's ``chunks``, ``_maps`` (the ``TensorMap`` of every
Hugging Face tensor), ``_params`` (this rank's parameters by megatron-core name), ``_heads``,
``_stage_ranks``, ``tp_size``, ``pp_size`` and ``_parallel_state()``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from verl_core.toolkit import save_hf_model_from_params
from verl_megatron.weights import TensorMap

#: A local decoder-layer index in a chunk's parameter names.
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class WeightExchange:
    """Hugging Face tensors in and out of the engine's megatron-core shards."""

    def _global_parameter_names(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the names ``tensor_maps`` uses (global layer indices)."""
        from verl_megatron.model import global_layer_index

        params = {}
        for chunk in self.chunks:
            for name, param in chunk.named_parameters():
                local = _LAYER.match(name)
                if local is not None:
                    index = global_layer_index(chunk, int(local.group(1)))
                    name = f"decoder.layers.{index}.{name[local.end() :]}"
                params[name] = param
        return params

    def _pipeline_ranks_of_stages(self) -> dict[str | int, int]:
        """For each ``TensorMap.stage``: the pipeline rank whose chunks hold it."""
        mine = {m.stage for m in self._maps if m.megatron_name in self._params}
        state = self._parallel_state()
        gathered: list[Any] = [None] * self.pp_size
        dist.all_gather_object(
            gathered, sorted(mine, key=str), group=state.get_pipeline_model_parallel_group()
        )
        stages = {}
        for pp_rank, held in enumerate(gathered):
            for stage in held:
                stages.setdefault(stage, pp_rank)  # a tied head also sits on the last stage: the first wins
        return stages

    @torch.no_grad()
    def _load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Copy every Hugging Face tensor into this rank's shard of its megatron-core parameter."""
        state = self._parallel_state()
        tp_rank = state.get_tensor_model_parallel_rank()
        loaded = set()
        for tensor_map in self._maps:
            if tensor_map.megatron_name in loaded:
                continue  # a tied lm_head: the embedding it is
            target = self._params.get(tensor_map.megatron_name)
            if target is None:
                continue  # another pipeline stage holds it
            shard = tensor_map.to_megatron(
                [hf_state[n] for n in tensor_map.hf_names], tp_rank, self.tp_size, self._heads
            )
            target.copy_(shard)
            loaded.add(tensor_map.megatron_name)
        # With tied embeddings on several stages the last one keeps its own copy of the embedding as
        # the head (megatron-core keeps the two in sync through their gradients).
        if "output_layer.weight" in self._params and "output_layer.weight" not in loaded:
            embedding = next(m for m in self._maps if m.megatron_name == "embedding.word_embeddings.weight")
            self._params["output_layer.weight"].copy_(
                embedding.to_megatron([hf_state[embedding.hf_names[0]]], tp_rank, self.tp_size, self._heads)
            )
            loaded.add("output_layer.weight")
        unloaded = sorted(set(self._params) - loaded)
        if unloaded:
            raise RuntimeError(f"megatron-core parameters without a Hugging Face tensor: {unloaded}")

    @torch.no_grad()
    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, whole, under its Hugging Face name, in Hugging Face order: gathered over the
        TP ranks on the stage that holds it, then broadcast to the other stages. A collective: every
        rank iterates to the end."""
        self._initialized()
        state = self._parallel_state()
        tp_group = state.get_tensor_model_parallel_group()
        pp_group = state.get_pipeline_model_parallel_group()
        pp_rank = state.get_pipeline_model_parallel_rank()
        joined: tuple[TensorMap | None, list[torch.Tensor]] = (None, [])
        for (name, tensor_map, index), meta in zip(self._export_order, self._export_shapes, strict=True):
            owner = self._stage_of[tensor_map.stage]
            if pp_rank == owner:
                if joined[0] is not tensor_map:
                    joined = (tensor_map, self._join(tensor_map, tp_group))
                tensor = joined[1][index]
            else:
                tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            if self.pp_size > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            yield name, tensor

    def _join(self, tensor_map: TensorMap, tp_group) -> list[torch.Tensor]:
        local = self._params[tensor_map.megatron_name].detach()
        if tensor_map.split == "replicated" or self.tp_size == 1:
            return tensor_map.to_hf([local] * self.tp_size, self._heads)
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
        return tensor_map.to_hf(shards, self._heads)

    def save_hf_model(self, path: str) -> None:
        self._initialized()
        save_hf_model_from_params(
            self.hf_module,
            self.get_per_tensor_param(),
            path,
            rank=dist.get_rank(),
            group=dist.group.WORLD,
            tokenizer_source=self.config.model.path,
        )
