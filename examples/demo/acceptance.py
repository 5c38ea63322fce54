"""The demo's GRPO over seeds and variants, held to a reference variant's seed spread: what the demo's
acceptance scripts share (``verl_vllm_plugin/scripts/demo_acceptance.py``: the ``vllm`` rollout against
``hf``; ``benchmarks/async.py --acceptance``: the asynchronous modes against ``sync``). Not a script.

``prepare`` builds the demo (``examples/demo/make_demo.py``) and warms it up with the demo's SFT
(``examples/demo/sft.yaml``) under an output folder; ``train`` runs the demo's GRPO
(``examples/grpo.yaml``: fsdp on 2 ranks under Ray) once for a variant (its overrides) and seed
(``trainer.seed``), in a folder of its own, and reads its validation score before and after; a run whose
``metrics.jsonl`` is complete is not run again. ``report`` prints each run, the reference variant's
spread of final scores, and whether every other run's final score lies within it (``above`` it:
trained further than any reference seed).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]


class Demo(NamedTuple):
    """The built demo under an output folder: the SFT warm-up's export and the data folder."""

    out: Path
    sft_model: Path
    data: Path


class Result(NamedTuple):
    """One GRPO run: the validation score before and after it, its wall time (NaN when it was complete
    already) and its folder."""

    variant: str
    seed: int
    before: float
    after: float
    wall_s: float
    run_dir: Path


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


def prepare(out: Path, make_demo_options: Sequence[str] = ()) -> Demo:
    """The demo's model and data under ``out`` (``make_demo.py`` with ``make_demo_options``), warmed up
    by the demo's SFT; what is built already is kept."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    if not (out / "model" / "config.json").exists():
        command = [sys.executable, "examples/demo/make_demo.py", str(out), *make_demo_options]
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
    return Demo(out, sft / "hf_model", data)


def train(demo: Demo, variant: str, seed: int, steps: int, overrides: Sequence[str] = ()) -> Result:
    """The demo's GRPO for ``variant`` (its ``overrides``) and ``seed``, in ``grpo-<variant>-seed<seed>``
    under the demo's folder, unless a complete run is there."""
    run_dir = demo.out / f"grpo-{variant}-seed{seed}"
    done = scores(run_dir)
    wall = float("nan")
    if not done or done[-1][0] != steps:
        shutil.rmtree(run_dir, ignore_errors=True)
        wall = run(
            [
                "verl-core",
                "train",
                "examples/grpo.yaml",
                f"actor.engine.model.path={demo.sft_model}",
                f"data.train_files=[{demo.data / 'train.jsonl'}]",
                f"data.val_files=[{demo.data / 'val.jsonl'}]",
                f"trainer.seed={seed}",
                f"trainer.total_training_steps={steps}",
                f"trainer.run_dir={run_dir}",
                f"trainer.checkpoint_dir={run_dir / 'checkpoints'}",
                "trainer.save_freq=0",
                "trainer.logger=[]",
                *overrides,
            ],
            demo.out / f"grpo-{variant}-seed{seed}.log",
        )
        done = scores(run_dir)
    (_, before), (_, after) = done[0], done[-1]
    return Result(variant, seed, before, after, wall, run_dir)


def report(results: Sequence[Result], reference: str) -> bool:
    """Print every run and whether it lies within ``reference``'s spread of final scores; whether one
    lies below it."""
    spread = [result.after for result in results if result.variant == reference]
    low, high = min(spread), max(spread)
    width = max(len("variant"), *(len(result.variant) for result in results))
    print(
        f"{'variant':<{width}} {'seed':>4} {'val before':>10} {'val after':>9} {'wall s':>7}  within {reference}'s spread"
    )
    failed = False
    for result in results:
        verdict = ""
        if result.variant != reference:
            verdict = "yes" if low <= result.after <= high else "above" if result.after > high else "NO"
        failed |= verdict == "NO"
        print(
            f"{result.variant:<{width}} {result.seed:>4} {result.before:>10.3f} {result.after:>9.3f} "
            f"{result.wall_s:>7.0f}  {verdict}"
        )
    print(f"{reference} spread of final scores over {len(spread)} seeds: [{low:.3f}, {high:.3f}]")
    return failed
