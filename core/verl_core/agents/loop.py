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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from verl_core.agents.environment import StepResult
from verl_core.agents.template import TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.data.batch import (
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    join_prompts_and_responses,
    left_pad,
)
from verl_core.errors import AgentError
from verl_core.rollout.base import SamplingParams
from verl_core.seeds import derive_seed

#: ``generate(prompts, sampling, seed) -> TensorDict``: a rollout's ``generate``, or the actor's.
Generate = Callable[[Sequence[Sequence[int]], SamplingParams, int], TensorDict]
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


class AgentLoop:
    """Runs conversations between a policy (``generate``) and one environment per prompt."""

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
        every real token; ``rollout_log_probs`` 0 on environment tokens) and the conversations."""
        from verl_core.agents.environment import make_environments

        environments = make_environments(self.environment_factory, self.config, rows)
        conversations = [
            Conversation(tuple(prompt), [dict(message) for message in prompt_messages])
            for prompt, prompt_messages in zip(prompts, messages, strict=True)
        ]
        for turn in range(self.config.max_turns):
            active = [i for i, c in enumerate(conversations) if not c.done]
            if not active:
                break
            room = max(self.response_length - len(conversations[i].response_ids) for i in active)
            if self.config.max_tokens_per_turn:
                room = min(room, self.config.max_tokens_per_turn)
            output = generate(
                [list(conversations[i].prompt_ids) + conversations[i].response_ids for i in active],
                attrs.evolve(sampling, max_new_tokens=room),
                derive_seed("agent-turn", seed, turn),
            )
            for position, index in enumerate(active):
                mask = output[RESPONSE_MASK][position].bool()
                generated = output[RESPONSES][position][mask].tolist()
                log_probs = output[ROLLOUT_LOG_PROBS][position][mask].tolist()
                self.take_turn(conversations[index], environments[index], generated, log_probs)
        return self.to_batch(conversations, sampling.pad_token_id), conversations

    def take_turn(
        self, conversation: Conversation, environment: Any, generated: list[int], log_probs: list[float]
    ) -> None:
        """Append the model's ``generated`` ids, then the environment's answer, or end the conversation."""
        left = self.response_length - len(conversation.response_ids)
        generated, log_probs = generated[:left], log_probs[:left]
        conversation.append(*self.model_turn(generated, log_probs), role="assistant")
        conversation.turns += 1
        stopped = self.template.closes_turn(generated) or self.template.ends_conversation(generated)
        # A turn cut by the budget is cut whatever the environment makes of it (a final answer cut short).
        budget_spent = len(conversation.response_ids) >= self.response_length and not stopped
        text = self.template.reply_text(generated)
        conversation.messages.append({"role": "assistant", "content": text})
        result = environment.step(text)
        if not isinstance(result, StepResult):
            raise AgentError(
                f"{type(environment).__name__}.step returned {type(result).__name__}, not a "
                "verl_core.agents.StepResult(observation, done, reward)"
            )
        conversation.reward = result.reward if result.reward is not None else conversation.reward
        over = result.done or not result.observation or self.template.ends_conversation(generated)
        if over or budget_spent or conversation.turns == self.config.max_turns:
            conversation.done = True
            if budget_spent:
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
        prompt_ids, prompt_mask = left_pad([list(c.prompt_ids) for c in conversations], pad_token_id)
        width = max([1, *(len(c.response_ids) for c in conversations)])
        responses = torch.full((len(conversations), width), pad_token_id, dtype=torch.int64)
        real = torch.zeros(len(conversations), width, dtype=torch.int64)
        model = torch.zeros_like(real)
        log_probs = torch.zeros(len(conversations), width)
        for row, conversation in enumerate(conversations):
            length = len(conversation.response_ids)
            responses[row, :length] = torch.tensor(conversation.response_ids, dtype=torch.int64)
            real[row, :length] = 1
            model[row, :length] = torch.tensor(conversation.model_mask, dtype=torch.int64)
            log_probs[row, :length] = torch.tensor(conversation.log_probs)
        batch = join_prompts_and_responses(
            prompt_ids, prompt_mask, responses, model, response_attention_mask=real
        )
        batch[ROLLOUT_LOG_PROBS] = log_probs
        return batch
