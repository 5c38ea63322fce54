"""The agent loop: multi-turn rollouts, token in / token out.

Every conversation is one growing token sequence. A turn generates from the whole sequence so far
(prompt, earlier replies, environment messages) with any rollout's ``generate``; the sampled ids
are appended as they are, with their log-probs, and marked as the model's (``response_mask`` 1).
The environment then answers the reply's text; what it returns is appended as the ids the chat
template adds for each message (``TurnTemplate.message_ids``), marked as the environment's
(``response_mask`` 0, no log-prob). Decoded text is only ever shown to the environment and the
template, never encoded back into the sequence, so the training engine scores exactly the tokens
the rollout sampled.

The response of a conversation is everything after the prompt, model and environment tokens
together, at most ``rollout.response_length`` tokens: a turn generates at most what is left of it
(and at most ``max_tokens_per_turn``); an environment message that does not fit ends the
conversation, dropped or truncated to what fits (``on_overflow``). A conversation also ends when the
environment says so, after ``max_turns`` model turns, or when the model stops at an EOS token that
is not the template's end of turn.

Two ways to run a batch of conversations, with the same result contract: ``run`` turn by turn, one
batched ``generate`` call per turn for the conversations still going (the trainer's colocated
rollout), and ``run_requests``, where each conversation is a coroutine of its own that sends its turns
as requests (rollout contract 2's ``generate_request``) and never waits for another conversation.
Either way the environments step concurrently (``verl_core.agents.steps``: threads, at most
``environment_threads`` at once, each within ``step_timeout_s``); each conversation has its
environment, so the results do not depend on the order the steps end in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
from tensordict import TensorDict

from verl_core.agents.environment import StepResult, close_environments
from verl_core.agents.steps import EnvironmentSteps, gather_all
from verl_core.agents.template import TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.data.batch import (
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    responses_batch,
)
from verl_core.errors import AgentError
from verl_core.rollout.params import SamplingParams
from verl_core.rollout.requests import FinishReason, RolloutRequest, RolloutResponse
from verl_core.seeds import derive_seed

#: ``generate(prompts, sampling, seed) -> TensorDict``: a rollout's ``generate``, or the actor's.
Generate = Callable[[Sequence[Sequence[int]], SamplingParams, int], TensorDict]
#: ``submit(request, session) -> RolloutResponse``: a rollout's ``generate_request`` (contract 2), told the
#: conversation's session key too (a client of several replicas keeps a session on one replica, whose
#: prefix cache then serves its turns); one rollout ignores it: ``lambda request, session:
#: rollout.generate_request(request)``.
Submit = Callable[[RolloutRequest, str], Awaitable[RolloutResponse]]
#: ``Conversation.cut`` when ``rollout.agent.max_turns`` ended a conversation the environment went on with.
CUT_MAX_TURNS = "max_turns"
#: ``Conversation.cut`` when ``rollout.response_length``, the response budget, ended a conversation.
CUT_RESPONSE_LENGTH = "response_length"


@attrs.define
class Conversation:
    """One multi-turn rollout as it grows: the ``messages`` (the prompt's, then each turn's, for the
    template and for logs), the response's ids, which of them the model produced, their log-probs,
    ``spans`` (``(start, end, role)`` of each turn in the response), the environment's reward, and
    ``cut``: what ended it before the model or the environment did (``CUT_MAX_TURNS``: the environment
    answered the last turn ``max_turns`` allows; ``CUT_RESPONSE_LENGTH``: the model's turn filled the
    response budget before it stopped, or the environment's message did not fit in it), else ``None``."""

    prompt_ids: tuple[int, ...]
    messages: list[dict[str, Any]]
    response_ids: list[int] = attrs.Factory(list)
    model_mask: list[int] = attrs.Factory(list)
    log_probs: list[float] = attrs.Factory(list)
    spans: list[tuple[int, int, str]] = attrs.Factory(list)
    turns: int = 0
    done: bool = False
    reward: float | None = None
    cut: str | None = None

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None = None, *, role: str) -> None:
        """Append a turn's ids: the model's (``role`` ``assistant``, with their log-probs) or the
        environment's (no log-probs, masked out)."""
        start = len(self.response_ids)
        self.response_ids += list(ids)
        from_model = role == "assistant"
        self.model_mask += [int(from_model)] * len(ids)
        self.log_probs += list(log_probs) if from_model else [0.0] * len(ids)
        if ids:
            self.spans.append((start, len(self.response_ids), role))


@attrs.frozen
class Reply:
    """A model turn as appended (``AgentLoop._reply``), for the environment's answer: the sampled ids
    kept, their text (what the environment steps on) and whether they spent the response budget."""

    generated: list[int]
    text: str
    budget_spent: bool


class AgentLoop:
    """Runs conversations between a policy (``generate``, or ``submit``) and one environment per prompt."""

    def __init__(
        self,
        template: TurnTemplate,
        environment_factory: Callable[[AgentConfig], Any],
        config: AgentConfig,
        response_length: int,
    ):
        self.template = template
        self.environment_factory = environment_factory
        self.config = config
        self.response_length = response_length

    def run(
        self,
        generate: Generate,
        prompts: Sequence[Sequence[int]],
        rows: Sequence[Any],
        messages: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingParams,
        seed: int,
    ) -> tuple[TensorDict, list[Conversation]]:
        """One conversation per prompt (``rows[i]`` resets its environment, ``messages[i]`` are its
        prompt's messages, what the template renders before the first reply); the batch contract of
        ``verl_core.data.batch`` (``response_mask`` 1 on model tokens only; ``attention_mask`` 1 on
        every real token; ``rollout_log_probs`` 0 on environment tokens) and the conversations.

        Turn by turn: one ``generate`` call per turn for the conversations still going (seeded by the
        turn), then their environments' steps at once."""
        environments = self.environments(rows)
        conversations = self._conversations(prompts, messages)
        steps = EnvironmentSteps(self.config.environment_threads, self.config.step_timeout_s)
        try:
            self._turns(generate, environments, conversations, rows, steps, sampling, seed)
            self._score_cut(environments, conversations, rows)
        finally:
            close_environments(environments)
        return self.to_batch(conversations, sampling.pad_token_id), conversations

    def _turns(
        self,
        generate: Generate,
        environments: list[Any],
        conversations: list[Conversation],
        rows: Sequence[Any],
        steps: EnvironmentSteps,
        sampling: SamplingParams,
        seed: int,
    ) -> None:
        """``run``'s turns: one ``generate`` call for the conversations still going, then their steps."""
        for turn in range(self.config.max_turns):
            active = [i for i, c in enumerate(conversations) if not c.done]
            if not active:
                break
            room = self._turn_room(
                max(self.response_length - len(conversations[i].response_ids) for i in active)
            )
            output = generate(
                [list(conversations[i].prompt_ids) + conversations[i].response_ids for i in active],
                attrs.evolve(sampling, max_new_tokens=room),
                derive_seed("agent-turn", seed, turn),
            )
            replies = []
            for position, index in enumerate(active):
                mask = output[RESPONSE_MASK][position].bool()
                generated = output[RESPONSES][position][mask].tolist()
                log_probs = output[ROLLOUT_LOG_PROBS][position][mask].tolist()
                replies.append(self._reply(conversations[index], generated, log_probs))
            results = steps.step_all(
                [
                    (environments[index], reply.text, self._where(index, rows[index], turn))
                    for index, reply in zip(active, replies, strict=True)
                ]
            )
            for index, reply, result in zip(active, replies, results, strict=True):
                self._answer(conversations[index], reply, result)

    async def run_requests(
        self,
        submit: Submit,
        prompts: Sequence[Sequence[int]],
        rows: Sequence[Any],
        messages: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingParams,
        seed: int,
    ) -> tuple[TensorDict, list[Conversation]]:
        """``run``'s conversations and result, each conversation a coroutine of its own: it sends each
        turn as a ``RolloutRequest`` to ``submit`` (the prompt and the response so far; at most what is
        left of the response budget, and of ``max_tokens_per_turn``; a seed derived from ``seed``, the
        conversation's index and the turn, so that the results do not depend on which request is served
        first), then waits for its environment's step, and never for another conversation. Its session
        key is ``f"{seed}-{index}"``.

        ``submit`` returns each request's whole response: one aborted (finish ``aborted``, at a weight
        sync) is resumed there (``RolloutRequest(resume_from=...)``), and refused here. On the first
        error the other conversations' requests are cancelled."""
        environments = self.environments(rows)
        conversations = self._conversations(prompts, messages)
        steps = EnvironmentSteps(self.config.environment_threads, self.config.step_timeout_s)
        try:
            await gather_all(
                [
                    self._converse(submit, index, conversation, environment, row, sampling, seed, steps)
                    for index, (conversation, environment, row) in enumerate(
                        zip(conversations, environments, rows, strict=True)
                    )
                ]
            )
            self._score_cut(environments, conversations, rows)
        finally:
            close_environments(environments)
        return self.to_batch(conversations, sampling.pad_token_id), conversations

    async def _converse(
        self,
        submit: Submit,
        index: int,
        conversation: Conversation,
        environment: Any,
        row: Any,
        sampling: SamplingParams,
        seed: int,
        steps: EnvironmentSteps,
    ) -> None:
        """Conversation ``index`` of ``run_requests``, to its end."""
        session = f"{seed}-{index}"
        while not conversation.done:
            turn = conversation.turns
            request = RolloutRequest(
                prompt_ids=(*conversation.prompt_ids, *conversation.response_ids),
                sampling=attrs.evolve(
                    sampling,
                    max_new_tokens=self._turn_room(self.response_length - len(conversation.response_ids)),
                ),
                seed=derive_seed("agent-request", seed, index, turn),
            )
            response = await submit(request, session)
            where = self._where(index, row, turn)
            if not isinstance(response, RolloutResponse) or response.finish_reason == FinishReason.ABORTED:
                problem = (
                    "an aborted response: resume it in submit (RolloutRequest(resume_from=...)) and return it whole"
                    if isinstance(response, RolloutResponse)
                    else f"a {type(response).__name__}, not a verl_core.rollout.RolloutResponse"
                )
                raise AgentError(f"submit returned {problem}, at {where}")
            reply = self._reply(conversation, list(response.token_ids), list(response.log_probs))
            self._answer(conversation, reply, await steps.step(environment, reply.text, where))

    def take_turn(
        self, conversation: Conversation, environment: Any, generated: list[int], log_probs: list[float]
    ) -> None:
        """Append the model's ``generated`` ids, then the environment's answer (its step run as ``run``
        runs it), or end the conversation."""
        reply = self._reply(conversation, generated, log_probs)
        steps = EnvironmentSteps(1, self.config.step_timeout_s)
        (result,) = steps.step_all(
            [(environment, reply.text, f"turn {conversation.turns} of a conversation")]
        )
        self._answer(conversation, reply, result)

    def _score_cut(
        self, environments: list[Any], conversations: list[Conversation], rows: Sequence[Any]
    ) -> None:
        """The reward of each conversation the loop cut, from its environment's ``on_cut`` (where it has
        one, and returns a reward)."""
        for index, (environment, conversation) in enumerate(zip(environments, conversations, strict=True)):
            on_cut = getattr(environment, "on_cut", None)
            if conversation.cut is None or not callable(on_cut):
                continue
            try:
                reward = on_cut(conversation.cut)
            except Exception as error:
                where = self._where(index, rows[index], conversation.turns - 1)
                raise AgentError(
                    f"{type(environment).__name__}.on_cut raised {type(error).__name__}: {error}, at {where}"
                ) from error
            if reward is not None:
                conversation.reward = float(reward)

    def environments(self, rows: Sequence[Any]) -> list[Any]:
        """One environment per conversation, ``reset`` to its row (tests/test_agents_loop.py keeps a
        variant that shares one between conversations, and catches it)."""
        from verl_core.agents.environment import make_environments

        return make_environments(self.environment_factory, self.config, rows)

    @staticmethod
    def _conversations(
        prompts: Sequence[Sequence[int]], messages: Sequence[Sequence[dict[str, Any]]]
    ) -> list[Conversation]:
        return [
            Conversation(tuple(prompt), [dict(message) for message in prompt_messages])
            for prompt, prompt_messages in zip(prompts, messages, strict=True)
        ]

    def _turn_room(self, left: int) -> int:
        """The tokens a turn may generate when ``left`` remain of the response budget."""
        per_turn = self.config.max_tokens_per_turn
        return min(left, per_turn) if per_turn else left

    @staticmethod
    def _where(index: int, row: Any, turn: int) -> str:
        """A conversation's turn, for errors: its index in the batch and its prompt (or row)."""
        prompt = getattr(row, "prompt_text", None)
        shown = f"prompt {prompt!r:.80}" if isinstance(prompt, str) else f"row {row!r:.80}"
        return f"turn {turn + 1} of conversation {index} ({shown})"

    def _reply(self, conversation: Conversation, generated: list[int], log_probs: list[float]) -> Reply:
        """Append the model's ``generated`` ids, within the response budget, and its message."""
        left = self.response_length - len(conversation.response_ids)
        generated, log_probs = generated[:left], log_probs[:left]
        conversation.append(*self.model_turn(generated, log_probs), role="assistant")
        conversation.turns += 1
        stopped = self.template.closes_turn(generated) or self.template.ends_conversation(generated)
        # A turn cut by the budget is cut whatever the environment makes of it (a final answer cut short).
        budget_spent = len(conversation.response_ids) >= self.response_length and not stopped
        text = self.template.reply_text(generated)
        conversation.messages.append({"role": "assistant", "content": text})
        return Reply(generated, text, budget_spent)

    def _answer(self, conversation: Conversation, reply: Reply, result: StepResult) -> None:
        """Append the environment's answer (``result``) to ``reply``, or end the conversation."""
        generated = reply.generated
        conversation.reward = result.reward if result.reward is not None else conversation.reward
        over = result.done or not result.observation or self.template.ends_conversation(generated)
        if over or reply.budget_spent or conversation.turns == self.config.max_turns:
            conversation.done = True
            if reply.budget_spent:
                conversation.cut = CUT_RESPONSE_LENGTH
            elif not over:
                conversation.cut = CUT_MAX_TURNS
            return
        observation = list(result.observation)
        context = list(conversation.messages)
        ids = [self.template.closing_ids(generated)]
        for number, message in enumerate(observation):
            ids.append(self.template.message_ids(context, message, last=number == len(observation) - 1))
            context.append(message)
        if self.append_environment(conversation, ids, [m["role"] for m in observation]):
            conversation.messages = context

    def model_turn(self, generated: list[int], log_probs: list[float]) -> tuple[list[int], list[float]]:
        """The ids a model turn adds to the sequence and their log-probs: exactly the sampled ones
        (tests/test_agents_loop.py keeps a variant that re-encodes the decoded text, and catches it)."""
        return generated, log_probs

    def append_environment(
        self, conversation: Conversation, parts: list[list[int]], roles: list[str]
    ) -> bool:
        """Append the turn's closing ids and each message's ids, within the response budget; whether
        the messages were appended (``on_overflow: end`` drops what does not fit)."""
        left = self.response_length - len(conversation.response_ids)
        total = sum(len(part) for part in parts)
        # After the environment's message the model needs room for at least one token.
        if total >= left:
            conversation.done = True
            conversation.cut = CUT_RESPONSE_LENGTH
            if self.config.on_overflow == "end":
                return False
        for part, role in zip(parts, ["template", *roles], strict=True):
            room = self.response_length - len(conversation.response_ids)
            conversation.append(part[:room], role=role)
        return True

    def to_batch(self, conversations: Sequence[Conversation], pad_token_id: int) -> TensorDict:
        return responses_batch(
            [conversation.prompt_ids for conversation in conversations],
            [conversation.response_ids for conversation in conversations],
            [conversation.log_probs for conversation in conversations],
            pad_token_id,
            model_masks=[conversation.model_mask for conversation in conversations],
        )
