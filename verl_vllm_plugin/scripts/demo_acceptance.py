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
import importlib.util
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: What ``--set`` gives the ``vllm`` runs unless told otherwise: the demo's prompts and responses fit in
#: 24 tokens, so a small cache holds a rank's whole share of a step.
VLLM_DEFAULTS = ("rollout.vllm.max_model_len=32",)


def acceptance_module():
    """examples/demo/acceptance.py (the demo's runs over seeds, and the spread), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "demo_acceptance", REPO / "examples" / "demo" / "acceptance.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_acceptance"] = module  # NamedTuples look their module up by name
    spec.loader.exec_module(module)
    return module


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

    acceptance = acceptance_module()
    out = args.out.resolve()
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    demo = acceptance.prepare(out, ["--attention-heads", "2", "--kv-heads", "1"])
    results = [
        acceptance.train(
            demo, backend, seed, args.steps, [f"rollout.backend={backend}", *overrides.get(backend, [])]
        )
        for backend, seed in plan
    ]
    return 1 if acceptance.report(results, "hf") else 0


if __name__ == "__main__":
    sys.exit(main())
