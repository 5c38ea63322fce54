"""Scoring a batch of responses with a reward function, and what a failing sample becomes.

``score_responses`` calls the function once per sample, ``fn(prompt, response, extra)``, and checks
what it returns: a number (a ``bool`` counts, ``True`` is 1.0), or a dict with a ``score`` key and
further numeric metrics, averaged over the batch. NaN, infinities and non-numbers are failures, like
an exception. A failure either stops the step (``on_error="fail"``: a ``RewardError`` naming the
reward function, the sample's index, its prompt and its response, and what it returned or raised,
chained) or scores the sample 0.0 and counts it (``on_error="zero"``; the first failure's message is
kept for the log). Lists in, lists out: the trainer turns the scores into tensors.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from verl_core.errors import RewardError
from verl_core.plugins.messages import short_repr

#: What a failing sample does: ``fail`` raises ``RewardError``; ``zero`` scores it 0.0 and counts it.
ON_ERROR: tuple[str, ...] = ("fail", "zero")
#: The key of a dict result that holds the score; every other key is a metric.
SCORE_KEY = "score"
#: Reward metrics appear among the step's metrics under this prefix (``reward/<metric>``).
METRIC_PREFIX = "reward/"
#: Prompts, responses and results are shortened to about this many characters in messages.
SHOWN_CHARS = 200


@attrs.frozen
class RewardScores:
    """A batch's scores: ``scores[i]`` is sample ``i``'s (0.0 for a failed one under ``on_error="zero"``).

    ``metrics`` holds the mean of each extra metric a dict result carried, over the samples that
    returned it; ``num_errors`` counts the failed samples and ``first_error`` is the first one's
    message (``None`` when none failed).
    """

    scores: list[float]
    metrics: dict[str, float] = attrs.Factory(dict)
    num_errors: int = 0
    first_error: str | None = None

    def step_metrics(self) -> dict[str, float]:
        """``metrics`` named as the step's metrics: ``reward/<metric>``."""
        return {f"{METRIC_PREFIX}{name}": value for name, value in self.metrics.items()}


def score_responses(
    function: Callable[[str, str, dict[str, Any]], Any],
    prompts: Sequence[str],
    responses: Sequence[str],
    extras: Sequence[Mapping[str, Any]],
    *,
    on_error: str = "fail",
    name: str | None = None,
) -> RewardScores:
    """Score sample ``i`` as ``function(prompts[i], responses[i], extras[i])``.

    ``name`` is how messages name the function (the ``reward.function`` value; default its
    ``__qualname__``). ``on_error`` is ``fail`` (raise ``RewardError`` for the first failing sample)
    or ``zero`` (score failing samples 0.0 and count them in ``num_errors``).
    """
    if on_error not in ON_ERROR:
        raise ValueError(
            f"on_error={on_error!r} is not a reward failure mode; use one of {', '.join(ON_ERROR)}"
        )
    if not len(prompts) == len(responses) == len(extras):
        raise ValueError(
            f"score_responses got {len(prompts)} prompts, {len(responses)} responses and {len(extras)} "
            "extras: pass one of each per sample"
        )
    name = name or getattr(function, "__qualname__", None) or repr(function)
    scores: list[float] = []
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    num_errors, first_error = 0, None
    for index, (prompt, response, extra) in enumerate(zip(prompts, responses, extras, strict=True)):
        try:
            score, metrics = _score_one(function, name, index, prompt, response, extra)
        except RewardError as error:
            if on_error == "fail":
                raise
            num_errors += 1
            first_error = first_error or str(error)
            score, metrics = 0.0, {}
        scores.append(score)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    means = {key: total / counts[key] for key, total in sums.items()}
    return RewardScores(scores, means, num_errors, first_error)


class _BadResult(Exception):
    """What is wrong with a reward function's return value (internal)."""


def _score_one(
    function: Callable[..., Any], name: str, index: int, prompt: str, response: str, extra: Any
) -> tuple[float, dict[str, float]]:
    """One sample's score and metrics, or a ``RewardError`` that names the sample."""
    try:
        returned = function(prompt, response, extra)
    except Exception as exc:
        what = f"raised {type(exc).__name__}: {exc}"
        raise RewardError(_failure(name, index, prompt, response, what)) from exc
    try:
        return _check_result(returned)
    except _BadResult as bad:
        what = (
            f"returned {short_repr(returned, SHOWN_CHARS)}, {bad}. A reward function returns a number, or "
            f"a dict with a '{SCORE_KEY}' key and further numeric metrics"
        )
        raise RewardError(_failure(name, index, prompt, response, what)) from None


def _failure(name: str, index: int, prompt: Any, response: Any, what: str) -> str:
    return (
        f"reward function '{name}' failed on sample {index}: {what}\n"
        f"  prompt: {shorten(prompt)}\n"
        f"  response: {shorten(response)}"
    )


def shorten(text: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(text)``, or for a longer text its first and last ``limit / 2`` characters around an
    ellipsis, and its length (the end of a response is where its answer is)."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r} ... {text[-half:]!r} ({len(text)} characters)"


def _check_result(returned: Any) -> tuple[float, dict[str, float]]:
    """``(score, metrics)`` from a reward function's result, or ``_BadResult`` saying what is wrong."""
    if not isinstance(returned, Mapping):
        return _number(returned, "which is"), {}
    if SCORE_KEY not in returned:
        keys = ", ".join(repr(key) for key in returned) or "none"
        raise _BadResult(f"a dict without a '{SCORE_KEY}' key (its keys: {keys})")
    metrics = {}
    for key, value in returned.items():
        if not isinstance(key, str) or not key:
            raise _BadResult(f"whose key {key!r} is not a metric name (a non-empty string)")
        if key != SCORE_KEY:
            metrics[key] = _number(value, f"whose '{key}' is")
    return _number(returned[SCORE_KEY], f"whose '{SCORE_KEY}' is"), metrics


def _number(value: Any, what: str) -> float:
    """``value`` as a finite float: a real number (``bool``, ``int``, ``float``, NumPy scalars) or a
    0-d array or tensor; anything else, NaN and infinities raise ``_BadResult``."""
    if isinstance(value, numbers.Real) or (
        getattr(value, "shape", None) == () and hasattr(value, "__float__")
    ):
        number = float(value)
    else:
        raise _BadResult(f"{what} a {type(value).__name__}, not a number")
    if not math.isfinite(number):
        raise _BadResult(f"{what} {number}, not a finite number")
    return number
