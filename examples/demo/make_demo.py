"""Build the demo's assets: a tiny Qwen2 model, a character tokenizer and the digit-reversal task.

    python examples/demo/make_demo.py OUT_DIR [--seed 0] [--min-digits 3] [--max-digits 6] ...

writes, with nothing downloaded:

- ``OUT_DIR/model/``: a Hugging Face folder (``save_pretrained``) holding a randomly initialised
  tiny Qwen2 causal LM (float32, seeded) and its character-level tokenizer; both load with
  ``from_pretrained(path, local_files_only=True)``.
- ``OUT_DIR/data/{sft,train,val}.jsonl``: the task. A prompt is ``"rev "``, the digits, then
  ``"="`` (``"rev 3851="``); the answer is the digits reversed (``"1583"``). Train and val rows are
  ``{"prompt", "ground_truth", "data_source": "reverse"}`` (scored by ``reward.function: digits``),
  SFT rows ``{"prompt", "response"}`` (the trainer appends eos to the response). The three splits
  use disjoint digit strings.

Also importable (``build_demo``, ``build_tokenizer``, ``build_model``, ``make_splits``): the tests
build the assets in a temporary folder with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

#: The prompt is ``PROMPT_PREFIX + digits + PROMPT_SUFFIX``; the answer is the digits reversed.
PROMPT_PREFIX = "rev "
PROMPT_SUFFIX = "="
DATA_SOURCE = "reverse"
DIGITS = "0123456789"
#: Digit strings are drawn as integers below ``10**n`` with ``random.sample``, whose population size
#: must fit in 64 bits: 18 digits at most.
MAX_DIGITS = 18

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
#: Every character a prompt or an answer can hold, one token each.
CHARACTERS = tuple(DIGITS) + tuple(sorted(set(PROMPT_PREFIX + PROMPT_SUFFIX)))
#: How the tokenizer's vocabulary spells a character: byte-level, as Qwen2's tokenizer does (a space
#: is ``"Ġ"``; digits, letters and ``=`` are themselves).
_BYTE_LEVEL = {" ": "\u0120"}
#: The vocabulary in id order: the special tokens first (``<pad>`` is id 0, ``<eos>`` id 1), then the
#: characters. There is no ``<unk>`` token.
VOCAB = SPECIAL_TOKENS + tuple(_BYTE_LEVEL.get(char, char) for char in CHARACTERS)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The tiny Qwen2's shape (about 0.08M parameters with the defaults)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of the attention heads "
                f"({self.num_attention_heads}): change --hidden-size or --attention-heads"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"the attention heads ({self.num_attention_heads}) must be a multiple of the key/value "
                f"heads ({self.num_key_value_heads}): change --kv-heads"
            )


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The digit-reversal task: string lengths (inclusive) and rows per split."""

    min_digits: int = 3
    max_digits: int = 6
    sft_size: int = 2000
    train_size: int = 2000
    val_size: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got min_digits={self.min_digits}, "
                f"max_digits={self.max_digits}"
            )
        if self.max_digits > MAX_DIGITS:
            raise ValueError(f"max_digits={self.max_digits}: at most {MAX_DIGITS} digits are supported")
        for name in ("sft_size", "train_size", "val_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def lengths(self) -> list[int]:
        return list(range(self.min_digits, self.max_digits + 1))


def make_prompt(digits: str) -> str:
    """``"rev 3851="`` for ``"3851"``."""
    return f"{PROMPT_PREFIX}{digits}{PROMPT_SUFFIX}"


def answer(digits: str) -> str:
    """The reversal: ``"1583"`` for ``"3851"``."""
    return digits[::-1]


# -- data ----------------------------------------------------------------------------------------


def _even_counts(count: int, lengths: list[int], room: dict[int, int]) -> dict[int, int]:
    """``count`` rows spread evenly over ``lengths``, none taking more than its ``room`` (distinct
    strings still unused); what a full length cannot take goes to the others (water-filling)."""
    counts = dict.fromkeys(lengths, 0)
    left = count
    while left:
        open_lengths = [n for n in lengths if counts[n] < room[n]]
        if not open_lengths:
            raise ValueError(
                f"not enough distinct digit strings of lengths {lengths[0]}-{lengths[-1]} for the "
                "requested split sizes: lower the sizes or allow longer strings (--max-digits)"
            )
        share, extra = divmod(left, len(open_lengths))
        # The remainder goes to the longest lengths, which have the most room.
        for index, n in enumerate(reversed(open_lengths)):
            take = min(share + (index < extra), room[n] - counts[n])
            counts[n] += take
            left -= take
    return counts


def make_splits(task: TaskSpec = TaskSpec(), seed: int = 0) -> dict[str, list[str]]:
    """The digit strings of each split (``val``, ``train``, ``sft``), seeded and pairwise disjoint.

    Each split holds (about) as many strings of every length; val is allotted first, then train,
    then SFT, so that only SFT's mix shifts when short strings run out (there are only 1000 of
    length 3: the defaults use all of them). Leading zeros are allowed (``"0421"``).
    """
    rng = random.Random(seed)
    lengths = task.lengths
    room = {n: 10**n for n in lengths}
    allotted: dict[str, dict[int, int]] = {}
    for split, size in (("val", task.val_size), ("train", task.train_size), ("sft", task.sft_size)):
        allotted[split] = _even_counts(size, lengths, room)
        for n in lengths:
            room[n] -= allotted[split][n]
    splits: dict[str, list[str]] = {split: [] for split in allotted}
    for n in lengths:
        wanted = sum(counts[n] for counts in allotted.values())
        drawn = [str(value).zfill(n) for value in rng.sample(range(10**n), wanted)]
        for split, counts in allotted.items():
            splits[split] += drawn[: counts[n]]
            drawn = drawn[counts[n] :]
    for strings in splits.values():
        rng.shuffle(strings)
    return splits


def rl_row(digits: str) -> dict[str, str]:
    """A train/val row, scored by the ``digits`` reward against ``ground_truth``."""
    return {"prompt": make_prompt(digits), "ground_truth": answer(digits), "data_source": DATA_SOURCE}


def sft_row(digits: str) -> dict[str, str]:
    """An SFT row: the response is the bare answer (the trainer appends eos)."""
    return {"prompt": make_prompt(digits), "response": answer(digits)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


# -- tokenizer and model -------------------------------------------------------------------------


def build_tokenizer(max_length: int = ModelSpec.max_position_embeddings):
    """The character-level tokenizer: one token per character of ``CHARACTERS``, no merges.

    It is a ``Qwen2Tokenizer`` (a ``PreTrainedTokenizerFast``) over a byte-level vocabulary of single
    characters, because that is what ``AutoTokenizer`` returns for a folder whose ``config.json``
    says ``qwen2``: transformers 5 always picks that class for Qwen2 and rebuilds its pipeline (Qwen's
    pre-tokenizer split, byte-level mapping, BPE) from ``tokenizer.json``'s vocabulary and merges,
    ignoring the pipeline saved there. A WordLevel tokenizer would load as a different tokenizer (its
    spaces silently dropped). Built this way, the saved tokenizer and the loaded one are the same.

    ``encode`` adds no special tokens (the trainer appends eos to SFT responses); ``decode``
    concatenates characters. A character outside the vocabulary is dropped by ``encode`` (Qwen2's
    BPE has no unknown token): ``build_demo`` checks that every prompt and answer round-trips.
    """
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(
        vocab={token: index for index, token in enumerate(VOCAB)},
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def check_round_trip(tokenizer, texts) -> None:
    """Raise ``ValueError`` unless every text encodes to one token per character and decodes back."""
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != len(text) or tokenizer.decode(ids) != text:
            raise ValueError(
                f"the demo tokenizer does not round-trip {text!r} (ids {ids}): every character must be "
                f"one of {''.join(CHARACTERS)!r}"
            )


def build_model(tokenizer, spec: ModelSpec = ModelSpec(), seed: int = 0):
    """The tiny Qwen2 causal LM, randomly initialised from ``seed`` (the global RNG is untouched)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def count_parameters(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


@dataclasses.dataclass(frozen=True)
class DemoPaths:
    """Where ``build_demo`` wrote the assets."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def sft(self) -> Path:
        return self.root / "data" / "sft.jsonl"

    @property
    def train(self) -> Path:
        return self.root / "data" / "train.jsonl"

    @property
    def val(self) -> Path:
        return self.root / "data" / "val.jsonl"


def build_demo(
    out_dir: str | Path,
    seed: int = 0,
    task: TaskSpec = TaskSpec(),
    model_spec: ModelSpec = ModelSpec(),
) -> DemoPaths:
    """Write the model folder and the three data files under ``out_dir``; the same ``seed`` (and
    specs) gives byte-identical files."""
    longest = len(make_prompt("0" * task.max_digits)) + task.max_digits + 1  # + eos
    if longest > model_spec.max_position_embeddings:
        raise ValueError(
            f"a prompt and response of {task.max_digits} digits take {longest} tokens, more than "
            f"max_position_embeddings={model_spec.max_position_embeddings}"
        )
    paths = DemoPaths(Path(out_dir))
    tokenizer = build_tokenizer(model_spec.max_position_embeddings)
    model = build_model(tokenizer, model_spec, seed)
    model.save_pretrained(paths.model)
    tokenizer.save_pretrained(paths.model)
    splits = make_splits(task, seed)
    every = [digits for strings in splits.values() for digits in strings]
    check_round_trip(tokenizer, [text for digits in every for text in (make_prompt(digits), answer(digits))])
    write_jsonl(paths.sft, [sft_row(digits) for digits in splits["sft"]])
    write_jsonl(paths.train, [rl_row(digits) for digits in splits["train"]])
    write_jsonl(paths.val, [rl_row(digits) for digits in splits["val"]])
    return paths


def main(argv: list[str] | None = None) -> int:
    defaults_task, defaults_model = TaskSpec(), ModelSpec()
    parser = argparse.ArgumentParser(
        description="Build the demo's tiny Qwen2 model, character tokenizer and digit-reversal data."
    )
    parser.add_argument("out_dir", type=Path, help="where model/ and data/ are written")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the data (default 0)")
    parser.add_argument("--min-digits", type=int, default=defaults_task.min_digits)
    parser.add_argument("--max-digits", type=int, default=defaults_task.max_digits)
    parser.add_argument("--sft-size", type=int, default=defaults_task.sft_size, help="SFT rows")
    parser.add_argument("--train-size", type=int, default=defaults_task.train_size, help="GRPO train rows")
    parser.add_argument("--val-size", type=int, default=defaults_task.val_size, help="validation rows")
    parser.add_argument("--hidden-size", type=int, default=defaults_model.hidden_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults_model.intermediate_size)
    parser.add_argument("--num-layers", type=int, default=defaults_model.num_hidden_layers)
    # vLLM's CPU attention needs heads of 32 dimensions or more: --attention-heads 2 --kv-heads 1 with
    # the default width (docs/backends/vllm.md).
    parser.add_argument("--attention-heads", type=int, default=defaults_model.num_attention_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults_model.num_key_value_heads)
    args = parser.parse_args(argv)
    try:
        task = TaskSpec(
            min_digits=args.min_digits,
            max_digits=args.max_digits,
            sft_size=args.sft_size,
            train_size=args.train_size,
            val_size=args.val_size,
        )
        model_spec = ModelSpec(
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers,
            num_attention_heads=args.attention_heads,
            num_key_value_heads=args.kv_heads,
        )
        paths = build_demo(args.out_dir, seed=args.seed, task=task, model_spec=model_spec)
    except ValueError as error:
        parser.error(str(error))
    from transformers import AutoModelForCausalLM

    parameters = count_parameters(AutoModelForCausalLM.from_pretrained(paths.model, local_files_only=True))
    print(f"model: {paths.model} ({parameters:,} parameters, vocabulary of {len(VOCAB)} tokens)")
    for name in ("sft", "train", "val"):
        path = getattr(paths, name)
        print(f"data:  {path} ({len(read_jsonl(path))} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
