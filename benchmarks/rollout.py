"""The built-in rollout's decoding loop against ``model.generate``, side by side, on the demo's model.

Same prompts, same sampling (temperature 1, no top-k / top-p filtering), same maximum length; each
side's generated tokens per second over a few rounds (the best round counts: the machine is shared),
and their ratio. Run: ``python benchmarks/rollout.py [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS, NEW_TOKENS, ROUNDS = 64, 32, 3


def _make_demo():
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "examples" / "demo" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module
    spec.loader.exec_module(module)
    return module


def ours(rollout, prompts, sampling, seed: int) -> int:
    """Tokens the built-in rollout generated."""
    return int(rollout.generate(prompts, sampling, seed)["response_mask"].sum())


def hf_generate(model, ids, mask, tokenizer, seed: int) -> int:
    """Tokens ``model.generate`` generated, up to and including each row's EOS."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, ids.shape[1] :]
    ended = (new == tokenizer.eos_token_id).cumsum(-1)
    return int(((ended == 0) | ((ended == 1) & (new == tokenizer.eos_token_id))).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.config.engine import ModelConfig
    from verl_core.rollout.base import SamplingParams
    from verl_core.rollout.hf import HFRollout

    make_demo = _make_demo()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, spec in {
            "0.5M": make_demo.ModelSpec(hidden_size=128, intermediate_size=512, num_hidden_layers=2),
            "4M": make_demo.ModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4),
        }.items():
            paths = make_demo.build_demo(Path(scratch) / label, model_spec=spec)
            tokenizer = AutoTokenizer.from_pretrained(str(paths.model), local_files_only=True)
            prompts = [
                tokenizer(row["prompt"])["input_ids"] for row in make_demo.read_jsonl(paths.train)[:PROMPTS]
            ]
            sampling = SamplingParams(
                NEW_TOKENS, (tokenizer.eos_token_id,), tokenizer.pad_token_id, temperature=1.0
            )
            rollout = HFRollout(ModelConfig(path=str(paths.model)))
            rollout.initialize()
            model = AutoModelForCausalLM.from_pretrained(str(paths.model), local_files_only=True).eval()
            width = max(map(len, prompts))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = (
                torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
            ).long()

            runs = {
                "verl-core rollout": functools.partial(ours, rollout, prompts, sampling),
                "model.generate": functools.partial(hf_generate, model, ids, mask, tokenizer),
            }
            sides = {}
            for name, run in runs.items():
                run(0)  # warm-up
                best = 0.0
                for seed in range(1, ROUNDS + 1):
                    started = time.perf_counter()
                    tokens = run(seed)
                    best = max(best, tokens / (time.perf_counter() - started))
                sides[name] = best
            ratio = sides["verl-core rollout"] / sides["model.generate"]
            results[label] = {
                **sides,
                "ratio": ratio,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
            print(
                f"{label} ({results[label]['parameters']:,} parameters), {PROMPTS} prompts x up to {NEW_TOKENS} "
                f"tokens: verl-core rollout {sides['verl-core rollout']:.0f} tok/s, model.generate "
                f"{sides['model.generate']:.0f} tok/s, ratio {ratio:.2f}x"
            )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
