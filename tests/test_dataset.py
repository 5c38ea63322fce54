"""Prompt and SFT datasets, the files they read, and the seeded, resumable epoch order of prompts.

The tokenizer is a real Hugging Face fast tokenizer built here (one token per character, a BOS token
added by default, a Jinja chat template that starts with the BOS token), so nothing is downloaded and
the chat-template path is the one ``transformers`` runs. Every error test asserts the words that name
the file, row or key and the fix. The sampler's properties (each row once per epoch, the order a
function of seed and epoch alone, exact resume from any state) are hypothesis tests.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from verl_core.config import DataConfig, RolloutConfig, structure
from verl_core.data.dataset import PromptDataset, PromptRow, SFTDataset, SFTRow, load_prompt_datasets
from verl_core.data.files import Rows, read_rows
from verl_core.data.sampler import EpochSampler, SamplerBatch, sequential_batches
from verl_core.errors import ConfigError, DataError

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PAD, EOS, BOS = 0, 1, 2


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (and newline); ``<bos>`` prepended by default."""
    vocab = {
        token: i
        for i, token in enumerate(["<pad>", "<eos>", "<bos>", "\n"] + [chr(c) for c in range(32, 127)])
    }
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    model.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    model.decoder = decoders.Fuse()
    model.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def write_jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    # Every row's columns (``Table.from_pylist`` would keep the first row's only); missing values are null.
    columns = list(dict.fromkeys(name for row in rows for name in row))
    pq.write_table(pa.table({name: [row.get(name) for row in rows] for name in columns}), path)
    return str(path)


def chat_ids(tokenizer, messages) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids (a ``BatchEncoding`` in transformers 5, a list before)."""
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


ROWS = [
    {"prompt": "1+1=", "ground_truth": "2", "data_source": "toy"},
    {"prompt": "2+3=", "ground_truth": "5", "data_source": "toy", "meta": {"level": 1, "tags": ["a"]}},
]


# -- reading files ---------------------------------------------------------------------------------


def test_jsonl_and_parquet_rows_are_read_file_after_file(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text(json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n")  # blank lines skipped
    second = write_parquet(
        tmp_path / "b.parquet", [{"prompt": "3+4=", "ground_truth": "7", "data_source": "pq"}]
    )
    rows = read_rows([str(first), second], "data.train_files")
    assert rows == [*ROWS, {"prompt": "3+4=", "ground_truth": "7", "data_source": "pq"}]
    assert isinstance(rows, Rows) and rows.files == ((str(first), 2), (second, 1))
    assert rows.where(1) == f"row 1 of '{first}'" and rows.where(2) == f"row 0 of '{second}'"


def test_a_missing_file_is_named_with_its_key_and_the_working_directory(tmp_path):
    present = write_jsonl(tmp_path / "a.jsonl", ROWS)
    with pytest.raises(DataError) as caught:
        read_rows([present, "data/missing.jsonl"], "data.val_files")
    message = str(caught.value)
    assert message.startswith("data.val_files[1]: file 'data/missing.jsonl' not found")
    assert "relative to the working directory" in message and str(Path.cwd()) in message


@pytest.mark.parametrize(
    ("name", "hint"),
    [("prompts.csv", ""), ("prompts.json", "write one JSON object per line and name it .jsonl")],
)
def test_an_unsupported_suffix_lists_the_supported_ones(tmp_path, name, hint):
    path = tmp_path / name
    path.write_text("prompt\n")
    with pytest.raises(DataError) as caught:
        read_rows([str(path)], "data.train_files")
    message = str(caught.value)
    assert f"data.train_files[0]: '{path}' has the unsupported suffix '{path.suffix}'" in message
    assert "supported: .jsonl, .jsonlines, .ndjson, .parquet" in message
    assert hint in message


def test_a_jsonl_line_that_is_not_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with pytest.raises(
        DataError, match=r"data.train_files\[0\]: '.*bad.jsonl' line 3 is not JSON \(.*column"
    ):
        read_rows([str(path)], "data.train_files")


@pytest.mark.parametrize(("value", "kind"), [(["a", "b"], "array"), ("a prompt", "string"), (None, "null")])
def test_a_jsonl_line_that_is_not_an_object_names_the_file_and_line(tmp_path, value, kind):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, value])
    with pytest.raises(DataError) as caught:
        read_rows([path], "data.train_files")
    assert f"'{path}' line 2 is a JSON {kind}, not an object: each line is one row" in str(caught.value)


def test_an_empty_dataset_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    parquet = write_parquet(tmp_path / "empty.parquet", [])
    with pytest.raises(
        DataError, match="data.train_files: the dataset is empty, .*empty.jsonl.*empty.parquet"
    ):
        read_rows([str(empty), parquet], "data.train_files")
    with pytest.raises(DataError, match=r"data.train_files is empty: list the dataset files"):
        read_rows([], "data.train_files")


def test_a_file_that_is_not_utf_8_or_not_parquet_is_named(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.jsonl' is not UTF-8 text \(byte 0xe9 .*save it as UTF-8"):
        read_rows([str(latin)], "data.train_files")
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(
        DataError, match=r"data.train_files\[0\]: '.*fake.parquet' could not be read as Parquet"
    ):
        read_rows([str(fake)], "data.train_files")


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "a.parquet", ROWS)
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    for name in [name for name in sys.modules if name == "pyarrow" or name.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes ``import pyarrow`` raise ImportError
    assert read_rows([jsonl], "data.train_files") == ROWS  # JSON Lines need no pyarrow
    with pytest.raises(DataError, match="needs pyarrow, which is not installed: pip install pyarrow"):
        read_rows([path], "data.train_files")


def test_the_data_modules_import_neither_torch_nor_pyarrow_for_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    code = textwrap.dedent(
        f"""
        import sys
        import verl_core.data.dataset, verl_core.data.sampler
        from verl_core.data.files import read_rows
        assert read_rows([{path!r}], "data.train_files")
        assert "torch" not in sys.modules, "torch imported"
        assert "pyarrow" not in sys.modules, "pyarrow imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- prompt datasets -------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_plain_prompts_keep_every_other_column_as_extra(tmp_path, tokenizer, writer):
    path = writer(tmp_path / ("rows.jsonl" if writer is write_jsonl else "rows.parquet"), ROWS)
    dataset = PromptDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert len(dataset) == 2 and dataset.num_filtered == 0
    first, second = dataset
    # A parquet table has every column in every row: the first row's missing "meta" is null there.
    first_extra = {"ground_truth": "2", "data_source": "toy"} | (
        {} if writer is write_jsonl else {"meta": None}
    )
    assert first == PromptRow(tuple(tokenizer("1+1=")["input_ids"]), "1+1=", first_extra, "1+1=")
    assert first.prompt_ids[0] == BOS  # the tokenizer's own special tokens, as it adds them by default
    assert second.extra == {"ground_truth": "5", "data_source": "toy", "meta": {"level": 1, "tags": ["a"]}}
    assert dataset.select([1, 0]) == [second, first]


def test_a_string_prompt_with_the_chat_template_is_one_user_message(tmp_path, tokenizer):
    dataset = PromptDataset(ROWS, tokenizer, max_prompt_length=64, apply_chat_template=True)
    messages = [{"role": "user", "content": "1+1="}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert dataset[0].prompt_text == expected == "<bos><user>1+1=\n<assistant>"
    assert list(dataset[0].prompt_ids) == chat_ids(tokenizer, messages)
    assert dataset[0].prompt_ids.count(BOS) == 1  # the template's BOS only, no second one added


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_chat_message_prompts_are_rendered_with_the_generation_prompt(tmp_path, tokenizer, writer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = writer(
        tmp_path / ("c.jsonl" if writer is write_jsonl else "c.parquet"),
        [{"prompt": messages, "ground_truth": "4"}],
    )
    dataset = PromptDataset.from_files([path], tokenizer, max_prompt_length=64, apply_chat_template=True)
    row = dataset[0]
    assert row.prompt_text == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert row.prompt_text.endswith("<assistant>")
    assert list(row.prompt_ids) == chat_ids(tokenizer, messages)
    assert row.extra == {"ground_truth": "4"}


def test_chat_messages_without_the_chat_template_say_to_turn_it_on(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [ROWS[0], {"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert str(caught.value) == (
        f"row 1 of '{path}' (data.train_files): 'prompt' is a list of chat messages, which needs the "
        "tokenizer's chat template: set data.apply_chat_template=true"
    )


def test_a_tokenizer_without_a_chat_template_is_named_once(tmp_path):
    with pytest.raises(
        DataError, match="data.apply_chat_template is true but the tokenizer has no chat template"
    ):
        PromptDataset(
            ROWS, make_tokenizer(chat_template=None), max_prompt_length=64, apply_chat_template=True
        )


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (7, "'prompt' is 7 (int), not a prompt: a prompt is a string, or a list of chat messages"),
        (None, "'prompt' is None (NoneType), not a prompt"),
        ([], "'prompt' is an empty list of chat messages"),
        ([{"content": "hi"}], "message 0 of 'prompt' is {'content': 'hi'}, not a chat message"),
        (["hi"], "message 0 of 'prompt' is 'hi', not a chat message"),
    ],
)
def test_a_prompt_that_is_not_a_prompt_names_its_row(tmp_path, tokenizer, prompt, words):
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], ROWS[1], {"prompt": prompt}])
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files([path], tokenizer, max_prompt_length=64, apply_chat_template=True)
    assert str(caught.value).startswith(f"row 2 of '{path}' (data.train_files): ")
    assert words in str(caught.value)


def test_a_row_without_the_prompt_column_lists_its_columns_and_the_close_match(tmp_path, tokenizer):
    first = write_jsonl(tmp_path / "a.jsonl", ROWS)
    second = write_jsonl(tmp_path / "b.jsonl", [ROWS[0], {"prompts": "3+3=", "ground_truth": "6"}])
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files(
            [first, second], tokenizer, max_prompt_length=64, config_path="data.val_files"
        )
    assert str(caught.value) == (
        f"row 1 of '{second}' (data.val_files) has no column 'prompt' (data.prompt_key) (did you mean "
        "'prompts'?); its columns: 'prompts', 'ground_truth'; set data.prompt_key=prompts"
    )
    with pytest.raises(
        DataError,
        match=r"row 0 of data.train_files has no column 'prompt' .*its columns: 'question', "
        r"'answer'; set data.prompt_key to the column that holds it",
    ):
        PromptDataset([{"question": "q", "answer": "a"}], tokenizer, max_prompt_length=64)


def test_a_custom_prompt_column_leaves_the_others_in_extra(tokenizer):
    dataset = PromptDataset(
        [{"question": "q?", "prompt": "not this"}], tokenizer, max_prompt_length=64, prompt_key="question"
    )
    assert dataset[0].prompt_text == "q?" and dataset[0].extra == {"prompt": "not this"}


def test_overlong_prompts_are_filtered_and_counted(tokenizer):
    rows = [{"prompt": "x" * n, "i": i} for i, n in enumerate([3, 9, 4, 10, 5])]  # +1 token each: the BOS
    dataset = PromptDataset(rows, tokenizer, max_prompt_length=6)
    assert [row.extra["i"] for row in dataset] == [0, 2, 4]
    assert dataset.num_filtered == 2 and dataset.num_rows == 5 and dataset.row_indices == (0, 2, 4)
    assert all(len(row.prompt_ids) <= 6 for row in dataset)
    assert (
        dataset.summary()
        == "data.train_files: 3 prompts (2 of 5 longer than rollout.prompt_length=6 filtered out)"
    )
    assert PromptDataset(rows, tokenizer, max_prompt_length=11).summary() == "data.train_files: 5 prompts"
    assert len(PromptDataset(rows, tokenizer, max_prompt_length=6 + 4)) == 4  # the limit itself is allowed


def test_an_overlong_prompt_without_filtering_names_the_first_row_its_length_and_the_limit(
    tmp_path, tokenizer
):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * n} for n in (3, 9, 10)])
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files([path], tokenizer, max_prompt_length=6, filter_overlong=False)
    assert str(caught.value) == (
        f"row 1 of '{path}' (data.train_files): the prompt is 10 tokens, longer than "
        "rollout.prompt_length (6): raise rollout.prompt_length, shorten the prompt, or set "
        "data.filter_overlong_prompts=true to drop the prompts that are too long"
    )


@pytest.mark.parametrize("filter_overlong", [True, False])
def test_every_prompt_too_long_is_an_error_either_way(tokenizer, filter_overlong):
    rows = [{"prompt": "x" * n} for n in (8, 12)]
    with pytest.raises(DataError, match="rollout.prompt_length") as caught:
        PromptDataset(rows, tokenizer, max_prompt_length=4, filter_overlong=filter_overlong)
    if filter_overlong:
        assert str(caught.value) == (
            "data.train_files: every prompt (2) is longer than rollout.prompt_length (4 tokens); the "
            "shortest is 9: "
            "raise rollout.prompt_length to at least that, or use shorter prompts"
        )


class CountingTokenizer:
    """Forwards to a tokenizer and counts the calls that tokenize."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prompts_are_tokenized_once_at_construction_in_batched_calls(tokenizer, monkeypatch):
    import verl_core.data.rendering as rendering

    monkeypatch.setattr(rendering, "ENCODE_CHUNK", 4)
    counting = CountingTokenizer(tokenizer)
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    dataset = PromptDataset(rows, counting, max_prompt_length=64)
    assert counting.calls == 3  # ceil(10 / 4) batched calls
    assert [list(row.prompt_ids) for row in dataset] == tokenizer([f"p{i}" for i in range(10)])["input_ids"]
    _ = [dataset[i] for i in range(10)], list(dataset), dataset.select(range(10))
    assert counting.calls == 3
    assert isinstance(dataset[0].prompt_ids, tuple)


def test_the_run_config_builds_the_train_and_validation_sets(tmp_path, tokenizer):
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"question": "x" * n, "ground_truth": "a"} for n in (2, 30, 3)]
    )
    val = write_parquet(tmp_path / "val.parquet", [{"question": "v", "ground_truth": "b"}])
    data = DataConfig(train_files=[train], val_files=[val], prompt_key="question", apply_chat_template=True)
    train_set, val_set = load_prompt_datasets(data, RolloutConfig(prompt_length=24), tokenizer)
    assert len(train_set) == 2 and train_set.num_filtered == 1
    assert val_set is not None and val_set.config_path == "data.val_files"
    assert val_set[0].prompt_text == "<bos><user>v\n<assistant>" and val_set[0].extra == {"ground_truth": "b"}
    data.val_files = []
    assert load_prompt_datasets(data, RolloutConfig(prompt_length=24), tokenizer)[1] is None
    data.filter_overlong_prompts = False
    with pytest.raises(
        DataError, match=r"row 1 of '.*train.jsonl' \(data.train_files\): the prompt is 49 tokens"
    ):
        load_prompt_datasets(data, RolloutConfig(prompt_length=24), tokenizer)


def test_the_data_config_has_the_new_keys_with_their_defaults():
    data = structure({"response_key": "answer", "val_batch_size": 16}, DataConfig)
    assert (
        data.response_key,
        data.val_batch_size,
        data.apply_chat_template,
        data.filter_overlong_prompts,
    ) == (
        "answer",
        16,
        False,
        True,
    )
    assert DataConfig().val_batch_size is None
    with pytest.raises(ConfigError, match="val_batch_size: must be > 0, got 0"):
        structure({"val_batch_size": 0}, DataConfig, "data")


# -- SFT datasets ----------------------------------------------------------------------------------

PAIRS = [{"prompt": "1+1=", "response": "2", "id": 0}, {"prompt": "10+10=", "response": "20", "id": 1}]


def test_sft_pairs_are_prompt_ids_and_response_ids_ending_with_eos(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "sft.parquet", PAIRS)
    dataset = SFTDataset.from_files([path], tokenizer, max_prompt_length=16, max_response_length=8)
    assert list(dataset) == [
        SFTRow(
            tuple(tokenizer("1+1=")["input_ids"]),
            (*tokenizer("2", add_special_tokens=False)["input_ids"], EOS),
        ),
        SFTRow(
            tuple(tokenizer("10+10=")["input_ids"]),
            (*tokenizer("20", add_special_tokens=False)["input_ids"], EOS),
        ),
    ]
    assert dataset.num_filtered == dataset.num_truncated == 0


def test_sft_with_the_chat_template_puts_the_response_after_the_generation_prompt(tokenizer):
    rows = [{"question": [{"role": "user", "content": "hi"}], "answer": "yo"}]
    dataset = SFTDataset(
        rows,
        tokenizer,
        max_prompt_length=32,
        max_response_length=8,
        prompt_key="question",
        response_key="answer",
        apply_chat_template=True,
    )
    assert list(dataset[0].prompt_ids) == chat_ids(tokenizer, rows[0]["question"])
    assert (
        tokenizer.decode(dataset[0].prompt_ids + dataset[0].response_ids)
        == "<bos><user>hi\n<assistant>yo<eos>"
    )


def test_sft_overlong_pairs_are_filtered_truncated_or_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "sft.jsonl", PAIRS)  # prompts 5 and 7 tokens; responses 2 and 3 with eos
    limits = {"max_prompt_length": 5, "max_response_length": 2}
    filtered = SFTDataset.from_files([path], tokenizer, **limits)
    assert len(filtered) == 1 and filtered.num_filtered == 1 and filtered.row_indices == (0,)
    truncated = SFTDataset.from_files([path], tokenizer, overlong="truncate", **limits)
    assert truncated.num_truncated == 1 and truncated.num_filtered == 0
    prompt = tokenizer("10+10=")["input_ids"]
    assert truncated[1] == SFTRow(
        tuple(prompt[-5:]), tuple(tokenizer("20", add_special_tokens=False)["input_ids"])
    )
    with pytest.raises(DataError) as caught:
        SFTDataset.from_files([path], tokenizer, overlong="error", **limits)
    assert str(caught.value) == (
        f"row 1 of '{path}' (data.train_files): the prompt is 7 tokens, longer than max_prompt_length "
        "(5) and the response is 3 tokens with its eos, longer than max_response_length (2): raise the "
        "limit, or drop such pairs (overlong='filter') or cut them (overlong='truncate')"
    )
    with pytest.raises(DataError, match=r"every pair \(2\) is longer than max_prompt_length \(2\)"):
        SFTDataset.from_files([path], tokenizer, max_prompt_length=2, max_response_length=8)
    with pytest.raises(DataError, match="overlong='drop': use one of filter, truncate, error"):
        SFTDataset(PAIRS, tokenizer, overlong="drop", **limits)


def test_sft_rows_need_a_string_response_and_the_tokenizer_an_eos(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "sft.jsonl", [PAIRS[0], {"prompt": "q", "answer": "a"}])
    with pytest.raises(DataError) as caught:
        SFTDataset.from_files([path], tokenizer, max_prompt_length=8, max_response_length=8)
    assert str(caught.value) == (
        f"row 1 of '{path}' (data.train_files) has no column 'response' (data.response_key); its columns: "
        "'prompt', 'answer'; set data.response_key to the column that holds it"
    )
    with pytest.raises(
        DataError, match=r"row 0 of data.train_files: 'response' is \['a'\] \(list\), not a response"
    ):
        SFTDataset(
            [{"prompt": "q", "response": ["a"]}], tokenizer, max_prompt_length=8, max_response_length=8
        )
    no_eos = make_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(DataError, match="the tokenizer has no eos token"):
        SFTDataset(PAIRS, no_eos, max_prompt_length=8, max_response_length=8)


# -- the sampler -----------------------------------------------------------------------------------

sizes = st.integers(min_value=1, max_value=40).flatmap(
    lambda rows: st.tuples(st.just(rows), st.integers(min_value=1, max_value=rows))
)


def take(sampler: EpochSampler, steps: int) -> list[SamplerBatch]:
    return [sampler.next_batch() for _ in range(steps)]


@given(sizes, st.booleans(), st.integers(-(2**40), 2**40), st.integers(0, 5))
def test_each_epoch_holds_each_row_at_most_once_in_full_batches_and_drops_the_remainder(
    size, shuffle, seed, epoch
):
    num_rows, batch_size = size
    sampler = EpochSampler(num_rows, batch_size, shuffle=shuffle, seed=seed)
    order = sampler.epoch_order(epoch)
    assert sorted(order) == list(range(num_rows))
    assert sampler.steps_per_epoch == num_rows // batch_size
    sampler.load_state_dict({**sampler.state_dict(), "epoch": epoch})
    batches = take(sampler, sampler.steps_per_epoch)
    assert [(b.epoch, b.step_in_epoch) for b in batches] == [
        (epoch, s) for s in range(sampler.steps_per_epoch)
    ]
    assert all(len(b.indices) == batch_size for b in batches)
    seen = [index for b in batches for index in b.indices]
    assert seen == list(order[: len(seen)]) and len(set(seen)) == len(seen)
    assert set(order) - set(seen) == set(
        order[sampler.steps_per_epoch * batch_size :]
    )  # the dropped remainder
    assert len(order) - len(seen) == num_rows % batch_size
    if not shuffle:
        assert order == tuple(range(num_rows))


@given(sizes, st.integers(-(2**40), 2**40))
def test_the_order_depends_on_the_seed_and_epoch_only(size, seed):
    num_rows, batch_size = size
    first, second = (
        EpochSampler(num_rows, batch_size, seed=seed),
        EpochSampler(num_rows, batch_size, seed=seed),
    )
    take(first, 3 * first.steps_per_epoch + 1)
    assert [first.epoch_order(e) for e in range(4)] == [second.epoch_order(e) for e in range(4)]
    assert take(EpochSampler(num_rows, batch_size, seed=seed), 7) == take(
        EpochSampler(num_rows, batch_size, seed=seed), 7
    )


@given(st.integers(10, 60), st.integers(0, 2**32), st.integers(0, 20))
def test_epochs_and_seeds_give_different_orders(num_rows, seed, epoch):
    sampler = EpochSampler(num_rows, 1, seed=seed)
    assert sampler.epoch_order(epoch) != sampler.epoch_order(epoch + 1)  # equal with probability 1 / 10!
    assert sampler.epoch_order(epoch) != EpochSampler(num_rows, 1, seed=seed + 1).epoch_order(epoch)
    assert EpochSampler(num_rows, 1, seed=-seed - 1).epoch_order(epoch) != EpochSampler(
        num_rows, 1, seed=seed + 1
    ).epoch_order(epoch)


@settings(max_examples=200)
@given(sizes, st.booleans(), st.integers(0, 2**20), st.integers(0, 60), st.integers(1, 30))
def test_resuming_from_any_state_gives_exactly_the_remaining_batches(size, shuffle, seed, done, more):
    num_rows, batch_size = size
    uninterrupted = EpochSampler(num_rows, batch_size, shuffle=shuffle, seed=seed)
    take(uninterrupted, done)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # what a checkpoint stores
    assert state["position"] < uninterrupted.steps_per_epoch  # an epoch's end is already the next epoch
    resumed = EpochSampler(num_rows, batch_size, shuffle=shuffle, seed=seed)
    resumed.load_state_dict(state)
    assert resumed.steps_taken == done
    assert take(resumed, more) == take(uninterrupted, more)


def test_a_checkpoint_at_an_epoch_boundary_resumes_into_the_next_epoch():
    """verl issue 7401: resuming there trained zero steps and exited 0."""
    sampler = EpochSampler(num_rows=10, batch_size=4, seed=3)  # 2 steps per epoch, 2 rows dropped
    epochs = 3
    first_epoch = take(sampler, sampler.steps_per_epoch)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = EpochSampler(num_rows=10, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    rest = take(resumed, sampler.total_steps(epochs) - resumed.steps_taken)
    assert len(rest) == 4 and [(b.epoch, b.step_in_epoch) for b in rest] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert rest == take(sampler, 4)
    assert rest[0].indices != first_epoch[0].indices
    # A state written at the end of an epoch's batches (position == steps_per_epoch) means the same.
    legacy = EpochSampler(num_rows=10, batch_size=4, seed=3)
    legacy.load_state_dict({**state, "epoch": 0, "position": 2})
    assert (legacy.epoch, legacy.position) == (1, 0) and legacy.next_batch() == rest[0]


def test_the_order_is_pinned_so_that_checkpoints_resume_across_versions():
    assert EpochSampler(10, 5, seed=0).epoch_order(0) == PINNED_ORDER_SEED_0_EPOCH_0


PINNED_ORDER_SEED_0_EPOCH_0 = (9, 8, 2, 5, 1, 7, 3, 0, 4, 6)


def test_the_sampler_leaves_the_global_random_state_alone():
    before = random.getstate()
    sampler = EpochSampler(50, 7, seed=1)
    take(sampler, 20)
    assert random.getstate() == before


def test_sampler_sizes_and_total_steps():
    sampler = EpochSampler(num_rows=10, batch_size=3)
    assert sampler.steps_per_epoch == 3 and sampler.total_steps(4) == 12 and sampler.total_steps(0) == 0
    with pytest.raises(DataError) as caught:
        EpochSampler(num_rows=6, batch_size=8)
    assert str(caught.value) == (
        "data.train_batch_size (8) is larger than the dataset (6 prompts after filtering): lower "
        "data.train_batch_size to at most 6, or add prompts"
    )
    with pytest.raises(DataError, match="the dataset is empty"):
        EpochSampler(num_rows=0, batch_size=1)
    with pytest.raises(DataError, match="data.train_batch_size must be > 0 prompts, got 0"):
        EpochSampler(num_rows=4, batch_size=0)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"num_rows": 12},
            "the dataset had 12 prompts (after filtering) at the checkpoint and has 10 now: the "
            "dataset changed since the checkpoint",
        ),
        (
            {"batch_size": 2},
            "data.train_batch_size was 2 at the checkpoint and is 4 now: the batch size changed "
            "since the checkpoint; set data.train_batch_size=2 to resume",
        ),
        ({"seed": 9}, "data.seed was 9 at the checkpoint and is 3 now: set data.seed=9"),
        ({"shuffle": False}, "data.shuffle was false at the checkpoint and is true now"),
        ({"position": 3}, "sampler state epoch=0, position=3 is out of range"),
        ({"epoch": -1}, "sampler state epoch=-1, position=0 is out of range"),
        ({"epoch": "1"}, "sampler state 'epoch' is '1', not an integer"),
        ({"shuffle": 1}, "sampler state 'shuffle' is 1, not a boolean"),
    ],
)
def test_a_state_that_does_not_fit_the_sampler_says_what_changed(change, words):
    sampler = EpochSampler(num_rows=10, batch_size=4, seed=3)
    with pytest.raises(DataError) as caught:
        sampler.load_state_dict({**sampler.state_dict(), **change})
    assert words in str(caught.value)
    assert (sampler.epoch, sampler.position) == (0, 0)  # unchanged


def test_a_state_missing_keys_is_named():
    sampler = EpochSampler(num_rows=10, batch_size=4)
    with pytest.raises(
        DataError, match="sampler state lacks seed, shuffle: it was not written by EpochSampler"
    ):
        sampler.load_state_dict({"epoch": 0, "position": 0, "num_rows": 10, "batch_size": 4})
    with pytest.raises(DataError, match="sampler state is a list, not a mapping"):
        sampler.load_state_dict([0, 0])


def test_validation_batches_cover_every_row_in_order():
    assert sequential_batches(5, None) == [range(5)]
    assert sequential_batches(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert sequential_batches(3, 8) == [range(3)]
    assert sequential_batches(0, None) == []
    with pytest.raises(DataError, match="data.val_batch_size must be > 0 prompts, got 0"):
        sequential_batches(5, 0)


# -- docs/training.md ------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def test_the_documented_examples_are_datasets_as_described(tmp_path, tokenizer, monkeypatch):
    text = DOCS.read_text()
    (jsonl,) = re.findall(r"```json\n(.*?)```", text, re.S)
    (parquet,) = re.findall(r"```python\n(.*?)```", text, re.S)
    (jsonl_path := tmp_path / "val.jsonl").write_text(jsonl)
    monkeypatch.chdir(tmp_path)
    exec(compile(parquet, str(DOCS), "exec"), {})
    train, val = load_prompt_datasets(
        DataConfig(train_files=["train.parquet"], val_files=[str(jsonl_path)], apply_chat_template=True),
        RolloutConfig(),
        tokenizer,
    )
    assert train[0].prompt_text == "<bos><system>Answer with a number.\n<user>What is 17 * 3?\n<assistant>"
    assert (
        [row.extra for row in train]
        == [row.extra for row in val]
        == [
            {"ground_truth": "51", "data_source": "arith"},
            {"ground_truth": "42", "data_source": "arith"},
        ]
    )


def test_the_documented_messages_are_the_ones_raised(tmp_path, tokenizer, monkeypatch):
    text = DOCS.read_text()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    rows = [{"prompt": "p"}] * 3 + [{"question": "q", "ground_truth": "a"}]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files(["data/train.jsonl"], tokenizer, max_prompt_length=8)
    assert f"\n{caught.value}\n" in text
    rows = [{"prompt": "p"}] * 17 + [{"prompt": "x" * 730}]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    with pytest.raises(DataError) as caught:
        PromptDataset.from_files(
            ["data/train.jsonl"], tokenizer, max_prompt_length=512, filter_overlong=False
        )
    assert f"\n{caught.value}\n" in text
    rows = [{"prompt": "p"}] * 950 + [{"prompt": "x" * 600}] * 50
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    summary = PromptDataset.from_files(["data/train.jsonl"], tokenizer, max_prompt_length=512).summary()
    assert (
        summary
        == "data.train_files: 950 prompts (50 of 1000 longer than rollout.prompt_length=512 filtered out)"
    )
    assert summary in " ".join(text.split())
