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
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from verl_core import errors
from verl_core.config.engine import ModelConfig
from verl_core.deprecation import moved_names


def _sampling_rule(description: str, accept: Callable[[Any], bool]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator refusing what ``accept`` does not (and booleans, which are ints to Python),
    with a ``ValueError`` naming the field and what it must be."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not accept(value):
            raise ValueError(f"SamplingParams.{attribute.name}={value!r}: must be {description}")

    return validate


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def _is_number(value: Any, low: float, high: float = math.inf, *, include_low: bool = True) -> bool:
    return (
        isinstance(value, numbers.Real)
        and math.isfinite(value)
        and (value >= low if include_low else value > low)
        and value <= high
    )


@attrs.frozen
class SamplingParams:
    """How one ``generate`` call samples.

    ``temperature=0`` is greedy decoding (its log-probs are those of the untempered distribution);
    ``top_k=0`` and ``top_p=1`` disable the filters. Generation stops at any of ``eos_token_ids`` or
    after ``max_new_tokens``. Every field is checked on construction (a ``ValueError`` naming it): a
    negative temperature would sample the inverted distribution, and ``top_p=0`` keep no token.
    """

    max_new_tokens: int = attrs.field(
        validator=_sampling_rule("an int >= 1: the most tokens a response may have", lambda v: _is_int(v, 1))
    )
    eos_token_ids: tuple[int, ...] = attrs.field(
        validator=_sampling_rule(
            "a tuple of token ids (ints >= 0); () for none",
            lambda ids: isinstance(ids, (tuple, list)) and all(_is_int(i, 0) for i in ids),
        )
    )
    pad_token_id: int = attrs.field(
        validator=_sampling_rule("a token id, an int >= 0", lambda v: _is_int(v, 0))
    )
    temperature: float = attrs.field(
        default=1.0,
        validator=_sampling_rule("a finite number >= 0 (0: greedy decoding)", lambda v: _is_number(v, 0)),
    )
    top_k: int = attrs.field(
        default=0,
        validator=_sampling_rule(
            "an int >= 0: sample among the top_k most likely tokens, 0 for all of them (vLLM's -1)",
            lambda v: _is_int(v, 0),
        ),
    )
    top_p: float = attrs.field(
        default=1.0,
        validator=_sampling_rule(
            "a number in (0, 1]: the probability mass sampled from, 1 for all of it",
            lambda v: _is_number(v, 0, 1, include_low=False),
        ),
    )

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
