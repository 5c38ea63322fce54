"""Time to the first step of ``verl-core train`` on the demo, by start-up phase.

Usage: ``python benchmarks/startup.py [--rounds N] [--warmup] [--modes ray,in_process] [--baseline REF] [--json]``.

Each run is a fresh process that goes through ``verl-core train``'s own code path (``verl_core.cli.main``)
on the demo's model and data (``examples/demo/make_demo.py``, built once into a temporary folder) with
``examples/grpo.yaml``: GRPO, the fsdp backend, under a local Ray cluster on 2 ranks (``ray``), the
same with a critic (PPO with GAE: ``ppo``, 2 actor and 2 critic ranks) or in the trainer's process on
1 rank (``in_process``), stopping after the first step (no validation, checkpoint or export). The script wraps the functions the start-up goes through and stamps the wall
clock when each returns; the phases are the gaps between the stamps:

| phase | what it covers |
| --- | --- |
| python | the interpreter's start, up to the script's first line |
| imports | ``verl_core.cli`` and the trainer's modules in the trainer process (torch, transformers, tensordict, ...) |
| config | loading and validating the YAML and the overrides (plugin discovery included) |
| checks+data | the checks before anything starts, the tokenizer and the prompt datasets |
| ray init | starting the local Ray cluster (``ensure_ray``) |
| rank processes | from creating the ranks' Ray actors to their first answer (process start, Ray's worker start-up) |
| rank setup | the process group and each rank's worker: its imports, the engine and rollout objects |
| engine init | ``initialize`` on every rank: the model loaded and sharded, the optimiser, the rollout's weights |
| roles ready | (``ppo`` only, for the two groups together) rank processes, rank setup and engine init |
| first step | the first training step |
| total | the script's launch to the end of the first step |

``--baseline REF`` runs the same measurement on the sources of git revision ``REF`` (``git archive``
into a temporary folder, put first on ``PYTHONPATH`` for the trainer and its Ray ranks), alternating
which goes first each round, so that both see the same machine load: the before/after table of
docs/benchmarks.md. Each cell is the median over the rounds; ``--warmup`` first runs one unrecorded
round (Python writes its bytecode caches, the page cache fills).

Where Python may not cache bytecode (``PYTHONDONTWRITEBYTECODE=1``, or packages installed with
``--no-compile`` into a read-only place), every process compiles every module it imports from source,
the trainer's and each rank's alike: the header says whether torch's bytecode is cached.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The source folders of the distributions, as the editable installs put them on sys.path.
SOURCE_ROOTS = ("core", "verl_fsdp_plugin/src", "verl_megatron_plugin/src", "plugins/verl_ddp/src")
PHASES = (
    "python",
    "imports",
    "config",
    "checks+data",
    "ray init",
    "rank processes",
    "rank setup",
    "engine init",
    "roles ready",
    "first step",
)
MODES = ("ray", "ppo", "in_process")


# -- the measured process -------------------------------------------------------------------------


def child(mode: str, demo: Path, work: Path, launched: float, out: Path) -> None:
    """One ``verl-core train`` up to the end of its first step, stamping each phase's end."""
    stamps: dict[str, float] = {"launched": launched, "python": time.time()}
    import verl_core.cli as cli
    import verl_core.trainer.rl as rl

    stamps["imports"] = time.time()

    def after(owner: object, name: str, label: str, nth: int = 1) -> None:
        """Stamp ``label`` when the ``nth`` call of ``owner.name`` returns (no-op if it is absent)."""
        original = getattr(owner, name, None)
        if original is None:
            return
        calls = [0]

        def wrapper(*args, **kwargs):
            if label.startswith("start:"):
                stamps.setdefault(label, time.time())
            result = original(*args, **kwargs)
            calls[0] += 1
            if calls[0] == nth and not label.startswith("start:"):
                stamps[label] = time.time()
            return result

        setattr(owner, name, wrapper)

    import verl_core.trainer.build as build
    import verl_core.workers.roles as roles

    after(cli, "_load_run_config", "config")
    after(rl, "load_prompt_datasets", "checks+data")
    if mode == "ray":
        import verl_core.workers.ray_group as ray_group

        after(ray_group, "ensure_ray", "ray init")
        after(ray_group.RayWorkerGroup, "_wait", "rank processes", nth=1)
        after(ray_group.RayWorkerGroup, "_wait", "rank setup", nth=2)
        after(roles.Role, "__init__", "engine init")
    elif mode == "ppo":  # two groups: only the time until both are ready compares across versions
        import verl_core.workers.ray_group as ray_group

        after(ray_group, "ensure_ray", "ray init")
        after(build, "build_roles", "roles ready")
    else:
        after(build.InProcessWorkerGroup, "__init__", "rank setup")
        after(roles.Role, "__init__", "engine init")
    first_step = rl.RLTrainer.train_step

    def train_step(self, step):
        metrics = first_step(self, step)
        stamps["first step"] = time.time()
        out.write_text(json.dumps(stamps))
        return metrics

    rl.RLTrainer.train_step = train_step
    overrides = [
        f"actor.engine.model.path={demo / 'model'}",
        f"data.train_files=[{demo / 'data' / 'train.jsonl'}]",
        f"data.val_files=[{demo / 'data' / 'val.jsonl'}]",
        "trainer.total_training_steps=1",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.save_hf_model=false",
        "trainer.logger=[]",
        "trainer.resume_mode=disable",
        f"trainer.run_dir={work / 'run'}",
        f"trainer.checkpoint_dir={work / 'checkpoints'}",
        f"trainer.workers={'in_process' if mode == 'in_process' else 'ray'}",
        f"trainer.world_size={1 if mode == 'in_process' else 2}",
    ]
    if mode == "ppo":
        critic = f"{{backend: fsdp, model: {{path: {demo / 'model'}}}, optim: {{lr: 1.0e-3}}}}"
        overrides += ["algorithm.adv_estimator=gae", "critic.enable=true", f"critic.engine={critic}"]
    code = cli.main(["train", str(REPO / "examples" / "grpo.yaml"), *overrides])
    if code != 0:
        raise SystemExit(f"verl-core train exited {code}")


def phases(stamps: dict[str, float]) -> dict[str, float]:
    """Seconds per phase: each stamp minus the previous one present; ``total`` from the launch."""
    result, previous = {}, stamps["launched"]
    for phase in PHASES:
        if phase in stamps:
            result[phase] = stamps[phase] - previous
            previous = stamps[phase]
    result["total"] = stamps["first step"] - stamps["launched"]
    return result


# -- the driver -----------------------------------------------------------------------------------


def source_tree(ref: str, into: Path) -> dict[str, str]:
    """``ref``'s sources exported under ``into``; the environment that imports them first."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    path = os.pathsep.join(str(into / root) for root in SOURCE_ROOTS)
    return {"PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}


def measure(mode: str, demo: Path, env: dict[str, str], quiet: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="startup") as work:
        out = Path(work) / "stamps.json"
        launched = time.time()
        command = [sys.executable, __file__, "--child", mode, "--demo", str(demo), "--work", work]
        command += ["--launched", repr(launched), "--out", str(out)]
        done = subprocess.run(
            command,
            env={**os.environ, **env},
            cwd=work,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"{mode} run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        if not quiet:
            print(f"  {mode}: {phases(json.loads(out.read_text()))['total']:.1f} s", file=sys.stderr)
        return phases(json.loads(out.read_text()))


def bytecode_note() -> str:
    """Whether the processes can use cached bytecode for torch (else they compile it on every start)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    cached = spec is not None and importlib.util.cache_from_source(spec.origin)
    present = bool(cached) and os.path.exists(cached)
    writes = not os.environ.get("PYTHONDONTWRITEBYTECODE")
    return f"torch bytecode {'cached' if present else 'not cached'}, PYTHONDONTWRITEBYTECODE {'unset' if writes else 'set'}"


def table(results: dict[str, dict[str, list[dict[str, float]]]], labels: list[str]) -> str:
    """A markdown table: one row per phase, one column per mode and source tree (medians)."""
    columns = [(mode, label) for mode in MODES for label in labels if results.get(label, {}).get(mode)]
    header = "| phase | " + " | ".join(f"{mode} ({label})" for mode, label in columns) + " |"
    lines = [header, "| --- |" + " --- |" * len(columns)]
    for phase in (*PHASES, "total"):
        cells = []
        for mode, label in columns:
            values = [run[phase] for run in results[label][mode] if phase in run]
            cells.append(f"{statistics.median(values):.1f} s" if values else "")
        if any(cells):
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: ray, ppo, in_process")
    parser.add_argument("--baseline", metavar="REF", help="also measure git revision REF, side by side")
    parser.add_argument("--json", action="store_true", help="print every run's phases as JSON")
    parser.add_argument("--warmup", action="store_true", help="run one unrecorded round first")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--demo", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.demo, args.work, args.launched, args.out)
        return

    modes = [mode for mode in args.modes.split(",") if mode]
    with tempfile.TemporaryDirectory(prefix="startup-bench") as scratch:
        scratch = Path(scratch)
        subprocess.run(
            [sys.executable, str(REPO / "examples" / "demo" / "make_demo.py"), str(scratch / "demo")],
            check=True,
            capture_output=True,
        )
        trees = {"this tree": {}}
        if args.baseline:
            (scratch / "baseline").mkdir()
            trees = {args.baseline: source_tree(args.baseline, scratch / "baseline"), **trees}
        labels = list(trees)
        results: dict[str, dict[str, list[dict[str, float]]]] = {label: {} for label in labels}
        for round_ in range(-1 if args.warmup else 0, args.rounds):
            order = labels if round_ % 2 == 0 else labels[::-1]
            print(f"round {round_ + 1}/{args.rounds}" if round_ >= 0 else "warm-up round", file=sys.stderr)
            for mode in modes:
                for label in order:
                    print(f" {label}", file=sys.stderr, end="")
                    run = measure(mode, scratch / "demo", trees[label], quiet=False)
                    if round_ >= 0:
                        results[label].setdefault(mode, []).append(run)
    if args.json:
        print(json.dumps(results, indent=2))
    print(f"median of {args.rounds} rounds, {os.cpu_count()} CPUs, {bytecode_note()}")
    print(table(results, labels))


if __name__ == "__main__":
    main()
