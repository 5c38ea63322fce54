"""The demo's GRPO with the vLLM rollout, against the built-in ``hf`` rollout's seed spread.

    python verl_vllm_plugin/scripts/demo_acceptance.py runs/vllm_demo --runs hf:0,1,2 vllm:0,1

Builds the demo (``examples/demo/make_demo.py``) with heads of 32 dimensions, which vLLM's CPU attention
needs (``--attention-heads 2 --kv-heads 1``), warms it up with the demo's SFT, then runs the demo's GRPO
(``examples/grpo.yaml``: fsdp on 2 ranks under Ray, 150 steps) once per backend and seed, each in its
own folder under the output folder (a run whose ``metrics.jsonl`` is complete is not run again:
``--fresh`` starts over). Prints each run's validation score before and after GRPO and its wall time,
the ``hf`` runs' spread of final scores, and whether every other run's final score lies within it
(``above`` it: trained further than any ``hf`` seed). Exits 1 when one lies below it (or when a run
fails). Needs verl-core, verl-fsdp-plugin, this plugin and
vLLM (``docs/backends/vllm.md``) in the environment; takes about 3 minutes a run on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: What ``--set`` gives the ``vllm`` runs unless told otherwise: the demo's prompts and responses fit in
#: 24 tokens, so a small cache holds a rank's whole share of a step.
VLLM_DEFAULTS = ("rollout.vllm.max_model_len=32",)


def run(command: list[str], log: Path) -> float:
    """Run ``command`` with its output in ``log``; its wall time in seconds. Exits on failure."""
    started = time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if result.returncode:
        sys.exit(f"{' '.join(command[:3])} ... failed (exit {result.returncode}); its output: {log}")
    return time.perf_counter() - started


def scores(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation mean score) of a run, in order."""
    from verl_core.trainer.run_files import METRICS_FILE, read_records

    records = read_records(run_dir / METRICS_FILE)
    return [(r["step"], r["val/score/mean"]) for r in records if r.get("val/score/mean") is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder for the demo's assets and every run")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["hf:0,1,2", "vllm:0,1"],
        help="BACKEND:SEED,SEED,... (trainer.seed); the hf runs give the spread (default: hf:0,1,2 vllm:0,1)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="BACKEND:KEY=VALUE",
        help=f"an override for one backend's runs (default for vllm: {', '.join(VLLM_DEFAULTS)})",
    )
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps (trainer.total_training_steps)")
    parser.add_argument("--fresh", action="store_true", help="delete the output folder first")
    args = parser.parse_args(argv)

    plan = []
    for item in args.runs:
        backend, _, seeds = item.partition(":")
        if not backend or not seeds:
            parser.error(f"--runs {item!r}: expected BACKEND:SEED,SEED (hf:0,1,2)")
        plan += [(backend, int(seed)) for seed in seeds.split(",")]
    if "hf" not in {backend for backend, _ in plan}:
        parser.error("--runs: the hf runs give the spread the others are held to: add hf:SEEDS")
    overrides: dict[str, list[str]] = {"vllm": list(VLLM_DEFAULTS)}
    for item in args.set:
        backend, _, override = item.partition(":")
        if "=" not in override:
            parser.error(f"--set {item!r}: expected BACKEND:KEY=VALUE (vllm:rollout.vllm.max_model_len=32)")
        overrides.setdefault(backend, []).append(override)

    out = args.out.resolve()
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    if not (out / "model" / "config.json").exists():
        command = [
            sys.executable,
            "examples/demo/make_demo.py",
            str(out),
            "--attention-heads",
            "2",
            "--kv-heads",
            "1",
        ]
        run(command, out / "make_demo.log")
    sft = out / "sft"
    if not (sft / "hf_model" / "config.json").exists():
        run(
            [
                "verl-core",
                "sft",
                "examples/demo/sft.yaml",
                f"actor.engine.model.path={out / 'model'}",
                f"data.train_files=[{data / 'sft.jsonl'}]",
                f"trainer.run_dir={sft}",
                f"trainer.checkpoint_dir={sft / 'checkpoints'}",
            ],
            out / "sft.log",
        )

    rows = []
    for backend, seed in plan:
        run_dir = out / f"grpo-{backend}-seed{seed}"
        done = scores(run_dir)
        wall = float("nan")
        if not done or done[-1][0] != args.steps:
            shutil.rmtree(run_dir, ignore_errors=True)
            wall = run(
                [
                    "verl-core",
                    "train",
                    "examples/grpo.yaml",
                    f"actor.engine.model.path={sft / 'hf_model'}",
                    f"data.train_files=[{data / 'train.jsonl'}]",
                    f"data.val_files=[{data / 'val.jsonl'}]",
                    f"rollout.backend={backend}",
                    f"trainer.seed={seed}",
                    f"trainer.total_training_steps={args.steps}",
                    f"trainer.run_dir={run_dir}",
                    f"trainer.checkpoint_dir={run_dir / 'checkpoints'}",
                    "trainer.save_freq=0",
                    "trainer.logger=[]",
                    *overrides.get(backend, []),
                ],
                out / f"grpo-{backend}-seed{seed}.log",
            )
            done = scores(run_dir)
        (_, before), (_, after) = done[0], done[-1]
        rows.append((backend, seed, before, after, wall))

    spread = [after for backend, _, _, after, _ in rows if backend == "hf"]
    low, high = min(spread), max(spread)
    print(f"{'backend':<8} {'seed':>4} {'val before':>10} {'val after':>9} {'wall s':>7}  within hf's spread")
    failed = False
    for backend, seed, before, after, wall in rows:
        verdict = (
            "" if backend == "hf" else "yes" if low <= after <= high else "above" if after > high else "NO"
        )
        failed |= verdict == "NO"
        print(f"{backend:<8} {seed:>4} {before:>10.3f} {after:>9.3f} {wall:>7.0f}  {verdict}")
    print(f"hf spread of final scores over {len(spread)} seeds: [{low:.3f}, {high:.3f}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
