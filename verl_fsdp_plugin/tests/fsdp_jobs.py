"""FSDP engine properties checked on spawned ranks, for ``test_fsdp_engine.py`` and ``test_fsdp_gpu.py``.

``spawn(job, world_size, workdir)`` (the test side) runs ``run_job`` (the rank side) on one process
per rank through ``verl_core.testing.spawn`` (which loads this file by path in each rank). Each rank
runs its job's properties in order and writes ``<job>_rank<rank>.json`` mapping each property to
``null`` (it holds) or why it does not. Properties run the engine's collectives in the same order on every
rank. The tiny model must already be in ``<workdir>/model``. Tests load this file by path (the
``fsdp_jobs`` fixture of conftest.py); pytest does not collect it.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PreTrainedModel

from verl_core.config.engine import MicroBatchConfig
from verl_core.errors import ConfigError
from verl_core.plugins import Registry
from verl_core.testing.checks import (
    SCHEDULE_OPTIM,
    STEP_PARAM_TOLERANCE,
    RankContext,
    exported,
    infer,
    train_step,
)
from verl_core.testing.losses import TEMPERATURE, policy_loss_fn
from verl_core.testing.reference import load_reference_model, reference_gradients
from verl_core.testing.report import BITWISE, Comparison, Tolerance, compare_scalars, compare_state_dicts
from verl_core.testing.spawn import Rank, SpawnError
from verl_core.testing.spawn import spawn as run_ranks
from verl_core.testing.tiny import ModelDirs
from verl_fsdp import loading
from verl_fsdp.config import FSDPConfig
from verl_fsdp.sharding import fsdp_units, full_tensor

#: Where the 2-rank job leaves its checkpoint and what the 1-rank job must find in it.
CHECKPOINT = "checkpoint_2ranks"
SAVED_STATE = "saved_state.pt"  # weights, full AdamW state and lr at the save (rank 0 writes it)
CONTINUED = "continued_2ranks.pt"  # the uninterrupted 2-rank step 2: metrics and weights
HF_EXPORT = "hf_export"
#: A step on 2 ranks vs 1 rank: the same batch, other reduction orders (see the kit's tolerances).
ACROSS_WORLD_SIZES = Tolerance(atol=1e-6, rtol=1e-5)
#: HSDP against the single-process reference (issue 7's bounds): the loss and every gradient.
HSDP_LOSS = Tolerance(atol=1e-5, rtol=0.0)
HSDP_GRADIENTS = Tolerance(atol=1e-6, rtol=0.0)

Property = Callable[[RankContext], None]


# -- the test side ---------------------------------------------------------------------------------

#: A job that takes longer is hung (the ranks' collectives time out after 60 s by themselves).
JOB_TIMEOUT_S = 300


class JobFailed(RuntimeError):
    """A rank of a job crashed or the job timed out; the message holds the ranks' log tails."""


def spawn(job: str, world_size: int, workdir: Path) -> list[dict[str, str | None]]:
    """Run ``job`` on ``world_size`` processes; return each rank's results (property -> failure)."""
    cuda = job == "cuda"
    try:
        run_ranks(
            run_job,
            (job, str(workdir)),
            world_size=world_size,
            workdir=workdir / f"ranks_{job}",
            timeout_s=JOB_TIMEOUT_S,
            device="cuda" if cuda else "cpu",
            # cpu_offload on CUDA reduces CPU tensors too (gradient norms): gloo beside NCCL.
            backend="cpu:gloo,cuda:nccl" if cuda else None,
        )
    except SpawnError as error:
        raise JobFailed(f"job {job!r}: {error}") from None
    return [json.loads((workdir / f"{job}_rank{rank}.json").read_text()) for rank in range(world_size)]


def failures(results: list[dict[str, str | None]], prop: str) -> str:
    """Why ``prop`` failed, per rank; empty when it holds on every rank."""
    return "\n".join(f"rank {rank}: {r[prop]}" for rank, r in enumerate(results) if r[prop] is not None)


# -- helpers of the rank side ----------------------------------------------------------------------


def require(comparisons: list[Comparison]) -> None:
    """Raise with every failed comparison described."""
    failed = [c.describe() for c in comparisons if not c.passed]
    if failed:
        raise AssertionError("\n".join(failed))


def with_options(ctx: RankContext, **options: object) -> RankContext:
    return attrs.evolve(ctx, options=FSDPConfig(**options))


@contextmanager
def spying(names: tuple[str, ...]) -> Iterator[list[torch.Tensor]]:
    """Record the input of every call of the first of ``names`` that ``torch.distributed`` has (FSDP's
    collectives were renamed across torch versions) inside the block."""
    name = next(name for name in names if hasattr(dist, name))
    original = getattr(dist, name)
    inputs: list[torch.Tensor] = []

    def spy(output: torch.Tensor, input: torch.Tensor, *args: object, **kwargs: object):
        inputs.append(input)
        return original(output, input, *args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield inputs
    finally:
        setattr(dist, name, original)


def counting_reduce_scatters() -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """Every gradient reduce-scatter FSDP issues inside the block (its input)."""
    return spying(("reduce_scatter_single", "reduce_scatter_tensor"))


def counting_all_gathers() -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """Every parameter all-gather FSDP issues inside the block (its input)."""
    return spying(("all_gather_single", "all_gather_into_tensor"))


def same_start(ctx: RankContext, name: str, engine: Any, baseline: Any, role: str = "lm") -> list[Comparison]:
    """``engine`` starts where ``baseline`` (every rank loading the weights) does: the buffers of the
    Hugging Face model and the same first step, bitwise."""
    reference = dict(load_reference_model(ctx.dirs.for_role(role), role).named_buffers())
    comparisons = compare_state_dicts(
        name, "buffers", engine.model.named_buffers(), reference, BITWISE, ctx.rank, "HF model"
    )
    got = train_step(engine, ctx.local_batch("A"), role)
    want = train_step(baseline, ctx.local_batch("A"), role)
    comparisons += [
        compare_scalars(name, f"step 1 {key}", got[key], want[key], BITWISE, ctx.rank, "every rank loading")
        for key in ("loss", "grad_norm")
    ]
    return comparisons + compare_state_dicts(
        name,
        "weights after step 1",
        exported(engine),
        dict(exported(baseline)),
        BITWISE,
        ctx.rank,
        "every rank loading",
    )


@contextmanager
def counting_weight_loads() -> Iterator[list[str]]:
    """Record every ``from_pretrained`` (a read of the checkpoint) inside the block."""
    original = PreTrainedModel.from_pretrained.__func__
    loads: list[str] = []

    def spy(cls: type, *args: object, **kwargs: object):
        loads.append("read")
        return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(spy)
    try:
        yield loads
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)


# -- properties of the 2-rank job -------------------------------------------------------------------


def layout(ctx: RankContext) -> None:
    """Each decoder layer, then the root, is an FSDP unit; every parameter is a dim-0 shard over both
    ranks; buffers (the rotary inv_freq, not in the state dict) equal the Hugging Face model's."""
    engine = ctx.engine()
    units = [type(unit).__name__ for unit in fsdp_units(engine.model)]
    assert units == ["FSDPQwen2ForCausalLM", "FSDPQwen2DecoderLayer", "FSDPQwen2DecoderLayer"], units
    for name, parameter in engine.model.named_parameters():
        assert isinstance(parameter, DTensor), f"{name} is a {type(parameter).__name__}, not a DTensor"
        assert parameter.placements == (Shard(0),), f"{name}: placements {parameter.placements}"
        assert parameter.device_mesh.size() == ctx.world_size, f"{name}: mesh {parameter.device_mesh}"
        expected_rows = -(-parameter.shape[0] // ctx.world_size)  # FSDP pads the last shard
        assert parameter.to_local().shape[0] <= expected_rows, f"{name}: local {parameter.to_local().shape}"
    buffers = dict(engine.model.named_buffers())
    assert "model.rotary_emb.inv_freq" in buffers, sorted(buffers)
    reference = dict(load_reference_model(ctx.dirs.lm, "lm").named_buffers())
    require(
        compare_state_dicts("layout", "buffers", buffers.items(), reference, BITWISE, ctx.rank, "HF model")
    )


def shards_registered_after_inference(ctx: RankContext) -> None:
    """After inference the module holds its shards again, whatever ``reshard_after_forward`` says
    (the root keeps gathered parameters after forward; only a backward would reshard it)."""
    for reshard in (True, False):
        engine = with_options(ctx, reshard_after_forward=reshard).engine()
        infer(engine, ctx.local_batch("A"))
        gathered = [n for n, p in engine.model.named_parameters() if not isinstance(p, DTensor)]
        assert not gathered, f"reshard_after_forward={reshard}: gathered after inference: {gathered}"


def gradients_reduced_once_per_step(ctx: RankContext) -> None:
    """With 6 micro-batches per rank, each unit reduce-scatters its gradients once, not 6 times."""
    engine = ctx.engine(micro_batch=MicroBatchConfig(micro_batch_size=1))
    assert len(ctx.share("A", ctx.rank)) == 6
    with counting_reduce_scatters() as reductions:
        train_step(engine, ctx.local_batch("A"))
    assert len(reductions) == len(fsdp_units(engine.model)) == 3, f"{len(reductions)} reduce-scatters"


def mixed_precision(ctx: RankContext) -> None:
    """``param_dtype: bfloat16`` computes in bf16 on fp32 master weights; ``reduce_dtype`` decides the
    dtype gradients are reduced in (default: ``param_dtype``)."""
    reference = ctx.engine()
    expected = infer(reference, ctx.local_batch("A"))["log_probs"]
    expected_loss = train_step(reference, ctx.local_batch("A"))["loss"]
    for reduce_dtype, reduced_in in (("float32", torch.float32), (None, torch.bfloat16)):
        engine = with_options(ctx, param_dtype="bfloat16", reduce_dtype=reduce_dtype).engine()
        seen: list[torch.dtype] = []
        engine.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda module, args, seen=seen: seen.append(module.weight.dtype)
        )
        log_probs = infer(engine, ctx.local_batch("A"))["log_probs"]
        with counting_reduce_scatters() as reductions:
            loss = train_step(engine, ctx.local_batch("A"))["loss"]
        assert seen and set(seen) == {torch.bfloat16}, f"forward weights in {set(seen)}"
        assert {p.dtype for p in engine.model.parameters()} == {torch.float32}, "master weights not fp32"
        if ctx.world_size > 1:  # one rank has nothing to reduce: FSDP skips the collective
            dtypes = {reduction.dtype for reduction in reductions}
            assert dtypes == {reduced_in}, f"reduce_dtype={reduce_dtype}: reduced in {dtypes}"
        difference = float((log_probs - expected).abs().max())
        assert 1e-5 < difference < 0.1, f"bf16 log-probs differ from fp32 by {difference}"
        assert abs(loss - expected_loss) < 0.05 * abs(expected_loss), f"loss {loss} vs fp32 {expected_loss}"


def cpu_offload(ctx: RankContext) -> None:
    """``cpu_offload`` (CPUOffloadPolicy without pinned memory on a CPU-only machine) trains exactly
    like the default layout, and ``to()`` leaves its state on the CPU."""
    results = []
    for options in ({}, {"cpu_offload": True}):
        engine = with_options(ctx, **options).engine()
        metrics = train_step(engine, ctx.local_batch("A"))
        engine.to("cpu")
        engine.to(str(engine.device))
        metrics_2 = train_step(engine, ctx.local_batch("B"))
        results.append((metrics, metrics_2, exported(engine)))
    (base_1, base_2, base_params), (offload_1, offload_2, offload_params) = results
    require(
        [
            compare_scalars(
                "cpu_offload", f"step {i} {key}", got[key], want[key], BITWISE, ctx.rank, "default"
            )
            for i, (got, want) in enumerate(((offload_1, base_1), (offload_2, base_2)), start=1)
            for key in ("loss", "grad_norm")
        ]
        + compare_state_dicts(
            "cpu_offload",
            "weights after step 2",
            offload_params,
            dict(base_params),
            BITWISE,
            ctx.rank,
            "default",
        )
    )


def custom_units(ctx: RankContext) -> None:
    """``shard_modules`` picks other unit classes; the step is the same as with decoder-layer units."""
    engine = with_options(ctx, shard_modules=("Qwen2Attention", "Qwen2MLP")).engine()
    units = collections.Counter(type(unit).__name__ for unit in fsdp_units(engine.model))
    assert units == {"FSDPQwen2ForCausalLM": 1, "FSDPQwen2Attention": 2, "FSDPQwen2MLP": 2}, units
    metrics = train_step(engine, ctx.local_batch("A"))
    step = ctx.reference_step()
    require(
        [compare_scalars("custom_units", "loss", metrics["loss"], step.loss, ACROSS_WORLD_SIZES, ctx.rank)]
        + compare_state_dicts(
            "custom_units",
            "weights after step 1",
            exported(engine),
            step.params,
            STEP_PARAM_TOLERANCE,
            ctx.rank,
        )
    )


def recovers_from_a_failed_step(ctx: RankContext) -> None:
    """A loss function that raises mid-step (after a backward under ``no_sync``) leaves the engine
    usable: the next step equals the reference step, as if the failed one never happened."""
    engine = ctx.engine()
    calls = []

    def failing_loss(model_output, micro_batch, dp_group):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("loss failed on purpose")
        return policy_loss_fn(model_output, micro_batch, dp_group)

    try:
        with engine.train_mode():
            engine.train_batch(ctx.local_batch("A"), failing_loss)
    except RuntimeError as error:
        assert "on purpose" in str(error), error
    else:
        raise AssertionError("the failing loss did not raise")
    metrics = train_step(engine, ctx.local_batch("A"))
    step = ctx.reference_step()
    require(
        [compare_scalars("recovery", "loss", metrics["loss"], step.loss, ACROSS_WORLD_SIZES, ctx.rank)]
        + compare_state_dicts(
            "recovery",
            "weights after the step",
            exported(engine),
            step.params,
            STEP_PARAM_TOLERANCE,
            ctx.rank,
        )
    )


def export_gathers_one_tensor_at_a_time(ctx: RankContext) -> None:
    """``get_per_tensor_param`` gathers each tensor only when the consumer asks for it."""
    engine = ctx.engine()
    original = DTensor.full_tensor
    gathers = []

    def spy(self: DTensor, *args: object, **kwargs: object) -> torch.Tensor:
        gathers.append(self.shape)
        return original(self, *args, **kwargs)

    DTensor.full_tensor = spy
    try:
        weights = engine.get_per_tensor_param()
        name, first = next(weights)
        assert len(gathers) == 1 and first.shape == gathers[0], f"{len(gathers)} gathers for one tensor"
        rest = list(weights)  # every rank finishes the iteration: each gather is a collective
    finally:
        DTensor.full_tensor = original
    assert len(gathers) == 1 + len(rest), f"{len(gathers)} gathers for {1 + len(rest)} tensors"


def checkpoint_at_two_ranks(ctx: RankContext) -> None:
    """Step 1, save (for the 1-rank job to load), step 2; record what the resumed run must match."""
    engine = ctx.engine(optim=SCHEDULE_OPTIM)
    train_step(engine, ctx.local_batch("A"))
    engine.save_checkpoint(str(ctx.workdir / CHECKPOINT), global_step=1)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    saved = {
        "weights": exported(engine),
        # A copy: the state dict shares AdamW's ``step`` tensors, which step 2 increments in place.
        "optimizer": copy.deepcopy(get_optimizer_state_dict(engine.model, engine.optimizer, options=full)),
        "lr": engine.get_lr(),
    }
    metrics = train_step(engine, ctx.local_batch("B"))
    continued = {"metrics": metrics, "weights": exported(engine)}
    if ctx.rank == 0:
        torch.save(saved, ctx.workdir / SAVED_STATE)
        torch.save(continued, ctx.workdir / CONTINUED)


def hf_export(ctx: RankContext) -> None:
    """``save_hf_model`` on every rank; the test reads what rank 0 wrote."""
    ctx.engine().save_hf_model(str(ctx.workdir / HF_EXPORT))


def load_on_rank0_starts_like_every_rank_loading(ctx: RankContext) -> None:
    """Under ``load_on_rank0`` only rank 0 reads the checkpoint (the other ranks build the model on
    the meta device); every rank ends with the Hugging Face model's buffers and the first step is
    bitwise that of every rank loading the weights, for both roles (the critic's value head is
    initialised on rank 0 only)."""
    comparisons = []
    for role in ("lm", "value"):
        with counting_weight_loads() as loads:
            engine = with_options(ctx, load_on_rank0=True).engine(role)
        expected = ["read"] if ctx.rank == 0 else []
        assert loads == expected, f"{role}: rank {ctx.rank} read the checkpoint {len(loads)} times"
        comparisons += same_start(ctx, f"load_on_rank0 {role}", engine, ctx.engine(role), role)
    require(comparisons)


def load_on_rank0_that_forgets_buffers_is_caught(ctx: RankContext) -> None:
    """A broken loader that sends only the parameters leaves the rotary ``inv_freq`` of the meta-built
    ranks as ``to_empty`` made it: ``same_start`` must report it there (rank 0 loaded real buffers)."""
    original = loading.tensors_to_load
    loading.tensors_to_load = lambda module: module.named_parameters()
    try:
        engine = with_options(ctx, load_on_rank0=True).engine()
    finally:
        loading.tensors_to_load = original
    failed = [c.describe() for c in same_start(ctx, "broken", engine, ctx.engine()) if not c.passed]
    if ctx.rank == 0:
        return
    assert any("buffers" in line and "inv_freq" in line for line in failed), failed or "nothing failed"


def keep_params_gathered_gathers_once_per_step(ctx: RankContext) -> None:
    """With 6 micro-batches per rank, ``keep_params_gathered`` all-gathers each unit once per step
    (the default gathers each layer twice per micro-batch: forward, then backward), computes the same
    step bitwise, and leaves the shards registered after the step and after inference."""
    micro_batch = MicroBatchConfig(micro_batch_size=1)
    runs = []
    for options in ({}, {"keep_params_gathered": True}):
        engine = with_options(ctx, **options).engine(micro_batch=micro_batch)
        with counting_all_gathers() as gathers:
            metrics = train_step(engine, ctx.local_batch("A"))
        gathered = [n for n, p in engine.model.named_parameters() if not isinstance(p, DTensor)]
        assert not gathered, f"{options}: gathered after the step: {gathered}"
        infer(engine, ctx.local_batch("B"))
        gathered = [n for n, p in engine.model.named_parameters() if not isinstance(p, DTensor)]
        assert not gathered, f"{options}: gathered after inference: {gathered}"
        runs.append((len(gathers), metrics, exported(engine)))
    (default_gathers, want, want_params), (kept_gathers, got, got_params) = runs
    units = len(fsdp_units(engine.model))
    assert kept_gathers == units, f"keep_params_gathered: {kept_gathers} all-gathers for {units} units"
    assert default_gathers == 6 * (2 * (units - 1) + 1), f"default: {default_gathers} all-gathers"
    require(
        [
            compare_scalars("keep_params_gathered", key, got[key], want[key], BITWISE, ctx.rank, "default")
            for key in ("loss", "grad_norm")
        ]
        + compare_state_dicts(
            "keep_params_gathered",
            "weights after the step",
            got_params,
            dict(want_params),
            BITWISE,
            ctx.rank,
            "default",
        )
    )


# -- properties of the 4-rank job (HSDP: 2 groups of 2) --------------------------------------------


def hsdp(ctx: RankContext) -> RankContext:
    return with_options(ctx, shard_size=2)


def hsdp_layout(ctx: RankContext) -> None:
    """``shard_size: 2`` at 4 ranks: every parameter is replicated across 2 groups and sharded on
    dim 0 within each; ranks 0 and 2 (and 1 and 3) hold the same shard."""
    engine = hsdp(ctx).engine()
    for name, parameter in engine.model.named_parameters():
        assert isinstance(parameter, DTensor), f"{name} is a {type(parameter).__name__}"
        assert parameter.placements == (Replicate(), Shard(0)), f"{name}: placements {parameter.placements}"
        mesh = parameter.device_mesh
        assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (2, 2), (
            f"{name}: {mesh}"
        )
    local = torch.cat([p.to_local().flatten() for p in engine.model.parameters()])
    shards = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(shards, local)
    assert torch.equal(shards[ctx.rank], shards[(ctx.rank + 2) % 4]), "replicas hold different shards"
    assert not torch.equal(shards[0], shards[1]), "the two ranks of a group hold the same shard"


def hsdp_gradients(ctx: RankContext, engine: Any) -> list[Comparison]:
    """The loss and every gradient of batch A against one process on the whole batch (1e-5, 1e-6)."""
    with engine.train_mode():
        result = engine.forward_backward_batch(ctx.local_batch("A"), policy_loss_fn, forward_only=False)
    gradients = [(name, full_tensor(p.grad)) for name, p in engine.model.named_parameters()]
    engine.optimizer_zero_grad()
    loss, expected = reference_gradients(ctx.dirs.lm, "lm", ctx.samples["A"], TEMPERATURE)
    return [compare_scalars("hsdp", "loss", result.loss, loss, HSDP_LOSS, ctx.rank)] + compare_state_dicts(
        "hsdp", "gradients", gradients, expected, HSDP_GRADIENTS, ctx.rank
    )


def hsdp_matches_the_single_process_reference(ctx: RankContext) -> None:
    """At 2x2 the loss and every gradient of batch A match one process on the whole batch, and so
    does the step (loss and weights after it)."""
    engine = hsdp(ctx).engine()
    comparisons = hsdp_gradients(ctx, engine)
    metrics = train_step(engine, ctx.local_batch("A"))
    step = ctx.reference_step()
    require(
        comparisons
        + [compare_scalars("hsdp", "step loss", metrics["loss"], step.loss, ACROSS_WORLD_SIZES, ctx.rank)]
        + compare_state_dicts(
            "hsdp", "weights after the step", exported(engine), step.params, STEP_PARAM_TOLERANCE, ctx.rank
        )
    )


def hsdp_averaging_within_groups_is_caught(ctx: RankContext) -> None:
    """Broken on purpose: gradients averaged over the 2 ranks of a shard group instead of all 4 DP
    ranks (twice the true gradient) must fail the gradient comparison."""
    engine = hsdp(ctx).engine()
    engine.model.set_gradient_divide_factor(2.0)
    failed = [c.describe() for c in hsdp_gradients(ctx, engine) if not c.passed]
    assert any("gradients" in line for line in failed), failed or "nothing failed"


def hsdp_checkpoint_loads_into_plain_fsdp(ctx: RankContext) -> None:
    """A checkpoint saved under HSDP loads into a 1-D mesh of the same ranks (DCP reshards): the next
    step matches the HSDP engine's own next step."""
    engine = hsdp(ctx).engine(optim=SCHEDULE_OPTIM)
    train_step(engine, ctx.local_batch("A"))
    engine.save_checkpoint(str(ctx.workdir / "checkpoint_hsdp"), global_step=1)
    want = train_step(engine, ctx.local_batch("B"))
    plain = ctx.engine(optim=SCHEDULE_OPTIM)
    assert plain.load_checkpoint(str(ctx.workdir / "checkpoint_hsdp")) == 1
    got = train_step(plain, ctx.local_batch("B"))
    require(
        [
            compare_scalars("hsdp checkpoint", key, got[key], want[key], ACROSS_WORLD_SIZES, ctx.rank, "HSDP")
            for key in ("loss", "grad_norm", "lr")
        ]
        + compare_state_dicts(
            "hsdp checkpoint",
            "weights after step 2",
            exported(plain),
            dict(exported(engine)),
            STEP_PARAM_TOLERANCE,
            ctx.rank,
            "HSDP",
        )
    )


def hsdp_load_on_rank0_starts_like_every_rank_loading(ctx: RankContext) -> None:
    """Rank-0 loading composes with HSDP: rank 0 sends to both groups."""
    require(
        same_start(
            ctx,
            "hsdp load_on_rank0",
            with_options(ctx, shard_size=2, load_on_rank0=True).engine(),
            hsdp(ctx).engine(),
        )
    )


def shard_size_must_divide_the_ranks(ctx: RankContext) -> None:
    try:
        with_options(ctx, shard_size=3).engine()
    except ConfigError as error:
        assert "engine.fsdp.shard_size" in str(error) and "[1, 2, 4]" in str(error), error
    else:
        raise AssertionError("shard_size=3 was accepted at 4 ranks")


# -- properties of the 1-rank job -------------------------------------------------------------------


def resumes_checkpoint_of_two_ranks(ctx: RankContext) -> None:
    """A checkpoint saved at 2 ranks loads at 1 (DCP reshards): the same weights, AdamW state and lr,
    and the next step on the whole batch matches the 2-rank continuation."""
    saved = torch.load(ctx.workdir / SAVED_STATE, weights_only=False)
    continued = torch.load(ctx.workdir / CONTINUED, weights_only=False)
    engine = ctx.engine(optim=SCHEDULE_OPTIM)
    step = engine.load_checkpoint(str(ctx.workdir / CHECKPOINT))
    assert step == 1, step
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optimizer = get_optimizer_state_dict(engine.model, engine.optimizer, options=full)
    comparisons = compare_state_dicts(
        "resume", "weights", exported(engine), dict(saved["weights"]), BITWISE, 0, "2-rank save"
    )
    comparisons.append(
        compare_scalars("resume", "lr", engine.get_lr(), saved["lr"], BITWISE, 0, "2-rank save")
    )
    for name, state in saved["optimizer"]["state"].items():
        comparisons += compare_state_dicts(
            "resume",
            f"AdamW state of {name}",
            optimizer["state"][name].items(),
            state,
            BITWISE,
            0,
            "2-rank save",
        )
    metrics = train_step(engine, ctx.local_batch("B"))  # one rank: the whole batch B
    for key in ("loss", "grad_norm", "lr"):
        comparisons.append(
            compare_scalars(
                "resume",
                f"step 2 {key}",
                metrics[key],
                continued["metrics"][key],
                ACROSS_WORLD_SIZES,
                0,
                "2 ranks",
            )
        )
    comparisons += compare_state_dicts(
        "resume",
        "weights after step 2",
        exported(engine),
        dict(continued["weights"]),
        STEP_PARAM_TOLERANCE,
        0,
    )
    require(comparisons)


def refuses_moving_parameters_without_gradients(ctx: RankContext) -> None:
    engine = ctx.engine()
    try:
        engine.to("cpu", model=True, grad=False)
    except ValueError as error:
        assert "move both (model=True, grad=True) or neither" in str(error), error
    else:
        raise AssertionError("to(model=True, grad=False) was accepted on a sharded engine")


def one_rank_group_runs_unsharded(ctx: RankContext) -> None:
    """A group of one rank has nothing to shard across: the plain model runs (FSDP's hooks and copies
    would only cost time), unless an option only FSDP honours is set."""
    plain = ctx.engine()
    assert not plain.sharded and not isinstance(plain.model, FSDPModule), type(plain.model)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters()), "parameters are DTensors"
    mixed = with_options(ctx, reduce_dtype="float32").engine()
    assert mixed.sharded and isinstance(mixed.model, FSDPModule), "reduce_dtype needs FSDP: it must shard"


# -- properties of the CUDA job (test_fsdp_gpu.py; backend cpu:gloo,cuda:nccl) ----------------------------

#: fp32 on CUDA against fp32 on CUDA with another layout or placement: TF32 is off by default for
#: matmuls, so differences are reduction-order rounding.
ON_CUDA = Tolerance(atol=1e-5, rtol=1e-4)


def bf16_on_cuda(ctx: RankContext) -> None:
    """bf16 compute with fp32 reduction on CUDA: master weights fp32 on the GPU, sane results."""
    mixed_precision(ctx)
    engine = with_options(ctx, param_dtype="bfloat16", reduce_dtype="float32").engine()
    devices = {p.to_local().device.type for p in engine.model.parameters()}
    assert devices == {"cuda"}, f"shards on {devices}"


def cpu_offload_on_cuda(ctx: RankContext) -> None:
    """``cpu_offload`` on CUDA keeps shards and AdamW state on the CPU, computes on the GPU, and trains
    like the resident layout; exports come out whole on the GPU."""
    runs = []
    for options in ({}, {"cpu_offload": True}):
        engine = with_options(ctx, **options).engine()
        metrics = [train_step(engine, ctx.local_batch(name)) for name in ("A", "B")]
        runs.append((engine, metrics, exported(engine)))
    (_, base_metrics, base_params), (offloaded, metrics, params) = runs
    shard_devices = {p.to_local().device.type for p in offloaded.model.parameters()}
    state_devices = {s["exp_avg"].to_local().device.type for s in offloaded.optimizer.state.values()}
    assert shard_devices == state_devices == {"cpu"}, f"shards on {shard_devices}, AdamW on {state_devices}"
    _, first = next(offloaded.get_per_tensor_param())
    assert first.device.type == "cuda", f"export on {first.device}"
    comparisons = [
        compare_scalars("cpu_offload", f"step {i} {key}", got[key], want[key], ON_CUDA, ctx.rank, "resident")
        for i, (got, want) in enumerate(zip(metrics, base_metrics, strict=True), start=1)
        for key in ("loss", "grad_norm")
    ]
    require(
        comparisons
        + compare_state_dicts("cpu_offload", "weights", params, dict(base_params), ON_CUDA, ctx.rank)
    )


def param_offload_on_cuda(ctx: RankContext) -> None:
    """``param_offload`` + ``optimizer_offload``: shards on the CPU outside ``train_mode()``, on the GPU
    inside; the export gathers offloaded shards (on the GPU, as NCCL needs) and matches."""
    resident = ctx.engine()
    offloaded = ctx.engine(param_offload=True, optimizer_offload=True)
    assert {p.to_local().device.type for p in offloaded.model.parameters()} == {"cpu"}
    for name in ("A", "B"):
        with offloaded.train_mode():
            assert {p.to_local().device.type for p in offloaded.model.parameters()} == {"cuda"}
            offloaded.train_batch(ctx.local_batch(name), policy_loss_fn)
        train_step(resident, ctx.local_batch(name))
    assert {s["exp_avg"].to_local().device.type for s in offloaded.optimizer.state.values()} == {"cpu"}
    require(
        compare_state_dicts(
            "param_offload", "weights", exported(offloaded), dict(exported(resident)), ON_CUDA, ctx.rank
        )
    )


JOBS: dict[str, list[Property]] = {
    "two_ranks": [
        layout,
        shards_registered_after_inference,
        gradients_reduced_once_per_step,
        mixed_precision,
        cpu_offload,
        custom_units,
        recovers_from_a_failed_step,
        export_gathers_one_tensor_at_a_time,
        checkpoint_at_two_ranks,
        hf_export,
        refuses_moving_parameters_without_gradients,
        load_on_rank0_starts_like_every_rank_loading,
        load_on_rank0_that_forgets_buffers_is_caught,
        keep_params_gathered_gathers_once_per_step,
    ],
    "hsdp": [
        hsdp_layout,
        hsdp_matches_the_single_process_reference,
        hsdp_averaging_within_groups_is_caught,
        hsdp_checkpoint_loads_into_plain_fsdp,
        hsdp_load_on_rank0_starts_like_every_rank_loading,
        shard_size_must_divide_the_ranks,
    ],
    "one_rank": [resumes_checkpoint_of_two_ranks, one_rank_group_runs_unsharded],
    "cuda": [bf16_on_cuda, cpu_offload_on_cuda, param_offload_on_cuda],
}


def outcome(prop: Property, ctx: RankContext) -> str | None:
    try:
        prop(ctx)
    except Exception:
        # Also into the rank's log: a property that fails on one rank alone leaves the others in its
        # collectives, and the timeout's report carries the logs, not this rank's results file.
        reason = traceback.format_exc()
        print(f"{prop.__name__} failed on rank {ctx.rank}:\n{reason}", file=sys.stderr)
        return reason
    return None


def run_job(rank: Rank, job: str, workdir: str) -> None:
    """The rank side of ``spawn``: the process group is up; check the job's properties in order."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    registry = Registry.from_plugins(autoload=True)  # the installed entry point, as users get it
    dirs = ModelDirs.under(Path(workdir) / "model")
    ctx = RankContext(
        "fsdp", ("lm", "value"), None, registry, rank.rank, rank.world_size, rank.device, dirs, Path(workdir)
    )
    results = {prop.__name__: outcome(prop, ctx) for prop in JOBS[job]}
    (Path(workdir) / f"{job}_rank{rank.rank}.json").write_text(json.dumps(results, indent=2))
