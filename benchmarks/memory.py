"""Memory per rank of the fsdp engine (and the ddp engine, for comparison) at 1, 2 and 4 ranks.

A Qwen2 of 56,379,008 parameters (hidden 640, intermediate 1792, 8 layers, 10 attention heads, 2 KV
heads, vocabulary 16384, untied embeddings; fp32, built here from a config and written with
``save_pretrained``: nothing is downloaded), loaded by every rank through the engine
(``initialize``), then one ``train_batch`` (4 sequences x 64 tokens over the ranks, micro-batches
of 1 per rank, the engines' default padding-free path, ``policy_loss_fn``, AdamW). Each run is one
``spawn`` of gloo ranks (a fresh process per rank, one torch thread each; 1 rank is a gloo group
of one, where the fsdp engine runs the model unsharded).

Per rank, after the step:

- persistent bytes: parameters, gradients (the engines zero them at the start of the next step, so
  after the step they are still there: the step's reduced gradients) and AdamW state (``exp_avg``,
  ``exp_avg_sq``, ``step``), each counting the local shard only (``DTensor.to_local()``), a tied
  parameter once; the ratio of their sum to the same backend's 1-rank figure;
- RSS (psutil) after the imports (torch, transformers, the engine; the baseline every rank pays) and
  after the step; peak RSS during ``initialize`` and during the step: ``VmHWM`` of
  ``/proc/self/status``, reset before each phase through ``/proc/self/clear_refs`` (``ru_maxrss``
  would not do: on Linux a spawned process inherits its parent's high-water mark across ``exec``);
  and RSS after the step once ``malloc_trim(0)`` returned glibc's free heap to the system
  (``trimmed``: the rest is live memory, imports included).

Figures are the largest over the ranks (shards of dim 0 that do not divide evenly leave some ranks
a row more). ``--fsdp KEY=VALUE`` (repeatable: any field of ``verl_fsdp.config.FSDPConfig``) adds a
row for the fsdp engine with those options. Run:

    python benchmarks/memory.py [--ranks 1 2 4] [--backends ddp fsdp] [--fsdp KEY=VALUE ...] [--json]

Goal (issue 7; reported, not asserted): the fsdp engine's persistent bytes per rank at 2 ranks at
most 0.52 of 1 rank's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    add_fsdp_argument,
    build_engine,
    fsdp_options,
    options_label,
    policy_batch,
    quiet_transformers,
    read_result,
    save_qwen2,
    write_result,
)

MODEL = {
    "vocab_size": 16384,
    "hidden_size": 640,
    "intermediate_size": 1792,
    "num_hidden_layers": 8,
    "num_attention_heads": 10,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEQUENCES, PROMPT_LENGTH, RESPONSE_LENGTH, MICRO_BATCH_SIZE = 4, 16, 48, 1
GOAL = 0.52
MIB = 2**20
PERSISTENT = ("parameters", "gradients", "optimizer")


def _peak_rss() -> int:
    """This process's peak RSS since it started or since ``_reset_peak_rss``: ``VmHWM``, the high-water
    mark of its own address space. Not ``ru_maxrss``, which on Linux keeps the RSS of the forked
    parent across ``exec`` (every spawned rank would start at the parent's size)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: the lifetime peak
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _reset_peak_rss() -> bool:
    """Restart the peak at the current RSS (Linux >= 4.0); False where the peak cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _trimmed_rss(process) -> int:
    """RSS once glibc has handed its free heap memory back (``malloc_trim(0)``): what of the RSS
    after the step is live memory rather than freed blocks the allocator keeps; RSS as is elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return process.memory_info().rss


def resident_bytes(engine) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimiser state (local shards)."""
    parameters = {id(p): p for p in engine.model.parameters()}.values()
    state = [
        value
        for per_parameter in engine.optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": sum(_local_bytes(p) for p in parameters),
        "gradients": sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer": sum(_local_bytes(value) for value in state),
    }


def rank_main(rank, model_path: str, backend: str, options: dict[str, Any]) -> None:
    """One spawned rank (``verl_core.testing.spawn``): load, step, measure, gather to rank 0."""
    import psutil
    import transformers  # noqa: F401 (counted in the imports' RSS, as the engines' modules are)

    from verl_core.testing.losses import policy_loss_fn
    from verl_core.toolkit import hf_engine  # noqa: F401

    quiet_transformers()
    process = psutil.Process()
    full = policy_batch(SEQUENCES, PROMPT_LENGTH, RESPONSE_LENGTH, MODEL["vocab_size"])
    share = SEQUENCES // rank.world_size
    figures: dict[str, Any] = {"rss_imports": process.memory_info().rss}
    figures["peak_resets"] = _reset_peak_rss()
    started = time.perf_counter()
    engine = build_engine(backend, model_path, options, micro_batch_size=MICRO_BATCH_SIZE, packing=True)
    figures["initialize_s"] = time.perf_counter() - started
    figures["peak_rss_initialize"] = _peak_rss()
    _reset_peak_rss()
    started = time.perf_counter()
    metrics = engine.train_batch(full[rank.rank * share : (rank.rank + 1) * share], policy_loss_fn)
    figures["step_s"] = time.perf_counter() - started
    figures["peak_rss_step"] = _peak_rss()
    figures["rss_after_step"] = process.memory_info().rss
    figures["rss_after_trim"] = _trimmed_rss(process)
    figures.update(resident_bytes(engine), loss=metrics["loss"])
    figures["persistent"] = sum(figures[key] for key in PERSISTENT)
    gathered: list[Any] = [None] * rank.world_size
    torch.distributed.all_gather_object(gathered, figures)
    write_result(rank, gathered)


def run(model_path: str, backend: str, options: dict[str, Any], world_size: int, scratch: Path) -> dict:
    """Spawn ``world_size`` ranks; the per-rank figures, and their maximum over the ranks."""
    from verl_core.testing.spawn import spawn

    workdir = scratch / f"{options_label(backend, options)}-{world_size}".replace("/", "_")
    started = time.perf_counter()
    spawn(rank_main, (model_path, backend, options), world_size=world_size, workdir=workdir, timeout_s=600)
    ranks = read_result(workdir)
    worst = {key: max(rank[key] for rank in ranks) for key in ranks[0] if key not in ("loss", "peak_resets")}
    return {"ranks": ranks, "max": worst, "loss": ranks[0]["loss"], "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--backends", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    add_fsdp_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    custom = fsdp_options(parser, args.fsdp)
    quiet_transformers()
    rows = [(backend, {}) for backend in args.backends] + ([("fsdp", custom)] if custom else [])
    results: dict[str, dict[str, Any]] = {}
    width = max(len(options_label(backend, options)) for backend, options in rows) + 2
    with tempfile.TemporaryDirectory() as scratch:
        path, parameters = save_qwen2(scratch, **MODEL)
        print(
            f"Qwen2 {parameters:,} parameters (fp32), one train_batch of {SEQUENCES} x "
            f"{PROMPT_LENGTH + RESPONSE_LENGTH} tokens; MiB per rank (largest over the ranks; peak initialize of rank 0 and of the others apart)"
        )
        print(
            f"{'engine':<{width}} {'ranks':>5} {'params':>8} {'grads':>8} {'AdamW':>8} {'persistent':>10} "
            f"{'ratio':>6} {'RSS imports':>11} {'init r0':>7} {'init rest':>9} {'peak step':>9} {'RSS after':>9} "
            f"{'trimmed':>7} {'wall':>6}"
        )
        for backend, options in rows:
            label = options_label(backend, options)
            results[label] = {}
            for world_size in args.ranks:
                result = run(path, backend, options, world_size, Path(scratch))
                results[label][str(world_size)] = result
                worst = result["max"]
                base = results[label].get("1")  # without a 1-rank run there is no ratio
                result["persistent_ratio"] = worst["persistent"] / base["max"]["persistent"] if base else None
                ratio = "-" if base is None else f"{result['persistent_ratio']:.3f}"
                # Rank 0 apart: under load_on_rank0 it alone reads the checkpoint.
                initialize = [rank["peak_rss_initialize"] for rank in result["ranks"]]
                rest = f"{max(initialize[1:]) / MIB:.0f}" if world_size > 1 else "-"
                print(
                    f"{label:<{width}} {world_size:>5} "
                    + " ".join(f"{worst[key] / MIB:>8.1f}" for key in PERSISTENT)
                    + f" {worst['persistent'] / MIB:>10.1f} {ratio:>6} "
                    + f"{worst['rss_imports'] / MIB:>11.0f} {initialize[0] / MIB:>7.0f} {rest:>9} "
                    + f"{worst['peak_rss_step'] / MIB:>9.0f} {worst['rss_after_step'] / MIB:>9.0f} "
                    + f"{worst['rss_after_trim'] / MIB:>7.0f} "
                    + f"{result['wall_s']:>5.0f}s",
                    flush=True,
                )
    goal = {}
    fsdp = results.get("fsdp", {})
    if "1" in fsdp and "2" in fsdp:
        ratio = fsdp["2"]["persistent_ratio"]
        goal = {"ratio": ratio, "goal": GOAL, "met": ratio <= GOAL}
        verdict = "met" if goal["met"] else "NOT met"
        print(
            f"\ngoal: fsdp persistent bytes per rank at 2 ranks / 1 rank = {ratio:.3f} (<= {GOAL}): {verdict}"
        )
    if args.json:
        print(json.dumps({"parameters": parameters, "model": MODEL, "results": results, "goal": goal}))


if __name__ == "__main__":
    main()
