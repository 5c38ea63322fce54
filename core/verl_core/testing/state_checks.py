"""The conformance checks of an engine's state: a checkpoint that resumes exactly and refuses what it
cannot load, the weight export for the rollout, the Hugging Face export, and offloading. See
``checks`` for how checks run (each yields its comparisons as it makes them)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_core.data.batch import ENTROPY, LOG_PROBS
from verl_core.engine.base import BaseEngine
from verl_core.testing import reference
from verl_core.testing.context import (
    LEFT_AFTER_FULL_OFFLOAD,
    OPTIMIZER_SHARE_FREED,
    OUTPUT_TOLERANCE,
    SCHEDULE_OPTIM,
    STEP_PARAM_TOLERANCE,
    CheckSkipped,
    RankContext,
    compare_runs,
    exported,
    infer,
    train_step,
)
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.races import publication_held
from verl_core.testing.report import BITWISE, Comparison, compare_state_dicts, compare_tensors
from verl_core.testing.tiny import ModelDirs
from verl_core.toolkit.checkpoint import MARKER_FILE


def check_checkpoint(ctx: RankContext) -> Iterator[Comparison]:
    path = ctx.workdir / "checkpoint"
    original = ctx.engine(optim=SCHEDULE_OPTIM)
    for name in "AB":
        train_step(original, ctx.local_batch(name))
    with publication_held(path, ctx.store, ctx.rank, ctx.world_size) as returned:  # as for hf_export
        original.save_checkpoint(str(path), global_step=2)
        present = path.is_dir()
        returned()
    # Two steps after the save: the schedule's rate changes at both, so lost scheduler state shows.
    expected = [(train_step(original, ctx.local_batch(name)), exported(original)) for name in "CA"]
    del original

    yield Comparison(
        "checkpoint",
        "checkpoint present when save_checkpoint returns",
        ctx.rank,
        present,
        f"{path} is in place on this rank"
        if present
        else f"{path} does not exist yet on this rank: "
        "save_checkpoint returned before the writing rank finished (end it with a barrier over every "
        "rank that calls it, as verl_core.engine.atomic_checkpoint does)",
    )
    resumed = ctx.engine(optim=SCHEDULE_OPTIM)
    step = resumed.load_checkpoint(str(path))
    against = "uninterrupted run"
    yield Comparison(
        "checkpoint",
        "global step",
        ctx.rank,
        step == 2,
        f"load_checkpoint returned {step!r}, saved with global_step=2",
    )
    for number, name, (metrics, params) in zip((3, 4), "CA", expected, strict=True):
        actual = train_step(resumed, ctx.local_batch(name))
        for key in ("loss", "grad_norm", "lr"):
            yield from compare_runs(
                "checkpoint", f"step {number} {key}", actual.get(key), metrics.get(key), ctx.rank, against
            )
        yield from compare_runs(
            "checkpoint", f"parameters after step {number}", exported(resumed), params, ctx.rank, against
        )
    del resumed
    yield _refuses(ctx, "a checkpoint with a truncated file", _damaged_copy(ctx, path))
    yield _refuses(ctx, "a checkpoint of another model", path, dirs=ctx.other_model_dirs())
    yield _refuses(ctx, "a checkpoint of another backend", _foreign_checkpoint(ctx))


def _foreign_checkpoint(ctx: RankContext) -> Path:
    """An (empty) complete checkpoint that another engine backend wrote."""
    from verl_core.toolkit.checkpoint import atomic_checkpoint

    path = ctx.workdir / "foreign_checkpoint"
    with atomic_checkpoint(path, global_step=2, backend=f"not-{ctx.backend}", group=dist.group.WORLD):
        pass
    return path


def _damaged_copy(ctx: RankContext, path: Path) -> Path:
    """A copy of the checkpoint at ``path`` whose largest file (weights or optimiser state) is cut to
    half its size: what a partial copy or a full disk leaves behind a completion marker."""
    damaged = path.with_name(path.name + "_damaged")
    if ctx.rank == 0:
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(path, damaged)
        files = [f for f in damaged.rglob("*") if f.is_file() and f.name != MARKER_FILE]
        victim = max(files, key=lambda f: f.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    dist.barrier()
    return damaged


def _refuses(ctx: RankContext, what: str, path: Path, dirs: ModelDirs | None = None) -> Comparison:
    """Loading ``path`` into a fresh engine must raise ``CheckpointError`` naming the checkpoint."""
    from verl_core.errors import CheckpointError

    engine = ctx.engine(optim=SCHEDULE_OPTIM, dirs=dirs)
    quantity = f"loading {what}"
    try:
        engine.load_checkpoint(str(path))
    except CheckpointError as error:
        names_it = str(path) in str(error)
        detail = "refused with CheckpointError" + (
            "" if names_it else f", but the message does not name {path}"
        )
        return Comparison("checkpoint", quantity, ctx.rank, names_it, f"{detail}: {error}")
    except Exception as error:
        return Comparison(
            "checkpoint",
            quantity,
            ctx.rank,
            False,
            f"raised {type(error).__name__}: {error}; expected verl_core.engine.CheckpointError naming the "
            "checkpoint (wrap loading in verl_core.engine.reading_checkpoint)",
        )
    return Comparison("checkpoint", quantity, ctx.rank, False, f"load_checkpoint({str(path)!r}) succeeded")


def check_weight_export(ctx: RankContext) -> Iterator[Comparison]:
    engine = ctx.engine()
    first = exported(engine)
    yield from compare_state_dicts(
        "weight_export",
        "get_per_tensor_param",
        first,
        ctx.initial_state_dict(),
        BITWISE,
        ctx.rank,
        against="Hugging Face state dict",
    )
    # The rollout pulls weights after every step: a second export must give the same again.
    yield from compare_state_dicts(
        "weight_export",
        "second get_per_tensor_param",
        exported(engine),
        dict(first),
        BITWISE,
        ctx.rank,
        against="first export",
    )


def check_hf_export(ctx: RankContext) -> Iterator[Comparison]:
    path = str(ctx.workdir / "hf_export")
    engine = ctx.engine()
    train_step(engine, ctx.local_batch("A"))  # export trained weights, not the ones loaded
    engine_outputs = infer(engine, ctx.local_batch("A"))
    # No barrier here: save_hf_model is a collective, and no rank may return before the export exists.
    # The writing rank is held just before the export appears, so that a rank returning early sees so.
    with publication_held(path, ctx.store, ctx.rank, ctx.world_size) as returned:
        engine.save_hf_model(path)
        present = (Path(path) / "config.json").is_file()
        returned()
    if not present:
        yield Comparison(
            "hf_export",
            "export present when save_hf_model returns",
            ctx.rank,
            False,
            f"{path}/config.json does not exist yet on this rank: save_hf_model returned before the "
            "writing rank finished (end it with a barrier over every rank that calls it: the DP group, "
            "or the world for a model-parallel engine)",
        )
        return
    loaded = reference.load_reference_model(path, "lm")
    yield from compare_state_dicts(
        "hf_export",
        "from_pretrained(export)",
        loaded.state_dict().items(),
        ctx.reference_step().params,
        STEP_PARAM_TOLERANCE,
        ctx.rank,
        against="reference after step 1",
    )
    if not engine.is_output_rank:
        return
    if engine_outputs is None:
        yield Comparison("hf_export", "outputs", ctx.rank, False, "infer_batch returned no outputs")
        return
    # The export's own config decides its logits: a wrong rope_theta, norm epsilon or head count
    # shows here even when every tensor is right.
    from_export = reference.reference_outputs(loaded, ctx.share("A", ctx.dp_rank), "lm", KIT_TEMPERATURE)
    for name in (LOG_PROBS, ENTROPY):
        yield compare_tensors(
            "hf_export",
            f"{name} of from_pretrained(export)",
            from_export[name],
            engine_outputs.get(name, None),
            OUTPUT_TOLERANCE,
            ctx.rank,
            ctx.local_token_mask(),
            against="engine's infer_batch",
        )


def check_offload(ctx: RankContext) -> Iterator[Comparison]:
    not_exercised = (
        "not exercised: the engine computes on the CPU, where to('cpu') and param/optimizer offload move "
        "nothing, so neither the move nor the round trip can be observed; run the kit with device='cuda'"
    )
    if ctx.device.split(":")[0] == "cpu":  # no engine is built only to be skipped
        raise CheckSkipped(not_exercised)
    probe = ctx.engine()
    if probe.device.type == "cpu":  # an engine that runs on the CPU whatever it is asked
        raise CheckSkipped(not_exercised)
    yield from _offload_frees_device_memory(ctx, probe)
    del probe

    def run(engine, round_trip: bool) -> dict[str, Any]:
        results = {"log_probs A": infer(engine, ctx.local_batch("A"))}
        results["step 1"] = train_step(engine, ctx.local_batch("A"))
        if round_trip:
            engine.to("cpu")
            engine.to(str(engine.device))
        results["step 2"] = train_step(engine, ctx.local_batch("B"))
        if round_trip:
            engine.to("cpu")
            engine.to(str(engine.device))
        results["log_probs B"] = infer(engine, ctx.local_batch("B"))
        results["parameters"] = exported(engine)
        return results

    baseline = run(ctx.engine(), round_trip=False)
    variants = {
        'to("cpu") and back between steps': run(ctx.engine(), round_trip=True),
        "param_offload + optimizer_offload": run(
            ctx.engine(param_offload=True, optimizer_offload=True), False
        ),
    }
    against = "engine without offload"
    for label, results in variants.items():
        for key in ("log_probs A", "log_probs B"):
            if results[key] is not None and baseline[key] is not None:
                yield from compare_runs(
                    "offload",
                    f"{label}: {key}",
                    results[key][LOG_PROBS],
                    baseline[key][LOG_PROBS],
                    ctx.rank,
                    against,
                )
        for key in ("step 1", "step 2"):
            for metric in ("loss", "grad_norm"):
                yield from compare_runs(
                    "offload",
                    f"{label}: {key} {metric}",
                    results[key].get(metric),
                    baseline[key].get(metric),
                    ctx.rank,
                    against,
                )
        yield from compare_runs(
            "offload",
            f"{label}: parameters after step 2",
            results["parameters"],
            baseline["parameters"],
            ctx.rank,
            against,
        )


def _offload_frees_device_memory(ctx: RankContext, engine: BaseEngine) -> list[Comparison]:
    """After a step, ``to("cpu", optimizer=True)`` alone must free the AdamW moments' share of the
    device memory the engine holds, and ``to("cpu")`` nearly all of it; and an engine with
    ``param_offload`` + ``optimizer_offload`` must hold almost nothing outside its mode contexts."""
    import gc

    def allocated() -> int:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    train_step(engine, ctx.local_batch("A"))  # parameters, gradients and AdamW state all exist now
    resident = allocated()
    engine.to("cpu", model=False, grad=False, optimizer=True)
    after_optimizer = allocated()
    engine.to("cpu")
    after_all = allocated()
    engine.to(str(engine.device))
    freed_by_optimizer = resident - after_optimizer
    comparisons = [
        Comparison(
            "offload",
            'to("cpu", optimizer=True) frees the optimiser state',
            ctx.rank,
            freed_by_optimizer >= OPTIMIZER_SHARE_FREED * resident,
            f"freed {freed_by_optimizer} of {resident} bytes the engine held on the device (expected at least "
            f"{OPTIMIZER_SHARE_FREED:.0%}: AdamW's moments are twice the parameters)",
        ),
        Comparison(
            "offload",
            'to("cpu") frees the device',
            ctx.rank,
            after_all <= LEFT_AFTER_FULL_OFFLOAD * resident,
            f"{after_all} of {resident} bytes stay on the device (expected at most {LEFT_AFTER_FULL_OFFLOAD:.0%})",
        ),
    ]
    offloaded = ctx.engine(param_offload=True, optimizer_offload=True)
    train_step(offloaded, ctx.local_batch("A"))
    outside = allocated() - resident
    comparisons.append(
        Comparison(
            "offload",
            "param_offload + optimizer_offload: device memory outside train_mode()",
            ctx.rank,
            outside <= LEFT_AFTER_FULL_OFFLOAD * resident,
            f"{outside} bytes stay on the device after train_mode() exits (a resident engine holds {resident})",
        )
    )
    return comparisons
