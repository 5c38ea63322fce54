"""Asynchronous training against synchronous, side by side in one run: the step time and tokens/s of
each ``async_training.mode`` on the demo and on a multi-turn task whose environment answers after a
fixed latency, and the weights' transfer to a separate replica against a plain copy.

Modes (``MODES``), every one under Ray (``trainer.workers=ray``) with the actor on one rank
(``trainer.world_size=1``, the demo's ``fsdp`` backend) and, where separate, one rollout replica asking
for ``{CPU: 1}``; each rank and replica computes on one thread:

- ``sync colocated``: today's run, the rollout in the actor's rank (the baseline users have);
- ``sync``: ``rollout.placement=separate``, generate then train;
- ``one_step_off``: batch s+1 generates on the replica while batch s trains (staleness 1; ``async``
  with ``max_staleness=1`` is the same run by definition);
- ``async (staleness 4)``: ``async_training.mode=async``, ``max_staleness=4``.

Tasks:

- ``demo``: ``examples/grpo.yaml`` (16 prompts x 8 responses of at most 8 tokens) on the demo's model
  and data, built here by ``examples/demo/make_demo.py`` (untrained: its responses run to the length
  limit, which fixes the work per step).
- ``latency``: multi-turn conversations (``rollout.agent``) on the demo task's strings, rendered by the
  tools demo's ChatML tokenizer (``examples/tools_demo/make_tools_demo.py``), over a model of the
  demo's architecture at ``--latency-size``. The environment (``LatencyEnvironment``, registered in this
  process through ``RLTrainer.from_config(registry=...)``) sleeps ``--latency-ms`` before each answer,
  as a remote tool or a sandbox would, asks for the answer ``again`` and scores each turn with the
  ``digits`` reward; ``max_turns`` 3, so a conversation costs 3 x the latency. Environments run in the
  driver (on the generation thread of an off-policy run), one conversation after the other, whatever
  the placement: the Ray ranks only generate and train, so the environment needs no plugin installed in
  them.
- ``weights``: one policy version to a replica (``ActorWorker.publish_weights``: the weights packed into
  checked buckets, each put into Ray's object store; ``RolloutReplicaWorker.update_weights``: each
  fetched, checked and loaded) against a plain ``ray.put`` of the state dict on the actor's rank and
  ``ray.get`` on the replica, loaded the same way (``rollout.update_weights``), and against
  ``torch.clone`` of the same tensors in the actor's rank; on the demo's model and on
  SmolLM2-135M-Instruct when its folder is built (``benchmarks/_smollm2.py``; ``--smollm2 never`` skips
  it). Bytes/s = the weights' bytes / the wall time from the first call to the last return.

Step time = the wall time between the ends of consecutive steps (``RLTrainer.train_step`` returning
inside ``fit``) over the ``--steps`` timed steps after ``--warmup``; tokens/s = the steps' generated
tokens (the model's tokens: environment tokens are not counted) over the same seconds. Per mode also
the means over the timed steps of ``async/overlap``, ``timing/idle/trainer``, ``timing/idle/rollout``
and ``async/staleness/mean`` (docs/training.md, "Asynchronous training"; a synchronous run logs none).
Modes run in turn, alternating their order each ``--rounds``, each keeping its fastest round; the
``uptime`` load averages are printed beside each run: the machine may be shared.

    python benchmarks/async.py                         # both tasks, the weights, every mode, 1 round
    python benchmarks/async.py --tasks latency --latency-ms 50 --steps 6 --rounds 2 --json
    python benchmarks/async.py --tasks weights --smollm2 never
    python benchmarks/async.py --acceptance runs/async_acceptance   # the demo learning in each mode

``--acceptance OUT`` measures learning instead (docs/benchmarks.md): the demo's GRPO (``examples/grpo.yaml``:
fsdp on 2 ranks, 150 steps) with one separate replica in ``sync`` for ``--sync-seeds`` (the spread) and
in ``one_step_off`` and ``async`` with ``max_staleness=4`` for ``--seeds``, each run's final validation
score held to ``sync``'s spread (``examples/demo/acceptance.py``), and ``async`` with ``max_staleness=1``
on the first seed compared with ``one_step_off`` metric for metric; minutes a run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fit_timed, load_average, machine_description  # noqa: E402

from verl_core import hookimpl  # noqa: E402
from verl_core.workers.ranks import DEFAULT_BUCKET_MEGABYTES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "examples" / "grpo.yaml"

#: What each mode sets on top of the task's config.
SEPARATE = {"rollout.placement": "separate", "rollout.replicas": 1, "rollout.replica_resources": "{CPU: 1}"}
MODES: dict[str, dict[str, Any]] = {
    "sync colocated": {"rollout.placement": "colocated", "async_training.mode": "sync"},
    "sync": SEPARATE | {"async_training.mode": "sync"},
    "one_step_off": SEPARATE | {"async_training.mode": "one_step_off"},
    "async (staleness 4)": SEPARATE | {"async_training.mode": "async", "async_training.max_staleness": 4},
}
#: The mode the others are compared with, and today's baseline.
SYNC, COLOCATED = "sync", "sync colocated"
#: Means over the timed steps of these metrics, per mode (a synchronous run logs none of them).
ASYNC_METRICS = ("async/overlap", "timing/idle/trainer", "timing/idle/rollout", "async/staleness/mean")
#: The trainer's phases shown per mode (means over the timed steps); ``old_log_probs`` is the proximal
#: policy's recompute that an off-policy run always makes.
PHASES = ("timing/generate", "timing/old_log_probs", "timing/update_actor", "timing/sync")
TASKS = ("demo", "latency", "weights")
#: name -> (hidden_size, intermediate_size, num_hidden_layers) of the latency task's model (as in
#: ``grpo_vs_trl.py``); 4 attention heads, 2 KV heads.
SIZES: dict[str, tuple[int, int, int]] = {"0.5M": (128, 512, 2), "4M": (256, 1024, 4)}


def load_module(name: str, path: Path) -> Any:
    """A script of examples/ loaded by path (examples/ is not a package)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def make_demo() -> Any:
    return load_module("make_demo", REPO / "examples" / "demo" / "make_demo.py")


def common_overrides(work: Path, steps: int) -> dict[str, Any]:
    """Every run's settings: Ray, one actor rank, ``steps`` steps, nothing saved, validated or logged."""
    return {
        "trainer.workers": "ray",
        "trainer.world_size": 1,
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.logger": "[]",
        "trainer.save_hf_model": "false",
        "trainer.run_dir": str(work / "run"),
        "trainer.checkpoint_dir": str(work / "checkpoints"),
    }


# -- the tasks -------------------------------------------------------------------------------------


def demo_task(root: Path) -> tuple[list[Path], dict[str, Any], Any]:
    """The demo: its config file, the overrides pointing it at the model and data built under ``root``,
    and no registry of our own."""
    task = make_demo().TaskSpec(sft_size=0, train_size=512, val_size=16)
    paths = make_demo().build_demo(root / "demo", seed=0, task=task)
    overrides = {
        "actor.engine.model.path": str(paths.model),
        "data.train_files": f"[{paths.train}]",
        "data.val_files": f"[{paths.val}]",
    }
    return [DEMO_CONFIG], overrides, None


class LatencyEnvironment:
    """Answers every model turn after ``latency_s`` (a remote tool, a sandbox, a simulated user): asks
    for the reversal ``again`` until the model writes it, each turn scored by the ``digits`` reward."""

    def __init__(self, config: Any, latency_s: float):
        self.latency_s = latency_s

    def reset(self, row: Any) -> None:
        self.truth = row.extra["ground_truth"]

    def step(self, model_text: str) -> Any:
        from verl_core.agents import StepResult
        from verl_core.reward.builtin import digits

        time.sleep(self.latency_s)
        score = digits("", model_text, {"ground_truth": self.truth})["score"]
        return StepResult(observation={"role": "user", "content": "again"}, done=score == 1.0, reward=score)


class LatencyPlugin:
    """This script's plugin: the ``latency`` environment, answering after ``latency_s``."""

    def __init__(self, latency_s: float):
        self.latency_s = latency_s

    @hookimpl
    def verl_environments(self) -> list[Any]:
        from verl_core import Environment

        factory = functools.partial(LatencyEnvironment, latency_s=self.latency_s)
        return [Environment(name="latency", environment=factory, description="answers after a latency")]


def latency_task(root: Path, size: str, latency_ms: float) -> tuple[list[Path], dict[str, Any], Any]:
    """Multi-turn digit reversal whose environment answers after ``latency_ms``: no config file, the
    overrides, and a registry holding the ``latency`` environment besides the installed plugins."""
    from verl_core.plugins import Registry

    tools_demo = load_module("make_tools_demo", REPO / "examples" / "tools_demo" / "make_tools_demo.py")
    tokenizer = tools_demo.build_tokenizer()
    hidden, intermediate, layers = SIZES[size]
    spec = make_demo().ModelSpec(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        max_position_embeddings=128,
    )
    model = root / f"latency-{size}" / "model"
    make_demo().build_model(tokenizer, spec, seed=0).save_pretrained(model)
    tokenizer.save_pretrained(model)
    strings = make_demo().make_splits(make_demo().TaskSpec(sft_size=0, train_size=256, val_size=0))["train"]
    rows = [
        {"prompt": [{"role": "user", "content": f"reverse {digits}"}], "ground_truth": digits[::-1]}
        for digits in strings
    ]
    train = root / f"latency-{size}" / "train.jsonl"
    make_demo().write_jsonl(train, rows)
    registry = Registry.from_plugins([LatencyPlugin(latency_ms / 1000)], autoload=True)
    overrides = {
        "actor.engine.backend": "fsdp",
        "actor.engine.model.path": str(model),
        "actor.engine.optim.lr": 1e-4,
        "actor.engine.micro_batch.micro_batch_size": 16,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 4,
        "rollout.prompt_length": 40,
        "rollout.response_length": 80,
        "rollout.agent.environment": "latency",
        "rollout.agent.max_turns": 3,
        "rollout.agent.max_tokens_per_turn": 8,
        "reward.function": "digits",
        "algorithm.adv_estimator": "grpo",
        "data.train_files": f"[{train}]",
        "data.train_batch_size": 4,
        "data.apply_chat_template": "true",
    }
    return [], overrides, registry


# -- the modes ------------------------------------------------------------------------------------


def run_mode(
    task: tuple[list[Path], dict[str, Any], Any], mode: str, work: Path, args: argparse.Namespace
) -> dict:
    """One run of ``task`` in ``mode``: its timed steps' seconds, tokens and async metrics."""
    from verl_core.config import load_config
    from verl_core.trainer.rl import RLTrainer

    files, overrides, registry = task
    values = overrides | common_overrides(work, args.warmup + args.steps) | MODES[mode]
    config = load_config(files, [f"{key}={value}" for key, value in values.items()], registry=registry)
    load = load_average()
    ends, metrics = fit_timed(RLTrainer.from_config(config, registry=registry, show_progress=False))
    timed = range(args.warmup, args.warmup + args.steps)
    seconds = sum(ends[i] - ends[i - 1] for i in timed)  # warm-up >= 1: every timed step has a predecessor
    # The step's response tokens (the model's: padding and environment tokens excluded).
    tokens = sum(round(metrics[i]["perf/tokens_per_s"] * metrics[i]["perf/step_s"]) for i in timed)
    result = {
        "step_s": seconds / args.steps,
        "tokens_per_s": tokens / seconds,
        "tokens_per_step": tokens / args.steps,
        "load_average": load,
    }
    for key in ASYNC_METRICS + PHASES:
        values = [metrics[i][key] for i in timed if key in metrics[i]]
        result[key] = sum(values) / len(values) if values else None
    return result


def run_modes(task: tuple, name: str, root: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Every mode of ``args.modes`` on ``task``, ``args.rounds`` times in alternating order; the fastest
    round of each."""
    rounds: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for number in range(args.rounds):
        for mode in args.modes if number % 2 == 0 else args.modes[::-1]:
            result = run_mode(task, mode, root / f"{name}-{mode.replace(' ', '_')}-{number}", args)
            print(
                f"  {name} / {mode}, round {number + 1}: {result['step_s']:.3f} s/step "
                f"(load average {result['load_average'][0]:.2f})",
                flush=True,
            )
            rounds[mode].append(result)
    return {
        mode: min(results, key=lambda r: r["step_s"]) | {"rounds_step_s": [r["step_s"] for r in results]}
        for mode, results in rounds.items()
    }


def print_modes(results: dict[str, dict]) -> None:
    def cell(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    sync = results.get(SYNC)
    colocated = results.get(COLOCATED)
    print(
        f"{'mode':<20} {'s/step':>7} {'tokens/s':>8} {'vs sync':>7} {'vs coloc.':>9} {'overlap':>7} "
        f"{'idle/trainer s':>14} {'idle/rollout s':>14} {'staleness':>9}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<20} {r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f} "
            f"{cell(sync and r['tokens_per_s'] / sync['tokens_per_s'], 2):>7} "
            f"{cell(colocated and r['tokens_per_s'] / colocated['tokens_per_s'], 2):>9} "
            f"{cell(r['async/overlap'], 2):>7} {cell(r['timing/idle/trainer'], 3):>14} "
            f"{cell(r['timing/idle/rollout'], 3):>14} {cell(r['async/staleness/mean'], 2):>9}"
        )
    print("phases, mean seconds a step (an off-policy run generates on its generation thread, meanwhile):")
    for mode, r in results.items():
        phases = (f"{key.removeprefix('timing/')} {r[key]:.3f}" for key in PHASES if r[key] is not None)
        print(f"  {mode}: {', '.join(phases)}")


# -- the weights ----------------------------------------------------------------------------------


#: The weights' paths: core's (at each bucket size), the plain one through the same object store, and a
#: copy in memory.
BUCKETED = "bucketed stream, {} MB buckets"
PLAIN = "ray.put(state dict) -> ray.get"
CLONE = "torch.clone (in the actor's rank)"


def weight_bytes(worker: Any) -> tuple[int, int]:
    """On the actor's rank: the policy's tensors and their bytes."""
    tensors = [tensor for _, tensor in worker.policy.get_per_tensor_param()]
    return len(tensors), sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def use_bucket_megabytes(worker: Any, megabytes: int) -> None:
    """On the actor's rank: the bucket size of ``publish_weights`` from now on, as the config key sets it,
    above the transport's own limit too (``max_bucket_megabytes``: 64 for the object store)."""
    from verl_core.workers.replicas import load_transport

    worker.config.rollout.update_weights_bucket_megabytes = megabytes
    if worker.transport is None:
        worker.transport = load_transport(worker.config, worker.registry)
    worker.transport.max_bucket_megabytes = None


def put_state_dict(worker: Any) -> list[Any]:
    """On the actor's rank: the plain side's ``ray.put`` of the whole state dict (one object)."""
    import ray

    return [
        ray.put({name: tensor.detach().to("cpu") for name, tensor in worker.policy.get_per_tensor_param()})
    ]


def get_state_dict(worker: Any, references: list[Any]) -> None:
    """On the replica: the plain side's ``ray.get``, loaded as the bucketed stream's tensors are."""
    import ray

    worker.rollout.update_weights(ray.get(references[0]).items())


def clone_seconds(worker: Any, rounds: int) -> float:
    """On the actor's rank: the fastest ``torch.clone`` of every tensor, after the tensors are gathered."""
    tensors = [tensor for _, tensor in worker.policy.get_per_tensor_param()]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        copies = [tensor.clone() for tensor in tensors]
        best = min(best, time.perf_counter() - started)
        del copies
    return best


def transfer(model: Path, root: Path, overrides: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One policy version from the actor's rank to a replica, each way, ``args.rounds`` + 1 times (the
    first a warm-up) in alternating order; the fastest of each, in seconds and bytes/s."""
    from verl_core.config import load_config
    from verl_core.trainer.build import build_roles

    values = overrides | common_overrides(root, 1) | MODES[SYNC] | {"actor.engine.model.path": str(model)}
    config = load_config([DEMO_CONFIG], [f"{key}={value}" for key, value in values.items()])
    roles = build_roles(config)
    actor, replica = roles.actor, roles.replicas.groups[0]
    try:
        ((count, nbytes),) = actor.group.call(weight_bytes)

        def bucketed(megabytes: int) -> Callable[[int], tuple[float, float]]:
            def side(version: int) -> tuple[float, float]:
                actor.group.call(use_bucket_megabytes, megabytes)
                started = time.perf_counter()
                published = actor.publish_weights()
                sent = time.perf_counter()
                roles.replicas.update_weights(published, version)
                return sent - started, time.perf_counter() - sent

            return side

        def plain(version: int) -> tuple[float, float]:
            started = time.perf_counter()
            (references,) = actor.group.call(put_state_dict)
            sent = time.perf_counter()
            replica.call(get_state_dict, references)
            return sent - started, time.perf_counter() - sent

        sides = {BUCKETED.format(megabytes): bucketed(megabytes) for megabytes in args.bucket_megabytes}
        sides[PLAIN] = plain
        phases: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        names = list(sides)
        for number in range(args.rounds + 1):
            for side in names if number % 2 == 0 else names[::-1]:
                measured = sides[side](number + 1)
                if number:  # the first round warms up
                    phases[side].append(measured)
        ((clone,),) = [actor.group.call(clone_seconds, args.rounds + 1)]
    finally:
        roles.shutdown()
    result = {"tensors": count, "bytes": nbytes, "load_average": load_average(), "sides": {}}
    for side, measured in [*phases.items(), (CLONE, [(clone, 0.0)])]:
        send, receive = min(measured, key=sum)
        result["sides"][side] = {
            "seconds": send + receive,
            "send_s": send,
            "receive_s": receive,
            "bytes_per_s": nbytes / (send + receive),
            "rounds_s": [sum(pair) for pair in measured],
        }
    return result


def print_transfer(label: str, result: dict[str, Any]) -> None:
    plain = result["sides"][PLAIN]["seconds"]
    print(f"\nweights of {label}: {result['tensors']} tensors, {result['bytes'] / 1e6:.1f} MB (float32)")
    print(f"{'path':<52} {'seconds':>8} {'send s':>7} {'receive s':>9} {'MB/s':>7} {'vs ray.put/get':>14}")
    for side, figures in result["sides"].items():
        print(
            f"{side:<52} {figures['seconds']:>8.4f} {figures['send_s']:>7.4f} {figures['receive_s']:>9.4f} "
            f"{figures['bytes_per_s'] / 1e6:>7.0f} {plain / figures['seconds']:>13.2f}x"
        )


# -- the demo's acceptance ------------------------------------------------------------------------

#: ``--acceptance``'s variants: the demo's run (``examples/grpo.yaml``: fsdp on 2 ranks under Ray, 150
#: steps) with one separate replica, in each mode; ``sync`` gives the seed spread the others are held to.
ACCEPTANCE = {
    "sync": MODES[SYNC],
    "one_step_off": MODES["one_step_off"],
    "async_s4": MODES["async (staleness 4)"],
}
#: ``async`` with ``max_staleness=1``: ``one_step_off``'s run by definition, run on the first seed and
#: compared with it metric for metric.
STALENESS_1 = ("async_s1", SEPARATE | {"async_training.mode": "async", "async_training.max_staleness": 1})
#: Metrics that differ between two runs of the same computation: wall times and what follows from them.
TIMING_PREFIXES = ("timing/", "perf/", "async/overlap", "async/buffer_depth")


def computed_differences(first: Path, second: Path) -> list[str]:
    """The metrics two runs' ``metrics.jsonl`` disagree on, timings left out: ``step 3 actor/pg_loss``."""
    from verl_core.trainer.run_files import METRICS_FILE, read_records

    def computed(run_dir: Path) -> dict[int, dict[str, float]]:
        return {
            record["step"]: {
                key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)
            }
            for record in read_records(run_dir / METRICS_FILE)
        }

    a, b = computed(first), computed(second)
    if sorted(a) != sorted(b):
        return [f"steps {sorted(a)} against {sorted(b)}"]
    return [
        f"step {step} {key}"
        for step in a
        for key in sorted(set(a[step]) | set(b[step]))
        if a[step].get(key) != b[step].get(key)
    ]


def acceptance(out: Path, seeds: list[int], sync_seeds: list[int], steps: int) -> int:
    """The demo in ``sync`` for every one of ``sync_seeds`` and in the other modes of ``ACCEPTANCE`` for
    every one of ``seeds``, and ``async`` with staleness 1 on the first seed against ``one_step_off``;
    exit status 1 when a run lies below ``sync``'s spread or the two differ."""
    module = load_module("demo_acceptance", REPO / "examples" / "demo" / "acceptance.py")
    demo = module.prepare(out.resolve())
    print(f"the demo in each mode, {steps} steps; load average {load_average()}", flush=True)
    plan = [(variant, seed) for variant in ACCEPTANCE for seed in (sync_seeds if variant == SYNC else seeds)]
    results = []
    for variant, seed in [*plan, (STALENESS_1[0], seeds[0])]:
        overrides = ACCEPTANCE.get(variant, STALENESS_1[1])
        results.append(module.train(demo, variant, seed, steps, [f"{k}={v}" for k, v in overrides.items()]))
        print(f"  {variant} seed {seed}: done (load average {load_average()})", flush=True)
    failed = module.report(results, SYNC)
    one_step_off = next(r for r in results if r.variant == "one_step_off" and r.seed == seeds[0])
    differences = computed_differences(one_step_off.run_dir, results[-1].run_dir)
    print(
        f"async with max_staleness=1 against one_step_off, seed {seeds[0]}, every metric but the timings: "
        + ("identical" if not differences else f"{len(differences)} differ: {', '.join(differences[:5])}")
    )
    return 1 if failed or differences else 0


# -- the run --------------------------------------------------------------------------------------


def comma_list(choices: Any) -> Any:
    """argparse ``type`` of a comma-separated list of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {list(choices)}")
        return items

    return parse


def smollm2_folder(choice: str) -> Path | None:
    """SmolLM2-135M-Instruct's folder when it is built (``benchmarks/_smollm2.py``), else None, saying why."""
    from _smollm2 import MARKER, default_cache

    folder = default_cache()
    if choice == "never":
        return None
    if not (folder / MARKER).is_file():
        print(
            f"SmolLM2-135M-Instruct is not built at {folder}: skipping it (benchmarks/_smollm2.py builds it)"
        )
        return None
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=comma_list(TASKS), default=list(TASKS), help=f"of {list(TASKS)}")
    parser.add_argument("--modes", type=comma_list(MODES), default=list(MODES), help=f"of {list(MODES)}")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode (the fastest is kept)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the environment's latency per turn")
    parser.add_argument("--latency-size", choices=SIZES, default="4M", help="the latency task's model")
    parser.add_argument(
        "--smollm2", choices=("auto", "never"), default="auto", help="the weights of SmolLM2 too, when built"
    )
    parser.add_argument(
        "--bucket-megabytes",
        type=lambda text: [int(item) for item in text.split(",")],
        default=[DEFAULT_BUCKET_MEGABYTES, 64, 16],
        help="the weights' bucket sizes to measure (rollout.update_weights_bucket_megabytes; default "
        f"{DEFAULT_BUCKET_MEGABYTES}, the config's, and 64 and 16, below the local cluster's object store)",
    )
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object, last")
    parser.add_argument(
        "--acceptance",
        type=Path,
        metavar="OUT",
        help="instead of the benchmark: the demo's acceptance of the asynchronous modes, in OUT",
    )
    parser.add_argument("--seeds", default="0,1,2", help="--acceptance: the seeds of the off-policy modes")
    parser.add_argument(
        "--sync-seeds", default="0,1,2,3,4,5", help="--acceptance: the seeds of sync, which give the spread"
    )
    parser.add_argument("--acceptance-steps", type=int, default=150, help="--acceptance: GRPO steps")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")
    if args.acceptance is not None:
        seeds, sync_seeds = (
            [int(seed) for seed in text.split(",")] for text in (args.seeds, args.sync_seeds)
        )
        return acceptance(args.acceptance, seeds, sync_seeds, args.acceptance_steps)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # the driver's own work (scoring, the environment) stays off the ranks' cores
    machine = machine_description()
    print(
        f"{machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])}, torch "
        f"{torch.__version__} (CPU capability {machine['torch_capability']}); load average {load_average()}"
    )
    report: dict[str, Any] = {"machine": machine, "settings": vars(args) | {"acceptance": None}}
    with tempfile.TemporaryDirectory(prefix="async_bench_") as temp:
        root = Path(temp)
        demo = demo_task(root)
        for name in ("demo", "latency"):
            if name not in args.tasks:
                continue
            if name == "demo":
                task, what = demo, "the demo (examples/grpo.yaml: 16 prompts x 8 responses, up to 8 tokens)"
            else:
                task = latency_task(root, args.latency_size, args.latency_ms)
                what = (
                    f"multi-turn, the environment answering after {args.latency_ms:g} ms a turn (4 prompts x 4 "
                    f"conversations of 3 turns, up to 8 tokens each; model {args.latency_size})"
                )
            print(
                f"\n{what}; {args.warmup} warm-up + {args.steps} timed steps, best of {args.rounds}",
                flush=True,
            )
            results = run_modes(task, name, root, args)
            print_modes(results)
            report[name] = results
        if "weights" in args.tasks:
            models = {"the demo's model": Path(demo[1]["actor.engine.model.path"])}
            smollm2 = smollm2_folder(args.smollm2)
            if smollm2 is not None:
                models["SmolLM2-135M-Instruct"] = smollm2
            report["weights"] = {}
            for label, model in models.items():
                result = transfer(model, root / f"weights-{len(report['weights'])}", demo[1], args)
                print_transfer(label, result)
                report["weights"][label] = result
    if args.json:
        print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
