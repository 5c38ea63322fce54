"""The rollout contract: what every generation backend (the built-in ``hf``, vLLM, SGLang) implements.

A rollout owns its own copy of the policy's weights on one rank, generates responses to token-id
prompts, and receives the trained weights after every update as a stream of full tensors under
Hugging Face names (the engine's ``get_per_tensor_param()``), in memory. ``generate`` returns the
batch contract of ``verl_core.data.batch`` (prompts left-padded, responses right-padded, the
response ending with its EOS token when one was sampled), plus ``rollout_log_probs``: the
log-probability of each sampled token under ``softmax(logits / temperature)``, the distribution the
training engine computes (before top-k / top-p filtering, which only restrict what is sampled).

That is rollout contract 1 (``initialize``, ``update_weights``, ``generate``: the abstract methods).
Contract 2 (``verl_core.ROLLOUT_API_VERSION``) adds, each with a default built on contract 1
that a backend overrides where it can do better (and says so in its ``RolloutCapabilities``):
``generate_request`` and ``abort`` (one prompt at a time, asynchronously; ``verl_core.rollout.requests``),
``sleep`` and ``wake_up`` (free the rollout's memory while the trainer updates), and
``update_weights_from_buckets`` (the weights as verified buckets; ``verl_core.rollout.buckets``).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from verl_core import errors
from verl_core.config.engine import ModelConfig
from verl_core.deprecation import moved_names
from verl_core.rollout.buckets import WeightBucket, unpack_buckets
from verl_core.rollout.params import SamplingParams
from verl_core.rollout.requests import (
    FinishReason,
    RolloutRequest,
    RolloutResponse,
    abort_in_turn,
    one_prompt_call,
    serve_in_turn,
)

if TYPE_CHECKING:
    from verl_core.config.run import RolloutConfig


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

    @classmethod
    def check_before_start(
        cls,
        config: RolloutConfig,
        *,
        model: ModelConfig,
        model_config: Mapping[str, Any],
        world_size: int,
        batch_size: int,
        config_path: str = "rollout",
    ) -> list[tuple[str, str]]:
        """The problems of ``config`` that the model and the job's size tell before any worker starts,
        each ``(key, message)``: the key under ``config_path`` (``rollout.vllm.max_model_len``), the
        message naming the fix. ``model`` is what the rollout loads (its folder, the dtype it generates
        in), ``model_config`` that folder's ``config.json``; ``world_size`` is the number of ranks that
        each hold a rollout and ``batch_size`` the prompts of a training step over all of them (each
        gets ``config.n`` responses of at most ``config.response_length`` tokens). The run's checks
        (``verl-core config``, ``train``) call it on the driver before any worker starts; a backend
        that cannot load some architectures, or sizes a cache, overrides it. The default finds nothing."""
        return []

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

    # -- contract 2: each a default built on contract 1 --------------------------------------------

    async def generate_request(self, request: RolloutRequest) -> RolloutResponse:
        """Answer one request: its tokens, their log-probs (those ``generate`` reports) and why it ended
        (``verl_core.rollout.requests``: ``resume_from``, the seed, what a resumed request preserves).

        The default serves requests one at a time, in the order they arrive, each as a ``generate`` call
        of one prompt in a worker thread (``asyncio.to_thread``): a request aborted while it waits
        returns at once with no new token (finish ``aborted``); one already generating runs to its end.
        A backend with a request path of its own (continuous batching, abort between decoding steps)
        overrides this and ``abort``, and declares it (``RolloutCapabilities.requests``,
        ``abort_resume``). A ``request_id`` already in flight is refused with ``RolloutError``.
        """
        return await serve_in_turn(self, request)

    async def abort(self, request_id: str) -> None:
        """End the request ``request_id`` early: it returns the tokens it has, finish ``aborted`` (at
        once while it waits; between decoding steps where the backend declares ``abort_resume``). An id
        that is not in flight (finished already, or never sent) is ignored: an abort may cross the end."""
        abort_in_turn(self, request_id)

    def _serve_request(
        self, request: RolloutRequest, stop: threading.Event
    ) -> tuple[list[int], list[float], FinishReason]:
        """What ``generate_request``'s default runs in its worker thread, in the request's turn: the new
        tokens of ``request`` (after ``resume_from``'s), their log-probs and the finish reason. This one
        is a ``generate`` call of one prompt (``stop`` cannot interrupt it); ``HFRollout`` decodes in
        place, checking ``stop`` between steps."""
        return one_prompt_call(self, request)

    def sleep(self) -> None:  # noqa: B027 (a default, deliberately doing nothing)
        """Free what the rollout can while the trainer updates (its KV cache, copies of its weights; the
        weights themselves where ``RolloutCapabilities.sleep_frees_weights``) until ``wake_up()``.
        Meanwhile generation and weight updates raise ``RolloutError`` naming ``wake_up()``. The default
        frees nothing and refuses nothing (``RolloutCapabilities.sleep`` is false)."""

    def wake_up(self) -> None:  # noqa: B027
        """Undo ``sleep()``: the rollout generates again, with the weights it had (a backend may defer
        re-allocating its cache to the next generation). Waking a rollout that is awake does nothing."""

    def update_weights_from_buckets(self, buckets: Iterable[WeightBucket]) -> None:
        """Replace the model's weights with a stream of buckets (``verl_core.rollout.buckets``): every
        weight, full, Hugging Face names, packed by ``weight_buckets``. Each bucket is checked as it
        arrives (its checksum, its index after the last one's, no name twice); a corrupt bucket, a
        missing one, or a stream that ends before its final bucket raises ``RolloutError`` naming it, and
        leaves the rollout refusing to generate until a complete stream (or ``update_weights``) succeeds.

        The default feeds the checked tensors (views of each bucket, one bucket at a time) to
        ``update_weights``, whose own refusals then apply as well.
        """
        self.update_weights(unpack_buckets(buckets))


def unpacks_buckets_in_process(rollout: BaseRollout) -> bool:
    """Whether ``rollout`` takes bucket streams with ``BaseRollout``'s default, in the caller's process:
    then a sender in that process gives it the tensors themselves (``update_weights``), since the
    buckets would cross no transport, only copy and checksum every weight twice more."""
    return type(rollout).update_weights_from_buckets is BaseRollout.update_weights_from_buckets


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
