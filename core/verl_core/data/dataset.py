"""Prompt datasets for RL, prompt/response pairs for SFT, and the seeded epoch order of the prompts.

``read_rows`` reads the rows of ``.parquet`` files (pyarrow, imported only for them) and JSON Lines
files (``.jsonl``), in order. ``PromptDataset`` turns rows into ``PromptRow`` s: the prompt column
(a string, or a list of chat messages rendered with the tokenizer's chat template) tokenized once, at
construction, and every other column kept as ``extra``, which reaches the reward function as its third
argument. Prompts longer than ``rollout.prompt_length`` are dropped and counted, or are an error
(``data.filter_overlong_prompts``). ``SFTDataset`` does the same for prompt/response pairs.

``EpochSampler`` decides which prompts make each step's batch: every epoch a permutation seeded by
``(seed, epoch)`` alone, cut into full batches, so that a checkpoint needs only the epoch and the
position in it to resume exactly, and a state saved after an epoch's last batch resumes at the next
epoch's first (verl trains zero steps there, verl issue 7401).

Errors are ``DataError`` s that name the file, the row (rows count from 0, in the order read) or the
config key, and the fix. Nothing here imports torch; the tokenizer is anything with the Hugging Face
tokenizer API (``__call__``, ``apply_chat_template``, ``eos_token_id``).
"""

from __future__ import annotations

import bisect
import difflib
import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from verl_core.errors import DataError

if TYPE_CHECKING:
    from verl_core.config.run import DataConfig, RolloutConfig

#: File suffixes read as JSON Lines (one JSON object per line, blank lines skipped).
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonlines", ".ndjson")
#: File suffixes read as Parquet (with pyarrow).
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)
#: Config keys that messages name as the fix.
PROMPT_LENGTH_KEY = "rollout.prompt_length"
FILTER_OVERLONG_KEY = "data.filter_overlong_prompts"
CHAT_TEMPLATE_KEY = "data.apply_chat_template"
PROMPT_KEY_KEY = "data.prompt_key"
RESPONSE_KEY_KEY = "data.response_key"
BATCH_SIZE_KEY = "data.train_batch_size"
#: Texts handed to the tokenizer per call (a batched call is much faster than one per text).
ENCODE_CHUNK = 1024
#: What ``SFTDataset`` does with a pair longer than its limits.
OVERLONG_MODES: tuple[str, ...] = ("filter", "truncate", "error")
#: Keys of ``EpochSampler.state_dict()``.
SAMPLER_STATE_KEYS: tuple[str, ...] = ("epoch", "position", "seed", "shuffle", "num_rows", "batch_size")


# -- reading files ---------------------------------------------------------------------------------


class Rows(list):
    """The rows ``read_rows`` returns: a ``list`` of dicts that remembers the file each row came from,
    so that datasets can name it in their errors (a plain list works too; its rows are named by index).

    ``files`` holds ``(path, number of rows)`` per file, in order.
    """

    def __init__(self, rows: Iterable[dict[str, Any]] = (), files: Sequence[tuple[str, int]] = ()):
        super().__init__(rows)
        self.files: tuple[tuple[str, int], ...] = tuple(files)
        self._starts: list[int] = []
        start = 0
        for _, count in self.files:
            self._starts.append(start)
            start += count

    def where(self, index: int) -> str:
        """``row 3 of 'data/train.jsonl'``: row ``index`` of the whole list, named in its own file."""
        position = bisect.bisect_right(self._starts, index) - 1
        if position < 0 or not self.files:
            return f"row {index}"
        path, _ = self.files[position]
        return f"row {index - self._starts[position]} of '{path}'"


def read_rows(paths: Sequence[str], config_path: str) -> list[dict[str, Any]]:
    """Every row of ``paths`` (``.parquet`` and ``.jsonl`` files), file after file, as dicts.

    ``config_path`` is the config key that listed the files (``data.train_files``); errors name it,
    with the file's index. Returns a ``Rows`` list. Raises ``DataError`` for an empty list of files, a
    missing file, an unsupported suffix, a line that is not a JSON object, and a dataset without rows.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [os.fspath(paths)]
    if not paths:
        raise DataError(
            f"{config_path} is empty: list the dataset files ({config_path}=[train.parquet]); "
            f"supported: {_supported()}"
        )
    rows: list[dict[str, Any]] = []
    files: list[tuple[str, int]] = []
    for index, path in enumerate(paths):
        key = f"{config_path}[{index}]"
        path = os.fspath(path)
        file_rows = _read_file(Path(path), key)
        rows.extend(file_rows)
        files.append((path, len(file_rows)))
    if not rows:
        listed = ", ".join(f"'{path}'" for path, _ in files)
        raise DataError(
            f"{config_path}: the dataset is empty, {listed} hold(s) no rows: add rows, or list other files"
        )
    return Rows(rows, files)


def read_file(path: str | os.PathLike, key: str) -> list[dict[str, Any]]:
    """The rows of one ``.parquet`` or ``.jsonl`` file; errors start with ``key`` (``data.train_files[1]``)."""
    return _read_file(Path(path), key)


def _supported() -> str:
    return ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)


def _read_file(path: Path, key: str) -> list[dict[str, Any]]:
    if not path.exists():
        raise DataError(
            f"{key}: file '{path}' not found (a relative path is relative to the working directory, "
            f"{os.getcwd()}): check the path, or give an absolute one"
        )
    if path.is_dir():
        raise DataError(f"{key}: '{path}' is a directory: list the files in it, each one by its path")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, key)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path, key)
    hint = " (a .json file: write one JSON object per line and name it .jsonl)" if suffix == ".json" else ""
    raise DataError(
        f"{key}: '{path}' has the unsupported suffix '{path.suffix}'{hint}; supported: {_supported()}"
    )


def _read_jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    try:
        # utf-8-sig: a byte order mark (which some editors write) is not part of the first object.
        with path.open(encoding="utf-8-sig") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{key}: '{path}' line {number} is not JSON ({error.msg} at column {error.colno}): "
                        "a JSON Lines file holds one JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{key}: '{path}' line {number} is a JSON {_json_type(row)}, not an object: each "
                        'line is one row, {"prompt": ..., "other column": ...}'
                    )
                rows.append(row)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{key}: '{path}' is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}): save it as UTF-8"
        ) from None
    return rows


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _read_parquet(path: Path, key: str) -> list[dict[str, Any]]:
    try:
        import pyarrow
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(
            f"{key}: reading the Parquet file '{path}' needs pyarrow, which is not installed: "
            "pip install pyarrow (or convert the file to .jsonl)"
        ) from error
    try:
        return parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(f"{key}: '{path}' could not be read as Parquet: {error}") from error


def _where(rows: Sequence[Mapping[str, Any]], index: int, config_path: str) -> str:
    """How messages name row ``index``: in its file when ``rows`` came from ``read_rows``."""
    if isinstance(rows, Rows) and rows.files:
        return f"{rows.where(index)} ({config_path})"
    return f"row {index} of {config_path}"


def _column(
    rows: Sequence[Mapping[str, Any]], index: int, column: str, config_key: str, config_path: str
) -> Any:
    """Row ``index``'s value of ``column``, or a ``DataError`` listing the columns it has."""
    row = rows[index]
    if not isinstance(row, Mapping):
        raise DataError(
            f"{_where(rows, index, config_path)} is a {type(row).__name__}, not a row: a row maps column "
            "names to values"
        )
    if column in row:
        return row[column]
    columns = [str(name) for name in row]
    listed = ", ".join(f"'{name}'" for name in columns) or "none"
    match = difflib.get_close_matches(column, columns, n=1, cutoff=0.6)
    advice = (
        f"did you mean '{match[0]}'? Set {config_key}={match[0]}"
        if match
        else f"set {config_key} to the column that holds it"
    )
    raise DataError(
        f"{_where(rows, index, config_path)} has no column '{column}' ({config_key}); its columns: "
        f"{listed}; {advice}"
    )


# -- rendering and tokenizing ----------------------------------------------------------------------


def _render_prompt(
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
    where = _where(rows, index, config_path)  # only for messages; cheap next to tokenizing
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


def _check_chat_template(tokenizer: Any) -> None:
    # A tokenizer without a template (a base model's) fails on every row: say so once, up front.
    if getattr(tokenizer, "chat_template", "") is None:
        raise DataError(
            f"{CHAT_TEMPLATE_KEY} is true but the tokenizer has no chat template (a base model's "
            f"tokenizer): set {CHAT_TEMPLATE_KEY}=false, or use a tokenizer that has one"
        )


def _encode(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[tuple[int, ...]]:
    """Token ids of each text, with one batched tokenizer call per ``ENCODE_CHUNK`` texts."""
    ids: list[tuple[int, ...]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = list(texts[start : start + ENCODE_CHUNK])
        encoded = tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"]
        ids.extend(tuple(int(token) for token in sequence) for sequence in encoded)
    return ids


# -- prompt datasets -------------------------------------------------------------------------------


@attrs.frozen
class PromptRow:
    """One prompt of an RL dataset.

    ``prompt_ids``: its token ids (what the rollout generates from); ``prompt_text``: the text the
    model sees, after the chat template (what the reward function gets as ``prompt``); ``extra``:
    every other column of the row, by name (the reward function's ``extra``).
    """

    prompt_ids: tuple[int, ...]
    prompt_text: str
    extra: dict[str, Any]


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
            _check_chat_template(tokenizer)
        self.config_path = config_path
        self.max_prompt_length = max_prompt_length
        self.num_rows = len(rows)
        texts, extras = [], []
        for index in range(len(rows)):
            prompt = _column(rows, index, prompt_key, PROMPT_KEY_KEY, config_path)
            texts.append(
                _render_prompt(tokenizer, prompt, apply_chat_template, rows, index, config_path, prompt_key)
            )
            extras.append({name: value for name, value in rows[index].items() if name != prompt_key})
        all_ids = _encode(tokenizer, texts, add_special_tokens=not apply_chat_template)

        self._items: list[PromptRow] = []
        kept: list[int] = []
        for index, (ids, text, extra) in enumerate(zip(all_ids, texts, extras, strict=True)):
            if len(ids) <= max_prompt_length:
                self._items.append(PromptRow(ids, text, extra))
                kept.append(index)
            elif not filter_overlong:
                raise DataError(
                    f"{_where(rows, index, config_path)}: the prompt is {len(ids)} tokens, longer than "
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
        return cls(read_rows(paths, config_path), tokenizer, **options)

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
            _check_chat_template(tokenizer)
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
            prompt = _column(rows, index, prompt_key, PROMPT_KEY_KEY, config_path)
            response = _column(rows, index, response_key, RESPONSE_KEY_KEY, config_path)
            if not isinstance(response, str):
                raise DataError(
                    f"{_where(rows, index, config_path)}: '{response_key}' is {response!r:.60} "
                    f"({type(response).__name__}), not a response: an SFT response is a string"
                )
            prompts.append(
                _render_prompt(tokenizer, prompt, apply_chat_template, rows, index, config_path, prompt_key)
            )
            responses.append(response)
        prompt_ids = _encode(tokenizer, prompts, add_special_tokens=not apply_chat_template)
        response_ids = [ids + (int(eos),) for ids in _encode(tokenizer, responses, add_special_tokens=False)]

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
                    f"{_where(rows, index, config_path)}: {' and '.join(too_long)}: raise the limit, or "
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
        return cls(read_rows(paths, config_path), tokenizer, **options)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> SFTRow:
        return self._items[index]

    def __iter__(self) -> Iterator[SFTRow]:
        return iter(self._items)

    def select(self, indices: Iterable[int]) -> list[SFTRow]:
        """The items at ``indices`` (a ``SamplerBatch``'s), in that order."""
        return [self._items[index] for index in indices]


# -- the order of prompts over epochs --------------------------------------------------------------


@attrs.frozen
class SamplerBatch:
    """One step's prompts: ``indices`` into the dataset, batch ``step_in_epoch`` of epoch ``epoch``
    (both from 0)."""

    epoch: int
    step_in_epoch: int
    indices: tuple[int, ...]


@attrs.define
class EpochSampler:
    """The order in which a dataset's rows make up the training batches, epoch after epoch.

    Each epoch is a permutation of ``range(num_rows)`` seeded by ``(seed, epoch)`` (its own
    ``random.Random``: the global RNGs are neither read nor advanced), or ``range(num_rows)`` itself
    without ``shuffle``, cut into ``steps_per_epoch = num_rows // batch_size`` full batches: the last
    ``num_rows % batch_size`` rows of each epoch's order are dropped (with ``shuffle``, different rows
    each epoch), so every step has exactly ``batch_size`` prompts.

    The state is ``(epoch, position)``: the next batch is batch ``position`` of epoch ``epoch``. After
    an epoch's last batch it is ``(epoch + 1, 0)`` at once, so a checkpoint taken at an epoch boundary
    resumes at the next epoch's first batch.
    """

    num_rows: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    #: The epoch of the next batch.
    epoch: int = attrs.field(default=0, init=False)
    #: The next batch's index in its epoch.
    position: int = attrs.field(default=0, init=False)
    _order: tuple[int, tuple[int, ...]] | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.num_rows < 1:
            raise DataError("the dataset is empty (0 prompts after filtering): add prompts")
        if self.batch_size < 1:
            raise DataError(f"{BATCH_SIZE_KEY} must be > 0 prompts, got {self.batch_size}")
        if self.batch_size > self.num_rows:
            raise DataError(
                f"{BATCH_SIZE_KEY} ({self.batch_size}) is larger than the dataset ({self.num_rows} prompts "
                f"after filtering): lower {BATCH_SIZE_KEY} to at most {self.num_rows}, or add prompts"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the remainder of ``num_rows / batch_size`` is dropped)."""
        return self.num_rows // self.batch_size

    @property
    def steps_taken(self) -> int:
        """Batches handed out since epoch 0 began (the trainer's global step, when it takes one each)."""
        return self.epoch * self.steps_per_epoch + self.position

    def total_steps(self, epochs: int) -> int:
        """Steps in ``epochs`` whole epochs."""
        if epochs < 0:
            raise DataError(f"epochs must be >= 0, got {epochs}")
        return epochs * self.steps_per_epoch

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """Every row index once, in epoch ``epoch``'s order (depends on ``seed`` and ``epoch`` only)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        order = list(range(self.num_rows))
        if self.shuffle:
            # A string seed is hashed with SHA-512: stable across runs, platforms and Python versions
            # (unlike hash()), and (1, 0) and (-1, 0) differ (an int seed would use its absolute value).
            random.Random(f"verl_core.data.EpochSampler:{self.seed}:{epoch}").shuffle(order)
        self._order = (epoch, tuple(order))
        return self._order[1]

    def next_batch(self) -> SamplerBatch:
        """The next step's batch, and advance (into the next epoch after an epoch's last batch)."""
        start = self.position * self.batch_size
        batch = SamplerBatch(
            self.epoch, self.position, self.epoch_order(self.epoch)[start : start + self.batch_size]
        )
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position and what the order depends on, as plain JSON-able data for a checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of a sampler over the same dataset and batch size).

        A state at an epoch's end (``position == steps_per_epoch``) continues at the next epoch's first
        batch. A state made with another dataset size, batch size, seed or ``shuffle`` is an error:
        its position would mean other prompts.
        """
        if not isinstance(state, Mapping):
            raise DataError(
                f"sampler state is a {type(state).__name__}, not a mapping of {SAMPLER_STATE_KEYS}"
            )
        missing = [key for key in SAMPLER_STATE_KEYS if key not in state]
        if missing:
            raise DataError(
                f"sampler state lacks {', '.join(missing)}: it was not written by EpochSampler.state_dict() "
                "(the checkpoint is damaged or from another program)"
            )
        for key in SAMPLER_STATE_KEYS:
            expected = bool if key == "shuffle" else int
            value = state[key]
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                what = "a boolean" if expected is bool else "an integer"
                raise DataError(f"sampler state '{key}' is {value!r}, not {what}: the checkpoint is damaged")
        changed = {
            "num_rows": (
                f"the dataset had {state['num_rows']} prompts (after filtering) at the checkpoint and has "
                f"{self.num_rows} now: the dataset changed since the checkpoint (data.train_files, or what "
                f"filters it: {PROMPT_LENGTH_KEY}, {FILTER_OVERLONG_KEY}, the tokenizer); resume with the "
                "same data, or start fresh (trainer.resume_mode=disable)"
            ),
            "batch_size": (
                f"{BATCH_SIZE_KEY} was {state['batch_size']} at the checkpoint and is {self.batch_size} "
                f"now: the batch size changed since the checkpoint; set {BATCH_SIZE_KEY}="
                f"{state['batch_size']} to resume, or start fresh (trainer.resume_mode=disable)"
            ),
            "seed": (
                f"data.seed was {state['seed']} at the checkpoint and is {self.seed} now: set "
                f"data.seed={state['seed']} to resume the same order, or start fresh "
                "(trainer.resume_mode=disable)"
            ),
            "shuffle": (
                f"data.shuffle was {str(state['shuffle']).lower()} at the checkpoint and is "
                f"{str(self.shuffle).lower()} now: set data.shuffle={str(state['shuffle']).lower()} to "
                "resume the same order, or start fresh (trainer.resume_mode=disable)"
            ),
        }
        for key, message in changed.items():
            if state[key] != getattr(self, key):
                raise DataError(message)
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise DataError(
                f"sampler state epoch={epoch}, position={position} is out of range (epoch >= 0, position "
                f"in [0, {self.steps_per_epoch}]): the checkpoint is damaged"
            )
        if position == self.steps_per_epoch:
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position


def sequential_batches(num_rows: int, batch_size: int | None) -> list[range]:
    """Validation batches: every row once, in order, ``batch_size`` at a time (the last one may be
    smaller); ``None``: all rows in one batch (``data.val_batch_size``)."""
    if batch_size is not None and batch_size < 1:
        raise DataError(f"data.val_batch_size must be > 0 prompts, got {batch_size}")
    if batch_size is None or batch_size >= num_rows:
        return [range(num_rows)] if num_rows else []
    return [range(start, min(start + batch_size, num_rows)) for start in range(0, num_rows, batch_size)]
