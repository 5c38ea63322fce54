"""The rollout contract: what every generation backend (the built-in ``hf``, vLLM, SGLang) implements.

A rollout owns its own copy of the policy's weights on one rank, generates responses to token-id
prompts, and receives the trained weights after every update as a stream of full tensors under
Hugging Face names (the engine's ``get_per_tensor_param()``), in memory. ``generate`` returns the
batch contract of ``verl_core.data.batch`` (prompts left-padded, responses right-padded, the
response ending with its EOS token when one was sampled), plus ``rollout_log_probs``: the
log-probability of each sampled token under ``softmax(logits / temperature)``, the distribution the
training engine computes (before top-k / top-p filtering, which only restrict what is sampled).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import attrs
import torch
from tensordict import TensorDict

from verl_core import errors
from verl_core.config.engine import ModelConfig
from verl_core.deprecation import moved_names


@attrs.frozen
class SamplingParams:
    """How one ``generate`` call samples.

    ``temperature=0`` is greedy decoding (its log-probs are those of the untempered distribution);
    ``top_k=0`` and ``top_p=1`` disable the filters. Generation stops at any of ``eos_token_ids`` or
    after ``max_new_tokens``.
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class BaseRollout(abc.ABC):
    """Base class of every rollout backend (the descriptor ``RolloutBackend.rollout`` names one).

    Constructed with the policy's ``ModelConfig`` (the weights it starts from), the backend's
    ``options`` (its ``RolloutBackend.config`` class, or ``None`` for the defaults), the device and the
    config path of its section for errors; ``initialize()`` loads the model.
    """

    options_class: type | None = None

    def __init__(
        self, model: ModelConfig, options: object = None, *, device: str = "cpu", config_path: str = "rollout"
    ):
        self.model_config = model
        self.config_path = config_path
        self.device = torch.device(device)
        cls = self.options_class
        self.options = cls() if options is None and cls is not None else options
        if cls is not None and not isinstance(self.options, cls):
            raise errors.RolloutError(
                f"{config_path}: expected options of type {cls.__module__}.{cls.__qualname__}, "
                f"got {type(self.options).__module__}.{type(self.options).__qualname__}"
            )

    @abc.abstractmethod
    def initialize(self) -> None:
        """Load the rollout's own copy of the model (``model.path``) onto its device."""

    @abc.abstractmethod
    def update_weights(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights with ``params`` (every weight, full, Hugging Face names), one
        tensor at a time. Names and shapes must match the model exactly; a mismatch raises
        ``RolloutError`` and leaves the rollout unusable until a complete update succeeds."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        """One response per prompt (token ids, unpadded), sampled reproducibly from ``seed``.

        Returns the batch contract (``input_ids``, ``attention_mask``, ``position_ids``,
        ``responses``, ``response_mask``) and ``rollout_log_probs``, on the CPU, in prompt order.
        """


# First defined here; their homes are the batch vocabulary and the errors module.
__getattr__ = moved_names(
    __name__,
    {
        "ROLLOUT_LOG_PROBS": "verl_core.data:ROLLOUT_LOG_PROBS",
        "RolloutError": "verl_core.errors:RolloutError",
    },
    since="0.2.0",
    removed_in="0.4.0",
)
