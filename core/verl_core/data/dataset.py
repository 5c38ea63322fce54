"""Prompt datasets for RL and prompt/response pairs for SFT, from the rows of dataset files.

``PromptDataset`` turns the rows ``verl_core.data.files.read_rows`` reads into ``PromptRow`` s: the prompt column
(a string, or a list of chat messages rendered with the tokenizer's chat template) tokenized once, at
construction, and every other column kept as ``extra``, which reaches the reward function as its third
argument. Prompts longer than ``rollout.prompt_length`` are dropped and counted, or are an error
(``data.filter_overlong_prompts``). ``SFTDataset`` does the same for prompt/response pairs.

``verl_core.data.sampler.EpochSampler`` decides which of them make each step's batch.

Errors are ``DataError`` s that name the file, the row (rows count from 0, in the order read) or the
config key, and the fix. Nothing here imports torch; the tokenizer is anything with the Hugging Face
tokenizer API (``__call__``, ``apply_chat_template``, ``eos_token_id``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from verl_core.data import files
from verl_core.data.files import column_value, row_location
from verl_core.data.rendering import check_chat_template, encode, render_prompt
from verl_core.deprecation import moved_names
from verl_core.errors import DataError

if TYPE_CHECKING:
    from verl_core.config.run import DataConfig, RolloutConfig

#: Config keys that messages name as the fix.
PROMPT_LENGTH_KEY = "rollout.prompt_length"
FILTER_OVERLONG_KEY = "data.filter_overlong_prompts"
PROMPT_KEY_KEY = "data.prompt_key"
RESPONSE_KEY_KEY = "data.response_key"
#: What ``SFTDataset`` does with a pair longer than its limits.
OVERLONG_MODES: tuple[str, ...] = ("filter", "truncate", "error")


# -- prompt datasets -------------------------------------------------------------------------------


@attrs.frozen
class PromptRow:
    """One prompt of an RL dataset.

    ``prompt_ids``: its token ids (what the rollout generates from); ``prompt_text``: the text the
    model sees, after the chat template (what the reward function gets as ``prompt``); ``extra``:
    every other column of the row, by name (the reward function's ``extra``); ``prompt``: the prompt
    column as the row holds it, a string or chat messages (an environment that runs its own
    conversation, as verifiers' do, starts from the messages).
    """

    prompt_ids: tuple[int, ...]
    prompt_text: str
    extra: dict[str, Any]
    prompt: Any = None


class PromptDataset:
    """The prompts of an RL dataset, tokenized once at construction: ``dataset[i]`` is a ``PromptRow``.

    ``rows`` are dicts (``read_rows``, or any list); the column ``prompt_key`` holds the prompt, a
    string or a list of chat messages (which needs ``apply_chat_template``). With
    ``apply_chat_template`` every prompt is rendered by the tokenizer's chat template with the
    generation prompt (a string becomes one user message) and tokenized without adding special tokens
    (the template has them); without it, the string is tokenized as the tokenizer does by default
    (``add_special_tokens=True``: a BOS token where the tokenizer adds one).

    A prompt longer than ``max_prompt_length`` tokens is dropped and counted in ``num_filtered``
    (``filter_overlong``), or else an error naming its row; a dataset with every prompt too long is
    an error either way. ``config_path`` is the key that listed the files (``data.train_files``), for
    messages. ``row_indices[i]`` is the row that item ``i`` came from.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        apply_chat_template: bool = False,
        filter_overlong: bool = True,
        config_path: str = "data.train_files",
    ):
        if max_prompt_length < 1:
            raise DataError(f"{PROMPT_LENGTH_KEY} must be > 0 tokens, got {max_prompt_length}")
        if not rows:
            raise DataError(f"{config_path}: the dataset is empty: add rows, or list other files")
        if apply_chat_template:
            check_chat_template(tokenizer)
        self.config_path = config_path
        self.max_prompt_length = max_prompt_length
        self.num_rows = len(rows)
        prompts, texts, extras = [], [], []
        for index in range(len(rows)):
            prompt = column_value(rows, index, prompt_key, PROMPT_KEY_KEY, config_path)
            prompts.append(prompt)
            texts.append(
                render_prompt(tokenizer, prompt, apply_chat_template, rows, index, config_path, prompt_key)
            )
            extras.append({name: value for name, value in rows[index].items() if name != prompt_key})
        all_ids = encode(tokenizer, texts, add_special_tokens=not apply_chat_template)

        self._items: list[PromptRow] = []
        kept: list[int] = []
        for index, (ids, text, extra, prompt) in enumerate(zip(all_ids, texts, extras, prompts, strict=True)):
            if len(ids) <= max_prompt_length:
                self._items.append(PromptRow(ids, text, extra, prompt))
                kept.append(index)
            elif not filter_overlong:
                raise DataError(
                    f"{row_location(rows, index, config_path)}: the prompt is {len(ids)} tokens, longer than "
                    f"{PROMPT_LENGTH_KEY} ({max_prompt_length}): raise {PROMPT_LENGTH_KEY}, shorten the "
                    f"prompt, or set {FILTER_OVERLONG_KEY}=true to drop the prompts that are too long"
                )
        #: Rows dropped for a prompt longer than ``max_prompt_length``.
        self.num_filtered = self.num_rows - len(kept)
        self.row_indices: tuple[int, ...] = tuple(kept)
        if not self._items:
            shortest = min(len(ids) for ids in all_ids)
            raise DataError(
                f"{config_path}: every prompt ({self.num_rows}) is longer than {PROMPT_LENGTH_KEY} "
                f"({max_prompt_length} tokens); the shortest is {shortest}: raise {PROMPT_LENGTH_KEY} to "
                "at least that, or use shorter prompts"
            )

    @classmethod
    def from_files(cls, paths: Sequence[str], tokenizer: Any, **options: Any) -> PromptDataset:
        """``read_rows(paths)`` as a dataset; ``options`` as for the constructor."""
        config_path = options.setdefault("config_path", "data.train_files")
        return cls(files.read_rows(paths, config_path), tokenizer, **options)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> PromptRow:
        return self._items[index]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self._items)

    def select(self, indices: Iterable[int]) -> list[PromptRow]:
        """The items at ``indices`` (a ``SamplerBatch``'s), in that order."""
        return [self._items[index] for index in indices]

    def summary(self) -> str:
        """One line for the log: how many prompts were kept and how many filtered."""
        line = f"{self.config_path}: {len(self)} prompts"
        if self.num_filtered:
            line += (
                f" ({self.num_filtered} of {self.num_rows} longer than {PROMPT_LENGTH_KEY}="
                f"{self.max_prompt_length} filtered out)"
            )
        return line


def load_prompt_datasets(
    data: DataConfig, rollout: RolloutConfig, tokenizer: Any
) -> tuple[PromptDataset, PromptDataset | None]:
    """The training dataset of ``data.train_files`` and the validation one of ``data.val_files``
    (``None`` when there are none), as the run config says."""
    options = {
        "max_prompt_length": rollout.prompt_length,
        "prompt_key": data.prompt_key,
        "apply_chat_template": data.apply_chat_template,
        "filter_overlong": data.filter_overlong_prompts,
    }
    train = PromptDataset.from_files(data.train_files, tokenizer, config_path="data.train_files", **options)
    val = None
    if data.val_files:
        val = PromptDataset.from_files(data.val_files, tokenizer, config_path="data.val_files", **options)
    return train, val


# -- SFT datasets ----------------------------------------------------------------------------------


@attrs.frozen
class SFTRow:
    """One SFT pair: the prompt's token ids, and the response's followed by the tokenizer's eos token
    (the loss is on ``response_ids`` only)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


class SFTDataset:
    """Prompt/response pairs for supervised fine-tuning, tokenized once: ``dataset[i]`` is an ``SFTRow``.

    The prompt column is read and rendered as in ``PromptDataset`` (with ``apply_chat_template``, the
    response follows the template's generation prompt); the response column holds a string, tokenized
    without special tokens and followed by the tokenizer's ``eos_token_id``.

    A pair whose prompt is longer than ``max_prompt_length`` or whose response (eos included) is longer
    than ``max_response_length`` is, by ``overlong``: ``filter``, dropped and counted in
    ``num_filtered``; ``truncate``, cut to the limits (the prompt keeps its last tokens, the response
    its first, so a truncated response has no eos), counted in ``num_truncated``; ``error``, an error
    naming the first such row. Nothing left after filtering is an error.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        max_response_length: int,
        prompt_key: str = "prompt",
        response_key: str = "response",
        apply_chat_template: bool = False,
        overlong: Literal["filter", "truncate", "error"] = "filter",
        config_path: str = "data.train_files",
    ):
        if overlong not in OVERLONG_MODES:
            raise DataError(f"overlong={overlong!r}: use one of {', '.join(OVERLONG_MODES)}")
        for name, limit in (
            ("max_prompt_length", max_prompt_length),
            ("max_response_length", max_response_length),
        ):
            if limit < 1:
                raise DataError(f"{name} must be > 0 tokens, got {limit}")
        if not rows:
            raise DataError(f"{config_path}: the dataset is empty: add rows, or list other files")
        if apply_chat_template:
            check_chat_template(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise DataError(
                "the tokenizer has no eos token (eos_token_id is None), which ends every SFT response: "
                "set one on the tokenizer (tokenizer.eos_token = ...) or use the model's own tokenizer"
            )
        self.config_path = config_path
        self.num_rows = len(rows)
        prompts, responses = [], []
        for index in range(len(rows)):
            prompt = column_value(rows, index, prompt_key, PROMPT_KEY_KEY, config_path)
            response = column_value(rows, index, response_key, RESPONSE_KEY_KEY, config_path)
            if not isinstance(response, str):
                raise DataError(
                    f"{row_location(rows, index, config_path)}: '{response_key}' is {response!r:.60} "
                    f"({type(response).__name__}), not a response: an SFT response is a string"
                )
            prompts.append(
                render_prompt(tokenizer, prompt, apply_chat_template, rows, index, config_path, prompt_key)
            )
            responses.append(response)
        prompt_ids = encode(tokenizer, prompts, add_special_tokens=not apply_chat_template)
        response_ids = [ids + (int(eos),) for ids in encode(tokenizer, responses, add_special_tokens=False)]

        self._items: list[SFTRow] = []
        kept: list[int] = []
        self.num_truncated = 0
        for index, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            too_long = [
                f"the {part} is {len(ids)} tokens{note}, longer than {name} ({limit})"
                for part, ids, note, name, limit in (
                    ("prompt", prompt, "", "max_prompt_length", max_prompt_length),
                    ("response", response, " with its eos", "max_response_length", max_response_length),
                )
                if len(ids) > limit
            ]
            if too_long and overlong == "error":
                raise DataError(
                    f"{row_location(rows, index, config_path)}: {' and '.join(too_long)}: raise the limit, or "
                    "drop such pairs (overlong='filter') or cut them (overlong='truncate')"
                )
            if too_long and overlong == "filter":
                continue
            if too_long:
                self.num_truncated += 1
                prompt, response = prompt[-max_prompt_length:], response[:max_response_length]
            self._items.append(SFTRow(prompt, response))
            kept.append(index)
        #: Pairs dropped for being longer than the limits (``overlong="filter"``).
        self.num_filtered = self.num_rows - len(kept)
        self.row_indices: tuple[int, ...] = tuple(kept)
        if not self._items:
            raise DataError(
                f"{config_path}: every pair ({self.num_rows}) is longer than max_prompt_length "
                f"({max_prompt_length}) or max_response_length ({max_response_length}): raise the limits, "
                "or use overlong='truncate'"
            )

    @classmethod
    def from_files(cls, paths: Sequence[str], tokenizer: Any, **options: Any) -> SFTDataset:
        """``read_rows(paths)`` as a dataset; ``options`` as for the constructor."""
        config_path = options.setdefault("config_path", "data.train_files")
        return cls(files.read_rows(paths, config_path), tokenizer, **options)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> SFTRow:
        return self._items[index]

    def __iter__(self) -> Iterator[SFTRow]:
        return iter(self._items)

    def select(self, indices: Iterable[int]) -> list[SFTRow]:
        """The items at ``indices`` (a ``SamplerBatch``'s), in that order."""
        return [self._items[index] for index in indices]


# Until 0.2.0 this module also read the files and ordered the prompts.
__getattr__ = moved_names(
    __name__,
    {
        "read_rows": "verl_core.data:read_rows",
        "Rows": "verl_core.data.files:Rows",
        "EpochSampler": "verl_core.data:EpochSampler",
        "SamplerBatch": "verl_core.data:SamplerBatch",
        "sequential_batches": "verl_core.data:sequential_batches",
    },
    since="0.2.0",
    removed_in="0.4.0",
)
