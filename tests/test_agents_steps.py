"""Environments step concurrently, in ``AgentLoop.run`` and ``run_requests`` alike: counted, never
timed (how many steps are inside ``step`` at once, against ``rollout.agent.environment_threads``).
A step that never returns ends the run with an error naming its conversation after
``rollout.agent.step_timeout_s``; the ``tools`` environment's own ``tool_timeout_s`` still answers a
tool that never returns (that key, not the step's, applies to it); an environment that raises is named
with its conversation; a failed conversation cancels the others' requests.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate

from verl_core.agents import AgentLoop, Conversation, StepResult, ToolEnvironment, TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.data.batch import RESPONSE_MASK
from verl_core.errors import AgentError
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.requests import FinishReason, RolloutResponse

TOKENIZER = build_chat_tokenizer()
TEMPLATE = TurnTemplate(TOKENIZER, [TOKENIZER.eos_token_id])
EOS = TOKENIZER.eos_token_id
SAMPLING = SamplingParams(max_new_tokens=1, eos_token_ids=(EOS,), pad_token_id=TOKENIZER.pad_token_id)
PATHS = ["run", "run_requests"]


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def replying(replies: list[list[int]]):
    """A ``submit`` answering turn ``k`` of every conversation with ``replies[k]`` (log-prob -id)."""
    turns: collections.Counter[str] = collections.Counter()

    async def submit(request, session):
        ids = replies[turns[session]]
        turns[session] += 1
        return RolloutResponse(request.request_id, ids, [-float(i) for i in ids], FinishReason.EOS)

    return submit


def run_loop(path: str, loop: AgentLoop, rows: list, replies: list[list[int]]):
    """``rows`` conversations from the one-token prompt ``[5]``, the model answering turn ``k`` of each
    with ``replies[k]``, through ``run`` (a batched generate) or ``run_requests``."""
    count = len(rows)
    if path == "run":
        generate = scripted_generate([replies] * count)
        return loop.run(generate, [[5]] * count, rows, [[]] * count, SAMPLING, 0)
    return asyncio.run(loop.run_requests(replying(replies), [[5]] * count, rows, [[]] * count, SAMPLING, 0))


class Counted:
    """Sleeps 50 ms in each step, counting how many steps are inside ``step`` at once; two turns."""

    lock = threading.Lock()
    inside = 0
    most = 0

    def reset(self, row) -> None:
        self.turns = 0

    def step(self, model_text: str) -> StepResult:
        with Counted.lock:
            Counted.inside += 1
            Counted.most = max(Counted.most, Counted.inside)
        time.sleep(0.05)
        with Counted.lock:
            Counted.inside -= 1
        self.turns += 1
        return StepResult(observation="ok", done=self.turns == 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threads", [1, 4])
def test_environments_step_at_once_up_to_the_threads_allowed(path, threads) -> None:
    Counted.inside = Counted.most = 0
    config = AgentConfig(max_turns=3, environment_threads=threads)
    loop = AgentLoop(TEMPLATE, lambda c: Counted(), config, response_length=100)
    batch, conversations = run_loop(path, loop, [None] * 8, [encode("x") + [EOS]] * 2)
    assert [c.turns for c in conversations] == [2] * 8 and Counted.inside == 0
    assert batch[RESPONSE_MASK].sum() == 2 * 2 * 8
    if threads == 1:
        assert Counted.most == 1
    else:
        assert 1 < Counted.most <= threads, Counted.most


class Stuck:
    """Conversation ``row == "stuck"``'s step waits until the test releases it; the others end at once."""

    release = threading.Event()

    def reset(self, row) -> None:
        self.row = row

    def step(self, model_text: str) -> StepResult:
        if self.row == "stuck":
            Stuck.release.wait(60)
        return StepResult(done=True)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_does_not_return_ends_the_run_naming_its_conversation(path) -> None:
    Stuck.release.clear()
    loop = AgentLoop(TEMPLATE, lambda c: Stuck(), AgentConfig(step_timeout_s=0.3), response_length=50)
    try:
        with pytest.raises(
            AgentError,
            match=r"Stuck\.step did not return within rollout\.agent\.step_timeout_s=0\.3 s, at turn 1 of "
            r"conversation 2 \(row 'stuck'\): make step return .* or raise the key",
        ):
            run_loop(path, loop, ["a", "b", "stuck"], [encode("x") + [EOS]])
    finally:
        Stuck.release.set()


class Raising:
    def reset(self, row) -> None:
        self.row = row

    def step(self, model_text: str):
        if self.row == "bad":
            raise ValueError("no such state")
        if self.row == "wrong":
            return {"observation": "ok"}
        return StepResult(done=True)


@pytest.mark.parametrize("path", PATHS)
def test_an_environment_that_raises_or_answers_wrongly_is_named_with_its_conversation(path) -> None:
    loop = AgentLoop(TEMPLATE, lambda c: Raising(), AgentConfig(), response_length=50)
    with pytest.raises(
        AgentError,
        match=r"Raising\.step raised ValueError: no such state, at turn 1 of conversation 1 \(row 'bad'\)",
    ) as raised:
        run_loop(path, loop, ["a", "bad"], [encode("x") + [EOS]])
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(
        AgentError, match=r"Raising\.step returned dict, not a verl_core\.agents\.StepResult.*conversation 0 "
    ):
        run_loop(path, loop, ["wrong", "a"], [encode("x") + [EOS]])


def test_take_turn_runs_one_turn_of_one_conversation_with_the_same_checks() -> None:
    loop = AgentLoop(TEMPLATE, lambda c: Raising(), AgentConfig(), response_length=50)
    good, bad = Raising(), Raising()
    good.reset("a")
    bad.reset("bad")
    conversation = Conversation((5,), [])
    loop.take_turn(conversation, good, encode("x") + [EOS], [-1.0, -2.0])
    assert conversation.done and conversation.turns == 1 and conversation.log_probs == [-1.0, -2.0]
    with pytest.raises(
        AgentError, match=r"Raising\.step raised ValueError: no such state, at turn 1 of a conv"
    ):
        loop.take_turn(Conversation((5,), []), bad, encode("x") + [EOS], [0.0, 0.0])


def call(name: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {}}) + "</tool_call>"


def test_a_tool_that_never_returns_is_answered_after_tool_timeout_s_in_every_conversation(tmp_path) -> None:
    """The tools environment keeps its own bound (tool_timeout_s, an error message the model reads),
    whatever step_timeout_s says; the conversations go on to their final answers."""
    tools = tmp_path / "slow_tools.py"
    tools.write_text("import time\n\ndef stuck():\n    time.sleep(3)\n")
    config = AgentConfig(environment="tools", tools=str(tools), tool_timeout_s=0.2, step_timeout_s=0.05)
    loop = AgentLoop(TEMPLATE, ToolEnvironment.from_config, config, response_length=200)
    _, conversations = run_loop("run_requests", loop, [None] * 4, [encode(call("stuck")) + [EOS], [EOS]])
    for conversation in conversations:
        assert [m["role"] for m in conversation.messages] == ["assistant", "tool", "assistant"]
        assert conversation.messages[1]["content"] == "error: stuck did not return within 0.2 s"
        assert conversation.done and conversation.cut is None


def test_a_failed_conversation_cancels_the_requests_of_the_others() -> None:
    """The error is raised as soon as it happens, with no request of the others left in flight (they
    would wait for ever here), in the caller's own event loop."""
    cancelled = []

    async def submit(request, session):
        if session != "0-0":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(session)
                raise
        return RolloutResponse(request.request_id, [EOS], [0.0], FinishReason.EOS)

    async def main():
        loop = AgentLoop(TEMPLATE, lambda c: Raising(), AgentConfig(), response_length=50)
        with pytest.raises(AgentError, match="conversation 0"):
            await loop.run_requests(submit, [[5]] * 3, ["bad", "a", "a"], [[]] * 3, SAMPLING, 0)
        return sorted(cancelled)

    assert asyncio.run(main()) == ["0-1", "0-2"]


def test_submit_must_return_whole_responses() -> None:
    loop = AgentLoop(TEMPLATE, lambda c: Raising(), AgentConfig(), response_length=50)

    async def aborted(request, session):
        return RolloutResponse(request.request_id, [7], [0.0], FinishReason.ABORTED)

    async def wrong(request, session):
        return [7]

    for submit, problem in ((aborted, "an aborted response: resume it"), (wrong, "a list, not a")):
        with pytest.raises(AgentError, match=rf"submit returned {problem}.* at turn 1 of conversation 0"):
            asyncio.run(loop.run_requests(submit, [[5]], ["a"], [[]], SAMPLING, 0))


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("rollout.agent.environment_threads=0", r"rollout\.agent\.environment_threads: must be > 0"),
        ("rollout.agent.step_timeout_s=0", r"rollout\.agent\.step_timeout_s: must be > 0"),
    ],
)
def test_the_bounds_are_refused_at_load_when_not_positive(override, problem) -> None:
    from verl_core.config import load_config
    from verl_core.errors import ConfigError

    base = [
        "actor.engine.backend=ddp",
        "actor.engine.model.path=x",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
    ]
    with pytest.raises(ConfigError, match=problem):
        load_config([], [*base, override])
