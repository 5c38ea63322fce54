"""Core's built-in reward functions: exact match, math answers, digit strings.

Each follows the reward-function contract (docs/rewards.md), ``fn(prompt, response, extra)``, and is
registered by name through ``verl_core.reward.catalog``. The reference answer is the dataset
column ``ground_truth`` (``extra["ground_truth"]``, or verl's nested
``extra["reward_model"]["ground_truth"]``); a row without one raises ``RewardError`` naming the
columns it has. The math answer extractor (``extract_boxed``, ``extract_answer``, ``parse_number``,
``answers_match``) is public, for reward functions that build on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from verl_core.errors import RewardError

#: The dataset column holding the reference answer.
GROUND_TRUTH = "ground_truth"
#: verl's datasets nest the reference answer as ``reward_model: {ground_truth: ...}``.
NESTED_GROUND_TRUTH = "reward_model"
#: Relative tolerance of ``math_answer``'s numeric comparison.
MATH_REL_TOL = 1e-6

# ``\boxed{`` (spaces allowed before the brace); the content is read with balanced braces.
_BOXED = re.compile(r"\\boxed\s*\{")
# A number in running text: a simple fraction ``a/b``, an integer or decimal (thousands separators
# ``1,234`` allowed), ``.5``, or ``\frac{a}{b}``; a leading ``-`` is a sign unless it follows a word
# character (``3-4`` is a range, not ``-4``). Numbers glued to a word (``x2``, ``v1.2``) are skipped.
_NUMBER_IN_TEXT = re.compile(
    r"-?\\[dt]?frac\{\d+\}\{\d+\}"
    r"|(?<![\w.])-?(?:\d+/\d+(?!\.?\d)|(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)
# The forms ``parse_number`` accepts, whole (after ``_normalise``).
_DECIMAL = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_FRACTION = re.compile(r"([-+]?\d+)/(\d+)")
_LATEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\{([-+]?\d+)\}\{(\d+)\}")
_DIGITS = re.compile(r"[0-9]+")
_LEADING_DIGITS = re.compile(r"\s*([0-9]*)")


def ground_truth(extra: Mapping[str, Any], function: str) -> Any:
    """The row's reference answer: ``extra["ground_truth"]``, else ``extra["reward_model"]["ground_truth"]``.

    Raises ``RewardError`` naming ``function``, the missing key and the columns the row has.
    """
    if extra.get(GROUND_TRUTH) is not None:
        return extra[GROUND_TRUTH]
    nested = extra.get(NESTED_GROUND_TRUTH)
    if isinstance(nested, Mapping) and nested.get(GROUND_TRUTH) is not None:
        return nested[GROUND_TRUTH]
    columns = ", ".join(sorted(str(column) for column in extra)) or "none"
    problem = "is None" if GROUND_TRUTH in extra else "is missing"
    raise RewardError(
        f"reward function '{function}' needs the dataset column '{GROUND_TRUTH}', which {problem}; the "
        f"row's columns are: {columns}. Add a '{GROUND_TRUTH}' column to the dataset (or "
        f"'{NESTED_GROUND_TRUTH}': {{'{GROUND_TRUTH}': ...}}, as verl's datasets have), or select a reward "
        "function that needs none"
    )


# -- exact_match ---------------------------------------------------------------------------------


def exact_match(prompt: str, response: str, extra: Mapping[str, Any]) -> float:
    """1.0 if the response, stripped, equals ``str(ground_truth)``, stripped; else 0.0."""
    truth = str(ground_truth(extra, "exact_match"))
    return 1.0 if response.strip() == truth.strip() else 0.0


# -- math_answer ---------------------------------------------------------------------------------


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` in ``text``, or ``None``.

    Braces are balanced (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); escaped braces ``\\{``
    and ``\\}`` do not count. A ``\\boxed{`` that is never closed is skipped for an earlier one.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth, position = 1, match.end()
        while position < len(text):
            char = text[position]
            if char == "\\":  # an escaped character (``\{``, ``\}``, ``\\``) or a command
                position += 2
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : position]
            position += 1
    return None


def extract_answer(text: str) -> str | None:
    """The answer in a response: the last ``\\boxed{...}``'s content, else the last number in it.

    Numbers are integers, decimals (``3.14``, ``.5``), negatives, with thousands separators
    (``1,234``), simple fractions (``3/4``) and ``\\frac{3}{4}``; ``None`` when there is neither.
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str:
    """Without whitespace and without surrounding ``$``: how answers are compared as strings."""
    return "".join(text.split()).strip("$")


def parse_number(text: str) -> float | None:
    """``text`` as a number (the forms of ``extract_answer``, ``$``-wrapped or spaced), else ``None``."""
    text = _normalise(text)
    if _DECIMAL.fullmatch(text):
        return float(text.replace(",", ""))
    if match := _FRACTION.fullmatch(text):
        numerator, denominator = int(match[1]), int(match[2])
    elif match := _LATEX_FRACTION.fullmatch(text):
        numerator, denominator = int(match[2]), int(match[3])
        numerator = -numerator if match[1] == "-" else numerator
    else:
        return None
    return numerator / denominator if denominator else None


def answers_match(answer: str, truth: str) -> bool:
    """Numerically (relative tolerance ``MATH_REL_TOL``) when both parse as numbers, else as
    normalised strings (whitespace and surrounding ``$`` removed)."""
    answer_number, truth_number = parse_number(answer), parse_number(truth)
    if answer_number is not None and truth_number is not None:
        return math.isclose(answer_number, truth_number, rel_tol=MATH_REL_TOL)
    return _normalise(answer) == _normalise(truth)


def math_answer(prompt: str, response: str, extra: Mapping[str, Any]) -> dict[str, float]:
    """1.0 if the response's answer (``extract_answer``) matches ``ground_truth`` (``answers_match``).

    The metric ``answer_found`` is 1.0 when the response has an answer at all (a ``\\boxed{...}``
    or a number), so that a format problem shows apart from wrong answers.
    """
    truth = str(ground_truth(extra, "math_answer"))
    answer = extract_answer(response)
    if answer is None:
        return {"score": 0.0, "answer_found": 0.0}
    return {"score": 1.0 if answers_match(answer, truth) else 0.0, "answer_found": 1.0}


# -- digits --------------------------------------------------------------------------------------


def digits(prompt: str, response: str, extra: Mapping[str, Any]) -> dict[str, float]:
    """The demo tasks' scorer: ``ground_truth`` is a digit string (``"321"``, the reversal of ``123``).

    The answer is the response's leading digits (after leading whitespace, up to the first other
    character). The score is the number of positions ``i`` where ``answer[i] == truth[i]`` divided by
    ``max(len(answer), len(truth))``: 1.0 exactly for the right answer, partial credit for right
    digits in the right places, and a wrong length costs. ``exact`` is 1.0 for the right answer.
    """
    truth = str(ground_truth(extra, "digits")).strip()
    if not _DIGITS.fullmatch(truth):
        raise RewardError(
            f"reward function 'digits' needs a '{GROUND_TRUTH}' of the digits 0-9, got {truth!r}: "
            "use it for tasks whose answers are digit strings, or select another reward function"
        )
    answer = _LEADING_DIGITS.match(response)[1]
    matching = sum(a == b for a, b in zip(answer, truth, strict=False))
    return {"score": matching / max(len(answer), len(truth)), "exact": 1.0 if answer == truth else 0.0}
