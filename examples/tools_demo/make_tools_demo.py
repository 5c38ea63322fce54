"""The tools demo's assets: a task only a tool can solve, a tiny chat model, and scripted tool-use traces.

The task: ``value of qk?`` asks for the value of a key in a table the model never sees; the tool
``get(k)`` (in the written ``tools.py``) looks it up. A model without the tool can only guess one of
900 values; with it, it has to call ``get`` with the key copied from the question, then copy the
tool's answer. The SFT rows are the two assistant turns of scripted traces on keys of their own;
GRPO and validation use other keys.

    nox -s tools_demo     (these assets, the SFT warm-up, GRPO, the scores with and without the tool)

The tokenizer has one token per character (lower-case letters, digits, the characters of the JSON
of a call) plus the ChatML tokens and ``<tool_call>`` / ``</tool_call>``, with a ChatML chat template
and ``<|im_end|>`` as EOS; the model is the demo's tiny Qwen2 (examples/demo/make_demo.py) over it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import string
import sys
from pathlib import Path

START, END, PAD = "<|im_start|>", "<|im_end|>", "<pad>"
CALL_TOKENS = ("<tool_call>", "</tool_call>")
CHARACTERS = string.ascii_lowercase + string.digits + ' {}":,?\n'
TEMPLATE = (
    "{% for m in messages %}" + START + "{{ m['role'] }}\n{{ m['content'] }}" + END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + START + "assistant\n{% endif %}"
)
TOOLS_SOURCE = '''"""The tools demo's one tool: the hidden table (written by make_tools_demo.py)."""

import json
from pathlib import Path

TABLE = json.loads((Path(__file__).parent / "table.json").read_text())


def get(k):
    """The value of key ``k``."""
    return TABLE.get(str(k), "unknown key")
'''
#: Tokens of a whole traced conversation at most (prompt, call, tool answer, answer).
MAX_POSITIONS = 160


def make_demo_module():
    path = Path(__file__).parents[1] / "demo" / "make_demo.py"
    spec = importlib.util.spec_from_file_location("make_demo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module
    spec.loader.exec_module(module)
    return module


def build_tokenizer():
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_level = bytes_to_unicode()
    vocab = [PAD, END, START, *CALL_TOKENS] + [byte_level[ord(c)] for c in CHARACTERS]
    tokenizer = Qwen2Tokenizer(
        vocab={token: index for index, token in enumerate(vocab)},
        merges=[],
        unk_token=None,
        bos_token=None,
        eos_token=END,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [START]})
    tokenizer.add_tokens(list(CALL_TOKENS))  # kept when decoding: the environment parses them
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def question(key: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"value of {key}?"}]


def call(key: str) -> str:
    arguments = json.dumps({"name": "get", "arguments": {"k": key}}, separators=(",", ":"))
    return f"{CALL_TOKENS[0]}{arguments}{CALL_TOKENS[1]}"


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def sft_rows(tokenizer, key: str, value: str) -> list[dict[str, str]]:
    """The trace's two assistant turns as prompt/response rows (the SFT trainer appends the EOS)."""
    asked = question(key)
    answered = [*asked, {"role": "assistant", "content": call(key)}, {"role": "tool", "content": value}]
    return [
        {"prompt": render(tokenizer, asked), "response": call(key)},
        {"prompt": render(tokenizer, answered), "response": value},
    ]


def build(
    out_dir: Path, seed: int = 0, sft_keys: int = 400, train_keys: int = 212, val_keys: int = 64
) -> None:
    """Keys are the 676 pairs of letters: the splits take 400, 212 and 64 of them, disjoint."""
    rng = random.Random(seed)
    keys = ["".join(pair) for pair in itertools.product(string.ascii_lowercase, repeat=2)]
    rng.shuffle(keys)
    table = {key: str(rng.randrange(100, 1000)) for key in keys}
    splits = {"sft": keys[:sft_keys], "train": keys[sft_keys : sft_keys + train_keys]}
    splits["val"] = keys[sft_keys + train_keys : sft_keys + train_keys + val_keys]

    make_demo = make_demo_module()
    tokenizer = build_tokenizer()
    spec = make_demo.ModelSpec(
        hidden_size=96, intermediate_size=192, num_hidden_layers=3, max_position_embeddings=MAX_POSITIONS
    )
    model = make_demo.build_model(tokenizer, spec, seed)
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    (out_dir / "table.json").write_text(json.dumps(table, sort_keys=True))
    (out_dir / "tools.py").write_text(TOOLS_SOURCE)
    data = out_dir / "data"
    sft = [row for key in splits["sft"] for row in sft_rows(tokenizer, key, table[key])]
    make_demo.write_jsonl(data / "sft.jsonl", sft)
    for split in ("train", "val"):
        rows = [{"prompt": question(key), "ground_truth": table[key]} for key in splits[split]]
        make_demo.write_jsonl(data / f"{split}.jsonl", rows)
    longest = max(len(tokenizer.encode(row["prompt"] + row["response"])) + 1 for row in sft)
    assert longest <= MAX_POSITIONS, longest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the tools demo's model, tokenizer, tool and data.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(args.out_dir, args.seed)
    print(f"tools demo assets in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
