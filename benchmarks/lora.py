"""LoRA against full fine-tuning on the same model: optimiser-state bytes, checkpoint size and step time.

The same Hugging Face model (a Qwen2 built here from a config, nothing downloaded: hidden 512,
intermediate 1376, 8 layers, 8 attention heads, 2 KV heads, vocabulary 8192 with tied embeddings,
fp32), the same batch (16 sequences x 96 tokens, ``_common.policy_batch``) and loss
(``verl_core.testing.losses.policy_loss_fn``), the ddp engine in this process (one rank, no process
group), micro-batches of 4 sequences, AdamW. Sides: full fine-tuning, and LoRA at each
``--lora-ranks`` (``lora_alpha`` twice the rank, ``target_modules: all-linear``).

Per side: the optimiser state after one step (the bytes of every tensor AdamW keeps: its two moments
and the step counts), the size on disk of ``save_checkpoint``'s folder (model, optimiser, schedule and
RNG state), and ``train_batch``'s time: ``--rounds`` rounds of one step per side, the order of the
sides rotating each round (a disturbance hits every side alike), the median per side and the median
over rounds of the ratio LoRA / full. One torch thread (``--threads``). Run:

    python benchmarks/lora.py [--lora-ranks 8 64] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common
import torch

MODEL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
PROMPT_LENGTH, RESPONSE_LENGTH, SEQUENCES = 32, 64, 16
FULL = "full"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def folder_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def build(model_path: str, lora_rank: int) -> Any:
    lora = {"lora_rank": lora_rank, "lora_alpha": 2 * lora_rank} if lora_rank else {}
    return common.build_engine("ddp", model_path, micro_batch_size=4, model_options=lora)


def timed_step(engine: Any, batch: Any) -> float:
    from verl_core.testing.losses import policy_loss_fn

    started = time.perf_counter()
    with engine.train_mode():
        engine.train_batch(batch, policy_loss_fn)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common.quiet_transformers()

    with tempfile.TemporaryDirectory() as scratch:
        model_path, parameters = common.save_qwen2(scratch, **MODEL)
        batch = common.policy_batch(SEQUENCES, PROMPT_LENGTH, RESPONSE_LENGTH, MODEL["vocab_size"])
        sides = {FULL: 0} | {f"lora r={rank}": rank for rank in args.lora_ranks}
        engines = {name: build(model_path, rank) for name, rank in sides.items()}
        results: dict[str, dict[str, Any]] = {}
        for name, engine in engines.items():
            timed_step(engine, batch)  # warm-up; creates the optimiser state
            checkpoint = Path(scratch) / f"checkpoint-{sides[name]}"
            engine.save_checkpoint(str(checkpoint), global_step=1)
            results[name] = {
                "trainable_parameters": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
                "optimizer_state_bytes": optimizer_state_bytes(engine.optimizer),
                "checkpoint_bytes": folder_bytes(checkpoint),
                "step_s": [],
            }
        names = list(engines)
        for round_index in range(args.rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                results[name]["step_s"].append(timed_step(engines[name], batch))

    full = results[FULL]
    for result in results.values():
        result["step_s_median"] = statistics.median(result["step_s"])
        ratios = [lora / base for lora, base in zip(result["step_s"], full["step_s"], strict=True)]
        result["step_ratio"] = statistics.median(ratios)
        result["optimizer_ratio"] = result["optimizer_state_bytes"] / full["optimizer_state_bytes"]
        result["checkpoint_ratio"] = result["checkpoint_bytes"] / full["checkpoint_bytes"]
    if args.json:
        print(json.dumps({"parameters": parameters, "results": results}, indent=2))
        return
    print(f"Qwen2, {parameters:,} parameters, {SEQUENCES} x {PROMPT_LENGTH + RESPONSE_LENGTH} tokens, ddp")
    print(
        "| side | trainable | optimiser state | checkpoint | step (median) | vs full: optimiser, checkpoint, step |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['trainable_parameters']:,} | {r['optimizer_state_bytes'] / 2**20:.2f} MiB | "
            f"{r['checkpoint_bytes'] / 2**20:.2f} MiB | {r['step_s_median']:.3f} s | "
            f"{r['optimizer_ratio']:.4f}, {r['checkpoint_ratio']:.4f}, {r['step_ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
