"""Request-level generation (rollout contract 2): one prompt in, its tokens and their log-probs out.

``BaseRollout.generate_request(RolloutRequest) -> RolloutResponse`` is a coroutine: an agent loop or an
asynchronous trainer keeps many requests in flight and awaits each one alone. ``abort(request_id)``
ends one early: it returns what it generated so far, with finish reason ``aborted``, and a later
request with ``resume_from=`` that response continues it (a partial rollout, picked up after a weight
update, say).

What a resumed request preserves: its response is the partial one followed by new tokens, as many
as ``sampling.max_new_tokens`` leaves (it counts the whole response), and the new tokens are drawn
from the same distribution an uninterrupted request draws them from, given the prompt and the
partial tokens (under the weights the rollout holds when it resumes). The partial tokens' log-probs
are kept as they were sampled. A resumed request draws from a seed derived from its own and the
number of tokens already generated (``resume_seed``): reusing the seed would replay the random
numbers the partial tokens were drawn with, which the tokens are not independent of. So seeded
sampling is reproducible per request, and a resumed response is distributed as an uninterrupted one,
but is not bit-identical to the response the request would have given without the abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs

from verl_core.descriptors import Choice
from verl_core.errors import RolloutError
from verl_core.rollout.params import SamplingParams
from verl_core.seeds import derive_seed


class FinishReason(Choice):
    """Why a response ended."""

    #: It sampled one of ``eos_token_ids``, which is its last token.
    EOS = "eos"
    #: It reached ``max_new_tokens`` without an EOS.
    LENGTH = "length"
    #: ``abort`` stopped it first.
    ABORTED = "aborted"


def _token_ids(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _check_token_ids(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(token, numbers.Integral) and not isinstance(token, bool) and token >= 0 for token in value
    ):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: expected token ids (ints >= 0), got {value!r:.80}"
        )


def _log_probs(value: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


@attrs.frozen
class RolloutResponse:
    """What one request generated: its ``token_ids`` (ending with the EOS token when one was sampled),
    the log-probability of each (``log_probs``, the distribution of ``BaseRollout.generate``'s
    ``rollout_log_probs``) and why it ended (``FinishReason``)."""

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids, validator=_check_token_ids)
    log_probs: tuple[float, ...] = attrs.field(converter=_log_probs)
    finish_reason: FinishReason = attrs.field(converter=FinishReason)

    def __attrs_post_init__(self) -> None:
        if len(self.log_probs) != len(self.token_ids):
            raise ValueError(
                f"RolloutResponse({self.request_id!r}): {len(self.token_ids)} token ids but "
                f"{len(self.log_probs)} log-probs: one log-prob per token"
            )
        if not all(math.isfinite(v) or v == -math.inf for v in self.log_probs):
            raise ValueError(f"RolloutResponse({self.request_id!r}): a log-prob is NaN or +inf")


def _new_request_id() -> str:
    return uuid.uuid4().hex


@attrs.frozen
class RolloutRequest:
    """One prompt to answer: its token ids, how to sample (``SamplingParams``) and from which ``seed``.

    ``request_id`` names it to ``abort`` (unique among the requests in flight; a fresh one by default).
    ``resume_from`` is a response to continue (one an abort returned): the new tokens follow its
    tokens, and ``sampling.max_new_tokens`` counts them all (see the module's docstring for what a
    resumed request preserves). A ``resume_from`` that already ended at an EOS or at
    ``max_new_tokens`` is returned as it is, with that finish reason.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_token_ids, validator=_check_token_ids)
    sampling: SamplingParams = attrs.field(validator=attrs.validators.instance_of(SamplingParams))
    seed: int = attrs.field(
        default=0,
        validator=lambda instance, attribute, value: _check_seed(value),
    )
    request_id: str = attrs.field(factory=_new_request_id, validator=attrs.validators.instance_of(str))
    resume_from: RolloutResponse | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(RolloutResponse))
    )

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(
                f"RolloutRequest({self.request_id!r}): an empty prompt; a prompt has a token at least"
            )
        if self.resume_from is not None:
            done = len(self.resume_from.token_ids)
            if done > self.sampling.max_new_tokens:
                raise ValueError(
                    f"RolloutRequest({self.request_id!r}): resume_from holds {done} tokens, more than "
                    f"sampling.max_new_tokens={self.sampling.max_new_tokens}, which counts the whole response"
                )

    @property
    def generated(self) -> tuple[int, ...]:
        """The tokens already generated (``resume_from``'s), empty for a fresh request."""
        return self.resume_from.token_ids if self.resume_from is not None else ()

    def finished(self) -> FinishReason | None:
        """How ``resume_from`` already ended (at an EOS, or at ``max_new_tokens``), or ``None`` when
        there is something left to generate."""
        tokens = self.generated
        if tokens and tokens[-1] in self.sampling.eos_token_ids:
            return FinishReason.EOS
        if len(tokens) >= self.sampling.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def continuation(self) -> tuple[list[int], SamplingParams, int]:
        """What is left to generate, as a fresh request would ask for it: the prompt followed by the
        tokens already generated, the sampling with ``max_new_tokens`` reduced by their number, and the
        seed to draw with (``resume_seed``)."""
        tokens = self.generated
        if not tokens:
            return list(self.prompt_ids), self.sampling, self.seed
        left = attrs.evolve(self.sampling, max_new_tokens=self.sampling.max_new_tokens - len(tokens))
        return [*self.prompt_ids, *tokens], left, resume_seed(self.seed, len(tokens))

    def joined(self, token_ids: list[int], log_probs: list[float], finish: FinishReason) -> RolloutResponse:
        """The response: ``resume_from``'s tokens and log-probs (if any) followed by the new ones."""
        before = self.resume_from
        return RolloutResponse(
            request_id=self.request_id,
            token_ids=(*(before.token_ids if before else ()), *token_ids),
            log_probs=(*(before.log_probs if before else ()), *log_probs),
            finish_reason=finish,
        )


def _check_seed(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"RolloutRequest.seed={value!r}: must be an int >= 0")


def resume_seed(seed: int, generated: int) -> int:
    """The seed a request with ``seed`` draws from once ``generated`` of its tokens exist: ``seed`` itself
    for a fresh request, otherwise one derived from both (``verl_core.seeds.derive_seed``), so that the
    random numbers the partial tokens came from are not replayed for the tokens after them."""
    return seed if generated == 0 else derive_seed("rollout.resume", seed, generated)


# -- BaseRollout's default: one request at a time, each a generate call of one prompt ---------------


@attrs.define
class _InFlight:
    """One request in flight: ``stop`` is set by ``abort`` for the thread that generates it, ``wake``
    for the request while it waits for its turn."""

    stop: threading.Event = attrs.field(factory=threading.Event)
    wake: asyncio.Event = attrs.field(factory=asyncio.Event)


@attrs.define
class _Turns:
    """The requests in flight on one rollout, served one at a time, first come first served."""

    in_flight: dict[str, _InFlight] = attrs.field(factory=dict)
    _lock: asyncio.Lock | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def lock(self) -> asyncio.Lock:
        # An asyncio lock belongs to one event loop: a rollout used from a later loop (another
        # asyncio.run) gets a new one; nothing can wait on the old loop's any more.
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:
            self._lock, self._loop = asyncio.Lock(), loop
        return self._lock


def _turns(rollout: Any) -> _Turns:
    # Kept on the instance without BaseRollout.__init__: a rollout may not call it.
    turns = rollout.__dict__.get("_request_turns")
    if turns is None:
        turns = rollout.__dict__["_request_turns"] = _Turns()
    return turns


@contextlib.asynccontextmanager
async def _turn(rollout: Any, request_id: str) -> AsyncIterator[threading.Event | None]:
    """Wait for the rollout's turn, then hold it: yields the request's stop event, or ``None`` when
    the request was aborted before its turn came."""
    turns = _turns(rollout)
    if request_id in turns.in_flight:
        raise RolloutError(
            f"generate_request: request_id {request_id!r} is already in flight: request ids must be unique "
            "among the requests in flight (leave it out for a fresh one)"
        )
    flight = turns.in_flight[request_id] = _InFlight()
    lock = turns.lock()
    acquire = asyncio.ensure_future(lock.acquire())
    woken = asyncio.ensure_future(flight.wake.wait())
    try:
        await asyncio.wait({acquire, woken}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        acquire.cancel()
        raise
    finally:
        woken.cancel()
        if not acquire.done():
            acquire.cancel()
    try:
        holds = acquire.done() and not acquire.cancelled()
        try:
            yield None if flight.stop.is_set() else flight.stop
        finally:
            if holds:
                lock.release()
    finally:
        del turns.in_flight[request_id]


async def serve_in_turn(rollout: Any, request: RolloutRequest) -> RolloutResponse:
    """``BaseRollout.generate_request``'s default: ``request`` in its turn, served by the rollout's
    ``_serve_request`` in a worker thread."""
    finished = request.finished()
    if finished is not None:
        return request.joined([], [], finished)
    async with _turn(rollout, request.request_id) as stop:
        if stop is None:
            return request.joined([], [], FinishReason.ABORTED)
        serving = asyncio.ensure_future(asyncio.to_thread(rollout._serve_request, request, stop))
        try:
            tokens, log_probs, finish = await asyncio.shield(serving)
        except asyncio.CancelledError:
            # A thread cannot be cancelled: the turn is held until it has stopped (asked to, between
            # decoding steps where the rollout can), so that the next request never overlaps it.
            stop.set()
            await asyncio.wait({serving})
            raise
    return request.joined(tokens, log_probs, finish)


def abort_in_turn(rollout: Any, request_id: str) -> None:
    """``BaseRollout.abort``'s default: flag the request, waiting or generating; ignore unknown ids."""
    flight = _turns(rollout).in_flight.get(request_id)
    if flight is not None:
        flight.stop.set()
        flight.wake.set()


def one_prompt_call(rollout: Any, request: RolloutRequest) -> tuple[list[int], list[float], FinishReason]:
    """``request``'s continuation as a ``generate`` call of one prompt: its new tokens, their log-probs
    and the finish reason."""
    from verl_core.data.batch import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS

    prompt, sampling, seed = request.continuation()
    output = rollout.generate([prompt], sampling, seed)
    mask = output[RESPONSE_MASK][0].to("cpu").bool()
    tokens = output[RESPONSES][0].to("cpu")[mask].tolist()
    log_probs = output[ROLLOUT_LOG_PROBS][0].to("cpu")[mask].tolist()
    return tokens, log_probs, finish_reason(tokens, sampling)


def finish_reason(tokens: list[int], sampling: SamplingParams, aborted: bool = False) -> FinishReason:
    """Why a response of ``tokens`` stopped: at an EOS (its last token), at ``max_new_tokens``, or
    before either because it was ``aborted``. A response that stopped short of both otherwise breaks
    the contract of ``generate``."""
    if tokens and tokens[-1] in sampling.eos_token_ids:
        return FinishReason.EOS
    if len(tokens) == sampling.max_new_tokens:
        return FinishReason.LENGTH
    if aborted:
        return FinishReason.ABORTED
    raise RolloutError(
        f"generate returned a response of {len(tokens)} tokens without an EOS id for max_new_tokens="
        f"{sampling.max_new_tokens}: a response stops at an EOS (which it keeps) or at max_new_tokens"
    )
