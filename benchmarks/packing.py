"""Padding-free micro-batches against padded ones: one forward/backward of the engine's
``forward_micro_batch`` on a batch of variable-length responses, side by side.

A tiny Qwen2 (hidden 256, 4 layers, built here from a config: nothing is downloaded) and 16
sequences: prompts of 16 to 64 tokens, responses of uniformly random length 8 to 512 (issue 7's
setting), in groups of 4 samples per prompt (``--group 1``: every prompt distinct). Each mode runs
a log-prob forward and its backward; real tokens (prompt + response, padding excluded) per second,
best of ``--rounds`` after a warm-up, and the ratio packed / padded. Run:
``python benchmarks/packing.py [--threads 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def make_batch(sequences: int, group: int, seed: int):
    """The batch contract for ``sequences`` rows: left-padded prompts, right-padded responses."""
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(2, 1000, (int(torch.randint(16, 65, (1,), generator=generator)),), generator=generator)
    ]
    for row in range(1, sequences):
        fresh = row % group == 0
        length = int(torch.randint(16, 65, (1,), generator=generator))
        prompts.append(torch.randint(2, 1000, (length,), generator=generator) if fresh else prompts[-1])
    responses = [
        torch.randint(2, 1000, (int(torch.randint(8, 513, (1,), generator=generator)),), generator=generator)
        for _ in range(sequences)
    ]
    width, length = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(sequences, width + length, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[row, width - len(prompt) : width] = prompt
        input_ids[row, width : width + len(response)] = response
        mask[row, width - len(prompt) : width + len(response)] = 1
    batch = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, width:],
        },
        batch_size=[sequences],
    )
    return batch, int(mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (1: all prompts distinct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_core.config.engine import ModelConfig
    from verl_core.toolkit import forward_micro_batch, load_hf_model

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    batch, real_tokens = make_batch(args.sequences, args.group, seed=0)
    padded_tokens = batch["input_ids"].numel()
    results = {"real_tokens": real_tokens, "padded_tokens": padded_tokens}
    with tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(scratch)
        for mode, packing in (("padded", False), ("packed", True)):
            model = load_hf_model(ModelConfig(path=scratch), "lm", packing=packing)

            def step(model=model, packing=packing) -> None:
                model.zero_grad(set_to_none=True)
                forward_micro_batch(model, batch, "lm", packing=packing)["log_probs"].sum().backward()

            step()  # warm-up
            best = float("inf")
            for _ in range(args.rounds):
                started = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - started)
            results[mode] = {"seconds": best, "tokens_per_s": real_tokens / best}
    results["ratio"] = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(
        f"{args.sequences} sequences ({args.group} per prompt), {real_tokens} real of {padded_tokens} padded "
        f"tokens, {args.threads} thread(s): padded {results['padded']['tokens_per_s']:.0f} tok/s "
        f"({results['padded']['seconds']:.3f} s), packed {results['packed']['tokens_per_s']:.0f} tok/s "
        f"({results['packed']['seconds']:.3f} s), ratio {results['ratio']:.2f}x"
    )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
