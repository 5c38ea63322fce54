"""Trained weights into the engine's model in place: no files, no new engine.

A stream of full tensors under Hugging Face names (an engine's ``get_per_tensor_param()``, or the
tensors of verified buckets) goes through ``checked``, which refuses a name the Hugging Face model does
not have, a second copy of one, and a shape it does not have, before vLLM sees the tensor, and copies
each tensor (vLLM holds a layer's tensors until the whole layer has arrived, and a sender may reuse
its buffer meanwhile). vLLM's ``load_weights`` maps the names onto its own layout (fused q/k/v and
gate/up, shards). On a CPU, plain ``load_weights`` cannot write weights that vLLM repacked for its
kernels at start-up, so loading goes through vLLM's layer-wise reload (``initialize_layerwise_reload``,
then ``load_weights``, then ``finalize_layerwise_reload``, which repacks each layer once its weights are
all there); a tied LM head receives no tensor of its own, so its packed copy is made again from the
new embedding. ``finalize`` always runs, also after a refused tensor, so that a failed stream leaves
vLLM able to take the next complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from verl_core.errors import RolloutError, did_you_mean


def hf_weight_shapes(path: str, trust_remote_code: bool) -> dict[str, tuple[int, ...]]:
    """Every weight a training engine sends for the model at ``path`` (its Hugging Face state dict, tied
    weights under each name), with its shape, read from the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def tied_embeddings(path: str) -> bool:
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config", config)
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


class Stream:
    """Checks a weight stream against the Hugging Face model's names and shapes as it is read."""

    def __init__(self, expected: dict[str, tuple[int, ...]]):
        self.expected = expected
        self.seen: set[str] = set()

    def checked(self, params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in params:
            shape = self.expected.get(name)
            if shape is None:
                raise RolloutError(
                    f"weight update: {name!r} is not a weight of the rollout's model"
                    f"{did_you_mean(name, self.expected)}; the engine must export Hugging Face names "
                    "(get_per_tensor_param), not vLLM's fused ones"
                )
            if name in self.seen:
                raise RolloutError(f"weight update: {name!r} arrived twice in one update")
            if tuple(tensor.shape) != shape:
                raise RolloutError(
                    f"weight update: {name!r} has shape {list(tensor.shape)} but the rollout's model has "
                    f"{list(shape)}; the engine must export full (unsharded) tensors"
                )
            self.seen.add(name)
            yield name, tensor.detach().clone()

    def missing(self) -> list[str]:
        return [name for name in self.expected if name not in self.seen]


#: The logger of vLLM's layer-wise reload.
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_in_place(
    worker: Any, stream: Stream, params: Iterable[tuple[str, torch.Tensor]], tied: bool
) -> None:
    """Run on the engine's worker (``collective_rpc``): ``params`` into its model, layer by layer."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    model = runner.model
    initialize_layerwise_reload(model)
    try:
        model.load_weights(stream.checked(params))
    finally:
        # It warns of every layer that received nothing, which its buffers (the rotary cache) never do;
        # whether every weight arrived is the stream's to say.
        with _quiet(LAYERWISE_LOGGER):
            finalize_layerwise_reload(model, runner.vllm_config.model_config)
        head = getattr(model, "lm_head", None)
        if tied and head is not None and getattr(head, "quant_method", None) is not None:
            # The tied head's weight is the embedding's, which changed; its kernel copy (the CPU's packed
            # weight) did not, for the head itself received nothing.
            head.quant_method.process_weights_after_loading(head)
