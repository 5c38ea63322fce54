"""Descriptors of core's built-in reward functions, by import string (nothing is imported here)."""

from __future__ import annotations

from verl_core.descriptors import RewardFunction

_BUILTIN = "verl_core.reward.builtin"
REWARD_FUNCTIONS: tuple[RewardFunction, ...] = (
    RewardFunction(
        name="exact_match",
        function=f"{_BUILTIN}:exact_match",
        description="1.0 if the stripped response equals the stripped ground_truth, else 0.0",
    ),
    RewardFunction(
        name="math_answer",
        function=f"{_BUILTIN}:math_answer",
        description="the last \\boxed{...} (else the last number) against ground_truth, numerically",
    ),
    RewardFunction(
        name="digits",
        function=f"{_BUILTIN}:digits",
        description="digit strings: share of positions matching ground_truth (length mismatch costs)",
    ),
)
