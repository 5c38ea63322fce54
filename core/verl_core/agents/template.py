"""The chat template, turn by turn: which token ids each appended message adds, never re-encoding
what the model generated.

A multi-turn rollout grows one token sequence: the prompt's ids, the ids the model sampled, the ids
of what the environment answers, the model's next ids, ... Decoding the model's ids and encoding
the text again is not the identity (a BPE tokenizer merges ``"a" "b"`` into ``"ab"``), and the
training engine would then score tokens the rollout never sampled. So the model's ids are kept as
sampled, and only the messages that are appended are rendered: the text the template adds for a
message is the rendering of the conversation with it minus the rendering without it, and only that
difference is encoded.

That needs an **append-only** template: rendering a longer conversation starts with the rendering
of the shorter one. ``TurnTemplate`` derives from the template, once, where an assistant turn
starts (the generation prompt) and how it ends (the tokens after the reply, such as ChatML's
``<|im_end|>\\n``), and refuses a template that rewrites earlier turns, naming what changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl_core.errors import AgentError

Message = Mapping[str, Any]

#: Stand-ins for a user's text and a reply while the template's turn boundary is derived.
_PROBE_USER = "Probe question 7"
_PROBE_REPLY = "Probe reply 9"


class TurnTemplate:
    """Token ids of appended messages and of the end of an assistant turn, for ``tokenizer``'s chat
    template; ``eos_token_ids`` are the tokens generation stops at.

    Raises ``AgentError`` when the template is not append-only around an assistant turn, or when the
    template does not end an assistant turn with one of ``eos_token_ids`` (the model could never
    close its turn the way the template renders it).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        if getattr(tokenizer, "chat_template", None) is None:
            raise AgentError(
                "multi-turn rollouts render each appended message with the tokenizer's chat template, but "
                "the tokenizer has none: use a tokenizer with a chat template (an instruct model's)"
            )
        question = [{"role": "user", "content": _PROBE_USER}]
        prompt = self.render(question, add_generation_prompt=True)
        answered = self.render([*question, {"role": "assistant", "content": _PROBE_REPLY}])
        if not answered.startswith(prompt):
            raise AgentError(
                "the chat template is not append-only: a conversation rendered with the generation prompt "
                f"({prompt[-40:]!r} at its end) is not the beginning of the same conversation with the "
                f"assistant's reply ({answered[-60:]!r}); multi-turn rollouts need a template that only "
                "appends (for reasoning models, one that keeps earlier turns' reasoning)"
            )
        reply = answered[len(prompt) :]
        if not reply.startswith(_PROBE_REPLY):
            raise AgentError(
                f"the chat template writes {reply[: reply.find(_PROBE_REPLY)]!r} between the generation "
                "prompt and the assistant's reply, which the model never generates: multi-turn rollouts "
                "need a template whose generation prompt is everything before the reply"
            )
        #: What the template writes after an assistant's reply (ChatML: ``<|im_end|>\n``).
        self.end_of_turn_text = reply[len(_PROBE_REPLY) :]
        self.end_of_turn_ids = self.encode(self.end_of_turn_text)
        if not self.end_of_turn_ids or self.end_of_turn_ids[0] not in self.eos_token_ids:
            raise AgentError(
                f"the chat template ends an assistant turn with {self.end_of_turn_text!r} (ids "
                f"{self.end_of_turn_ids}), which does not start with a token generation stops at "
                f"{list(self.eos_token_ids)}: the model could not close its turn as the template renders "
                "it. Make the tokenizer's eos_token the template's end-of-turn token"
            )

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise AgentError(
                f"the tokenizer's apply_chat_template(tokenize=False) returned a {type(text).__name__}, "
                "not the rendered text"
            )
        return text

    def encode(self, text: str) -> list[int]:
        return [int(token) for token in self.tokenizer.encode(text, add_special_tokens=False)]

    # -- the turn boundary --------------------------------------------------------------------------

    def closing_ids(self, generated: Sequence[int]) -> list[int]:
        """The ids that close an assistant turn after the model's ``generated`` ids: what the template
        writes after the end-of-turn token when the model sampled it, all of it when the turn was cut
        short (no end-of-turn token)."""
        if generated and generated[-1] == self.end_of_turn_ids[0]:
            return self.end_of_turn_ids[1:]
        return list(self.end_of_turn_ids)

    def ends_conversation(self, generated: Sequence[int]) -> bool:
        """Whether the model stopped at an EOS token that is not the template's end of turn (the
        end of the whole text, such as ``<|endoftext|>``): the conversation is over."""
        return bool(generated) and generated[-1] in self.eos_token_ids and not self.closes_turn(generated)

    def closes_turn(self, generated: Sequence[int]) -> bool:
        return bool(generated) and generated[-1] == self.end_of_turn_ids[0]

    def reply_text(self, generated: Sequence[int]) -> str:
        """The assistant message's content: the generated ids decoded, the end-of-turn token left out
        (the template writes it). Only for rendering later messages and for logs, never re-encoded."""
        ids = list(generated[:-1]) if self.closes_turn(generated) else list(generated)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def message_ids(self, conversation: Sequence[Message], message: Message, *, last: bool) -> list[int]:
        """The ids the template adds for ``message`` after ``conversation`` (which ends with a closed
        turn), followed by the generation prompt of the next assistant turn when ``last``."""
        before = self.render(conversation)
        after = self.render([*conversation, message], add_generation_prompt=last)
        if not after.startswith(before):
            raise AgentError(
                f"the chat template is not append-only: appending a {message.get('role')!r} message "
                f"changes the text before it (rendered without it, the conversation ends "
                f"{before[-60:]!r}; with it, that part reads {after[: len(before)][-60:]!r}); multi-turn "
                "rollouts need a template that only appends"
            )
        return self.encode(after[len(before) :])
