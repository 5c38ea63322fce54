"""The text a prompt becomes and its token ids: a string as it is, or a list of chat messages (or a
string, as one user message) rendered with the tokenizer's chat template; tokenized in batched calls.

The tokenizer is anything with the Hugging Face tokenizer API (``__call__``, ``apply_chat_template``).
Errors are ``DataError`` s naming the row and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl_core.data.files import row_location
from verl_core.errors import DataError

#: The config key that turns the chat template on, as messages name it.
CHAT_TEMPLATE_KEY = "data.apply_chat_template"
#: Texts handed to the tokenizer per call (a batched call is much faster than one per text).
ENCODE_CHUNK = 1024


def render_prompt(
    tokenizer: Any,
    prompt: Any,
    apply_chat_template: bool,
    rows: Sequence[Mapping[str, Any]],
    index: int,
    config_path: str,
    column: str,
) -> str:
    """The text the model sees for row ``index``'s prompt: the string itself, or the chat template's
    rendering (with the generation prompt) of its messages; a string becomes one user message."""
    where = row_location(rows, index, config_path)  # only for messages; cheap next to tokenizing
    if isinstance(prompt, str):
        if not apply_chat_template:
            return prompt
        messages: list[Any] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        if not apply_chat_template:
            raise DataError(
                f"{where}: '{column}' is a list of chat messages, which needs the tokenizer's chat "
                f"template: set {CHAT_TEMPLATE_KEY}=true"
            )
        messages = list(prompt)
        _check_messages(messages, where, column)
    else:
        raise DataError(
            f"{where}: '{column}' is {prompt!r:.60} ({type(prompt).__name__}), not a prompt: a prompt is "
            'a string, or a list of chat messages [{"role": "user", "content": ...}]'
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:
        raise DataError(
            f"{where}: the tokenizer's chat template failed on '{column}' ({type(error).__name__}: "
            f"{error}); check the messages, or set {CHAT_TEMPLATE_KEY}=false for plain-text prompts"
        ) from error
    if not isinstance(text, str):
        raise DataError(
            f"{where}: the tokenizer's apply_chat_template(tokenize=False) returned a "
            f"{type(text).__name__}, not the rendered text"
        )
    return text


def _check_messages(messages: list[Any], where: str, column: str) -> None:
    if not messages:
        raise DataError(f"{where}: '{column}' is an empty list of chat messages: give at least one")
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(
                f"{where}: message {position} of '{column}' is {message!r:.80}, not a chat message: each "
                'message is {"role": "user" | "assistant" | "system", "content": ...}'
            )


def check_chat_template(tokenizer: Any) -> None:
    # A tokenizer without a template (a base model's) fails on every row: say so once, up front.
    if getattr(tokenizer, "chat_template", "") is None:
        raise DataError(
            f"{CHAT_TEMPLATE_KEY} is true but the tokenizer has no chat template (a base model's "
            f"tokenizer): set {CHAT_TEMPLATE_KEY}=false, or use a tokenizer that has one"
        )


def encode(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[tuple[int, ...]]:
    """Token ids of each text, with one batched tokenizer call per ``ENCODE_CHUNK`` texts."""
    ids: list[tuple[int, ...]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = list(texts[start : start + ENCODE_CHUNK])
        encoded = tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"]
        ids.extend(tuple(int(token) for token in sequence) for sequence in encoded)
    return ids
