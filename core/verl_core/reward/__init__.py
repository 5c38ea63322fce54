"""Rewards: rule-based reward functions, loading one by name or from a user's file, scoring a batch.

A reward function is ``score(prompt: str, response: str, extra: dict) -> float | dict[str, float]``
(docs/rewards.md). ``reward.function`` selects one: a name that a plugin registers through the hook
``verl_reward_functions`` (core's built-ins ``exact_match``, ``math_answer``, ``digits`` come through
the same hook, ``verl_core.reward.catalog``), or ``path/to/file.py:function_name``.
``load_reward_function`` resolves either; ``score_responses`` scores a batch and names the sample
that fails. Pure Python, lists in and lists out: nothing here imports torch.
"""

from verl_core.reward.builtin import digits, exact_match, math_answer
from verl_core.reward.loading import load_reward_function
from verl_core.reward.scoring import RewardScores, score_responses

__all__ = [
    "RewardScores",
    "digits",
    "exact_match",
    "load_reward_function",
    "math_answer",
    "score_responses",
]
