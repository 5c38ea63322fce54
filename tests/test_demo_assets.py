"""The demo's assets (examples/demo/make_demo.py): they load offline, tokenise every prompt and answer
exactly, are reproducible from the seed, keep the splits disjoint, and the tiny model can learn the
task (a plain-PyTorch SFT run, no trainer), so that the demo's GRPO run has something to improve."""

from __future__ import annotations

import importlib.util
import random
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from verl_core.reward.builtin import digits as digits_reward

MAKE_DEMO = Path(__file__).parents[1] / "examples" / "demo" / "make_demo.py"


def _load_make_demo():
    """examples/demo/make_demo.py, loaded by path (examples/ is not a package), once per process."""
    if "make_demo" in sys.modules:
        return sys.modules["make_demo"]
    spec = importlib.util.spec_from_file_location("make_demo", MAKE_DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


md = _load_make_demo()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return md.build_demo(tmp_path_factory.mktemp("demo") / "out", seed=0)


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo.model, local_files_only=True)


def rows(demo, split: str) -> list[dict]:
    return md.read_jsonl(getattr(demo, split))


def digit_strings(demo, split: str) -> list[str]:
    return [row["prompt"][len(md.PROMPT_PREFIX) : -len(md.PROMPT_SUFFIX)] for row in rows(demo, split)]


# -- (a) offline loading, formats, tokenisation ----------------------------------------------------


def test_the_model_loads_offline_as_a_tiny_float32_qwen2(demo, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo.model, local_files_only=True)
    config = model.config
    assert config.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    assert config.vocab_size == len(tokenizer) == len(md.VOCAB)
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.tie_word_embeddings is False and config.max_position_embeddings == 64
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    generation = model.generation_config
    assert (generation.eos_token_id, generation.pad_token_id) == (tokenizer.eos_token_id, 0)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert 50_000 < md.count_parameters(model) < 150_000
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_the_tokenizer_loads_offline_with_pad_and_eos(demo, tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.convert_ids_to_tokens([0, 1]) == ["<pad>", "<eos>"]
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", 1)
    assert tokenizer.unk_token is None and tokenizer.bos_token is None
    assert tokenizer.encode("rev 3851=") == tokenizer.convert_tokens_to_ids(list("rev\u01203851="))
    # The plain loader of the saved tokenizer.json agrees with AutoTokenizer's class.
    plain = PreTrainedTokenizerFast.from_pretrained(demo.model, local_files_only=True)
    assert plain.encode("rev 3851=") == tokenizer.encode("rev 3851=")


def test_every_prompt_and_answer_round_trips_one_token_per_character(demo, tokenizer) -> None:
    texts = {row["prompt"] for split in ("sft", "train", "val") for row in rows(demo, split)}
    texts |= {row["ground_truth"] for split in ("train", "val") for row in rows(demo, split)}
    texts |= {row["response"] for row in rows(demo, "sft")}
    eos = tokenizer.eos_token_id
    for text in texts:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text) and tokenizer.decode(ids) == text, (text, ids)
        assert eos not in ids and tokenizer.pad_token_id not in ids
        assert tokenizer.decode([*ids, eos], skip_special_tokens=True) == text
    # A character outside the vocabulary would be dropped silently: build_demo refuses it.
    with pytest.raises(ValueError, match="does not round-trip 'rev x='"):
        md.check_round_trip(tokenizer, ["rev x="])


def test_the_rows_have_the_documented_format(demo) -> None:
    prompt = re.compile(r"rev ([0-9]{3,6})=")
    for split, size in (("train", 2000), ("val", 64)):
        split_rows = rows(demo, split)
        assert len(split_rows) == size
        for row in split_rows:
            assert set(row) == {"prompt", "ground_truth", "data_source"} and row["data_source"] == "reverse"
            assert row["ground_truth"] == prompt.fullmatch(row["prompt"])[1][::-1]
            assert digits_reward(row["prompt"], row["ground_truth"], row) == {"score": 1.0, "exact": 1.0}
    sft_rows = rows(demo, "sft")
    assert len(sft_rows) == 2000
    for row in sft_rows:
        assert set(row) == {"prompt", "response"}
        assert row["response"] == prompt.fullmatch(row["prompt"])[1][::-1]
    # Validation holds as many strings of each length; SFT and train draw on every length.
    val_lengths = [len(digits) for digits in digit_strings(demo, "val")]
    assert {n: val_lengths.count(n) for n in range(3, 7)} == {3: 16, 4: 16, 5: 16, 6: 16}
    for split in ("sft", "train"):
        assert {len(digits) for digits in digit_strings(demo, split)} == {3, 4, 5, 6}


# -- (b) determinism, (c) disjointness -----------------------------------------------------------


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


def test_the_same_seed_writes_the_same_files(demo, tmp_path) -> None:
    again = files_under(md.build_demo(tmp_path / "again", seed=0).root)
    first = files_under(demo.root)
    assert sorted(again) == sorted(first)
    assert {"model/config.json", "model/model.safetensors", "model/tokenizer.json", "data/val.jsonl"} <= set(
        first
    )
    assert [name for name in first if again[name] != first[name]] == []
    other = files_under(md.build_demo(tmp_path / "other", seed=1).root)
    assert {name for name in first if other[name] != first[name]} >= {
        "model/model.safetensors",
        "data/sft.jsonl",
        "data/train.jsonl",
        "data/val.jsonl",
    }


def test_the_splits_use_disjoint_digit_strings(demo) -> None:
    splits = {split: digit_strings(demo, split) for split in ("sft", "train", "val")}
    for split, strings in splits.items():
        assert len(set(strings)) == len(strings), f"{split} repeats a digit string"
    assert not set(splits["sft"]) & set(splits["train"])
    assert not set(splits["sft"]) & set(splits["val"])
    assert not set(splits["train"]) & set(splits["val"])


def test_make_splits_shares_out_short_strings_and_refuses_too_many() -> None:
    # Only 1000 strings of 3 digits: all are used and none twice; SFT takes what is left over.
    task = md.TaskSpec(min_digits=3, max_digits=4, sft_size=1200, train_size=900, val_size=64)
    splits = md.make_splits(task)
    every = [digits for strings in splits.values() for digits in strings]
    assert len(set(every)) == len(every) == 2164
    assert sum(len(digits) == 3 for digits in every) == 1000
    assert [sum(len(digits) == 3 for digits in splits[split]) for split in ("val", "train", "sft")] == [
        32,
        450,
        518,
    ]
    with pytest.raises(ValueError, match="not enough distinct digit strings"):
        md.make_splits(md.TaskSpec(min_digits=3, max_digits=3, sft_size=600, train_size=400, val_size=64))


def test_the_command_line_builds_wider_heads_and_refuses_shapes_that_do_not_divide(tmp_path, capsys) -> None:
    """Heads of 32 dimensions (what vLLM's CPU attention needs), and head counts that do not divide
    refused by the parser, naming the option, before anything is written."""
    import json

    assert (
        md.main([str(tmp_path / "wide"), "--attention-heads", "2", "--kv-heads", "1", "--sft-size", "8"]) == 0
    )
    config = json.loads((tmp_path / "wide" / "model" / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32 and config["num_key_value_heads"] == 1
    for arguments, message in [
        (["--attention-heads", "3"], "must be a multiple of the attention heads (3): change --hidden-size"),
        (["--kv-heads", "3"], "must be a multiple of the key/value heads (3): change --kv-heads"),
    ]:
        with pytest.raises(SystemExit):
            md.main([str(tmp_path / "bad"), *arguments])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_the_command_line_writes_smaller_tasks(tmp_path, capsys) -> None:
    sizes = [
        "--sft-size",
        "40",
        "--train-size",
        "30",
        "--val-size",
        "8",
        "--min-digits",
        "3",
        "--max-digits",
        "4",
    ]
    assert md.main([str(tmp_path / "small"), "--seed", "3", *sizes]) == 0
    printed = capsys.readouterr().out
    assert "76,480 parameters" in printed and "(8 rows)" in printed
    assert len(md.read_jsonl(tmp_path / "small" / "data" / "sft.jsonl")) == 40
    assert {len(row["ground_truth"]) for row in md.read_jsonl(tmp_path / "small" / "data" / "val.jsonl")} == {
        3,
        4,
    }


# -- (d) learnability ----------------------------------------------------------------------------

SFT_STEPS = 300
SFT_BATCH = 64
SFT_LR = 2e-3
EVAL_PROMPTS = 32


@torch.no_grad()
def greedy_scores(model, tokenizer, val_rows: list[dict], max_new_tokens: int) -> tuple[float, float]:
    """Mean ``digits`` score and exact-match rate of greedy answers (up to eos) to ``val_rows``.

    Prompts of one length are decoded together, so that nothing is padded."""
    model.eval()
    by_length: dict[int, list[dict]] = {}
    for row in val_rows:
        by_length.setdefault(len(row["prompt"]), []).append(row)
    scores = []
    for length, group in by_length.items():
        ids = torch.tensor([tokenizer.encode(row["prompt"]) for row in group])
        for _ in range(max_new_tokens):
            next_ids = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(dim=-1)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
        for row, response in zip(group, ids[:, length:].tolist(), strict=True):
            if tokenizer.eos_token_id in response:
                response = response[: response.index(tokenizer.eos_token_id)]
            scores.append(digits_reward(row["prompt"], tokenizer.decode(response), row))
    model.train()
    return (
        sum(score["score"] for score in scores) / len(scores),
        sum(score["exact"] for score in scores) / len(scores),
    )


def sft_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and labels (-100 off the response tokens)."""
    width = max(len(prompt) + len(response) for prompt, response in pairs)
    input_ids = torch.full((len(pairs), width), pad_id)
    attention_mask = torch.zeros(len(pairs), width, dtype=torch.int64)
    labels = torch.full((len(pairs), width), -100)
    for row, (prompt, response) in enumerate(pairs):
        end = len(prompt) + len(response)
        input_ids[row, :end] = torch.tensor(prompt + response)
        attention_mask[row, :end] = 1
        labels[row, len(prompt) : end] = torch.tensor(response)
    return input_ids, attention_mask, labels


def test_a_short_sft_run_teaches_the_tiny_model_the_task(demo, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(demo.model, local_files_only=True)
        val_rows = rows(demo, "val")[:EVAL_PROMPTS]
        max_new_tokens = md.TaskSpec().max_digits + 1
        untrained, untrained_exact = greedy_scores(model, tokenizer, val_rows, max_new_tokens)
        pairs = [
            (tokenizer.encode(row["prompt"]), [*tokenizer.encode(row["response"]), tokenizer.eos_token_id])
            for row in rows(demo, "sft")
        ]
        optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
        order = random.Random(0)
        losses = []
        start = time.perf_counter()
        for _ in range(SFT_STEPS):
            input_ids, attention_mask, labels = sft_batch(
                order.sample(pairs, SFT_BATCH), tokenizer.pad_token_id
            )
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warmup.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        trained, trained_exact = greedy_scores(model, tokenizer, val_rows, max_new_tokens)
    finally:
        torch.set_num_threads(threads)
    figures = (
        f"digits score {untrained:.3f} -> {trained:.3f}, exact {untrained_exact:.3f} -> {trained_exact:.3f}, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {SFT_STEPS} steps in {seconds:.1f} s"
    )
    print(figures)
    assert trained >= untrained + 0.2, figures
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20, figures
