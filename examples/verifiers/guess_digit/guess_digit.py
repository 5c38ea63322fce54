"""A small verifiers environment, for the ``verifiers`` environment (docs/agents.md, 'Environments of
verifiers'): the model guesses a secret digit and is told ``higher`` or ``lower`` until it finds it.

It is a verifiers environment module as the Environments Hub's are: ``load_environment(**env_args)``
returns a ``vf.Environment`` (here a ``MultiTurnEnv``) with its datasets and its rubric. Installed
(``pip install -e examples/verifiers/guess_digit``), or with this folder on ``PYTHONPATH``,
``verifiers.load_environment("guess-digit")`` imports it. The rubric scores a conversation 1 when the
model found the digit, less for each guess it took (``1 / guesses``), 0 when it did not find it.
"""

import re

import verifiers as vf
from datasets import Dataset

PROMPT = "guess my digit"
SYSTEM_PROMPT = "Guess the secret digit (0 to 9): answer with one digit; I say higher or lower."


class GuessDigitEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = _guess(messages[-1])
        secret = int(state["answer"])
        state["guesses"] = state.get("guesses", 0) + 1
        if guess == secret:
            state["found"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        if guess is None:
            return [vf.UserMessage(content="answer with one digit")]
        return [vf.UserMessage(content="higher" if guess < secret else "lower")]

    @vf.stop
    async def found(self, state: vf.State) -> bool:
        return state.get("found", False)


def _guess(message) -> int | None:
    content = message["content"] if isinstance(message, dict) else message.content
    digits = re.findall(r"\d", content or "")
    return int(digits[0]) if digits else None


def found_reward(state: vf.State) -> float:
    """1 / guesses when the model found the digit, else 0."""
    return 1.0 / state["guesses"] if state.get("found") else 0.0


def load_environment(
    rows: int = 40, max_turns: int = 4, seed: int = 0, system_prompt: str | None = SYSTEM_PROMPT
) -> vf.Environment:
    """``rows`` games (the secrets spread over the digits from ``seed``), ``max_turns`` guesses each;
    the eval dataset is one game per digit."""
    secrets = [(seed + 7 * index) % 10 for index in range(rows)]
    return GuessDigitEnv(
        dataset=_games(secrets),
        eval_dataset=_games(range(10)),
        system_prompt=system_prompt,
        rubric=vf.Rubric(funcs=[found_reward]),
        max_turns=max_turns,
    )


def _games(secrets) -> Dataset:
    return Dataset.from_list([{"question": PROMPT, "answer": str(secret)} for secret in secrets])
