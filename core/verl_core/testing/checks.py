"""The conformance checks. Each runs on every rank of one spawned job against fresh engines.

A check is a function ``(RankContext) -> list[Comparison]``; it raises ``CheckSkipped`` when it
does not apply (no value role, a single DP rank). Every rank calls the engine in the same order, so
the engine's collectives line up; comparisons are local (each rank compares its own share) except
where a check gathers from all ranks on purpose. ``CHECKS`` lists them in the order they run.

Batches are sharded by the engine's data-parallel layout (``dp_rank`` of ``dp_size``, as the first
engine of the job reports it), not by the world: the tensor- and pipeline-parallel ranks of one
model replica all get their DP rank's share, as the trainer sends it. Outputs are compared on
``is_output_rank`` ranks only; the reported loss, grad norm and learning rate and the exported
weights on every rank.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.engine.base import COMPUTE_ENTROPY, TEMPERATURE, BaseEngine
from verl_core.engine.checkpoint import MARKER_FILE
from verl_core.engine.topology import Topology, check_topologies
from verl_core.testing import reference
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.losses import policy_loss_fn, value_loss_fn
from verl_core.testing.races import publication_held
from verl_core.testing.report import (
    BITWISE,
    Comparison,
    Tolerance,
    compare_scalars,
    compare_state_dicts,
    compare_tensors,
)
from verl_core.testing.tiny import (
    BATCH_SIZE,
    ModelDirs,
    Sample,
    TinyModelSpec,
    collate,
    make_samples,
    response_token_mask,
    save_tiny_models,
    shard,
)

# -- tolerances (fp32 on CPU; measured differences against the reference are ~10x smaller) -------

#: Log-probs, entropy and values: the engine runs padded batches, the reference unpadded samples.
OUTPUT_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5)
#: The reported loss and gradient norm of one step.
STEP_SCALAR_TOLERANCE = Tolerance(atol=1e-6, rtol=1e-5)
#: Parameters after one AdamW step with ``lr=1e-3``: 0.1% of a step. Adam's first update is
#: ``lr * g / (|g| + eps)``, which turns a gradient rounding difference ``d`` into a parameter
#: difference of up to ``lr * d / eps``; ``BASE_OPTIM.eps`` keeps that at or below ~1e-7 for the
#: ~1e-10 (padded vs unpadded) to ~1e-8 (sharded reductions) gradient differences of correct engines.
STEP_PARAM_TOLERANCE = Tolerance(atol=1e-6, rtol=0.0)

# -- the engine configurations the checks use -----------------------------------------------------

#: One constant-rate AdamW step, clipping active (the tiny model's first gradient norm is ~1.7).
#: ``eps=1e-4`` makes updates of small gradients proportional to them (an engine that computes some
#: gradients wrongly moves those weights visibly) and bounds rounding noise (see above); weight
#: decay is large enough that skipping it on any tensor (norms, say) shows.
BASE_OPTIM = OptimConfig(lr=1e-3, betas=(0.9, 0.999), eps=1e-4, weight_decay=0.1, clip_grad=1.0)
#: Two padded sequences per micro-batch: the base engine already accumulates gradients. The
#: ``packing`` check runs the padding-free path (the default of ``micro_batch.packing``).
BASE_MICRO_BATCH = MicroBatchConfig(micro_batch_size=2, packing=False)
#: Tokens per chunk of the ``logits_chunks`` check: every micro-batch of the kit spans several chunks,
#: and most end in a partial one.
LOGITS_CHUNK_SIZE = 3
#: A schedule whose rate changes at every step (linear decay without warmup: 1e-3, 0.84e-3, 0.68e-3,
#: 0.52e-3, ...), so a scheduler that is not stepped, stepped on another optimiser, or not restored
#: from a checkpoint gives another rate within the steps the checks compare.
SCHEDULE_OPTIM = attrs.evolve(BASE_OPTIM, lr_scheduler="linear", total_steps=5, min_lr_ratio=0.2)
#: Reported learning rates against the written-out schedule: the same formula, in floating point.
LR_TOLERANCE = Tolerance(atol=0.0, rtol=1e-12)
#: The token budget of the dynamic micro-batching split (sequences hold 5 to 14 tokens).
DYNAMIC_MAX_TOKEN_LEN = 20
#: Seeds of the batches: step 1 trains on A, step 2 on B, step 3 on C. A's samples share prompts
#: in groups, as GRPO's do (engines that pack may compute a shared prompt once).
BATCH_SEEDS = {"A": 1, "B": 2, "C": 3}
SHARED_PROMPT_BATCHES = ("A",)
#: On CUDA, what ``to("cpu")`` must free of what an engine held after a step: the AdamW moments are
#: twice the parameters, so moving only the optimiser frees at least a quarter, moving all of it
#: leaves at most a twentieth (caches, the odd scalar).
OPTIMIZER_SHARE_FREED = 0.25
LEFT_AFTER_FULL_OFFLOAD = 0.05


class CheckSkipped(Exception):
    """The check does not apply to this backend or world size; the message says why."""


@attrs.define
class JobLayout:
    """This rank's place in the layout of the job's engines, as the first engine built reported it.
    Shared by a ``RankContext`` and the copies ``attrs.evolve`` makes of it (other options, say), so
    that batches and engines agree whichever copy built the first engine."""

    topology: Topology | None = None


@attrs.define
class RankContext:
    """What every check on one rank needs: the backend, this rank's place, the tiny model and the
    batches, and the reference results (computed once, on first use).

    ``rank`` and ``world_size`` are the spawned job's; the DP layout that shards the batches
    (``dp_rank``, ``dp_size``) is the engine's, recorded from the first engine ``engine()`` builds
    (by this context or a copy of it).
    """

    backend: str
    roles: tuple[str, ...]
    options: Any
    registry: Any
    rank: int
    world_size: int
    device: str
    dirs: ModelDirs
    workdir: Path
    #: The job's rendezvous store, for coordination outside collectives (``races``); None: none.
    store: Any = None
    samples: dict[str, list[Sample]] = attrs.field(
        init=False,
        factory=lambda: {
            name: make_samples(seed, share_prompts=name in SHARED_PROMPT_BATCHES)
            for name, seed in BATCH_SEEDS.items()
        },
    )
    _cache: dict[str, Any] = attrs.field(init=False, factory=dict)
    _layout: JobLayout = attrs.field(factory=JobLayout, repr=False)

    # -- engines ---------------------------------------------------------------------------------

    def engine(
        self,
        role: str = "lm",
        optim: OptimConfig = BASE_OPTIM,
        micro_batch: MicroBatchConfig = BASE_MICRO_BATCH,
        dirs: ModelDirs | None = None,
        **flags: Any,
    ) -> BaseEngine:
        """A fresh, initialised engine of the backend under test, found through the registry."""
        from verl_core.engine import build_engine

        config = EngineConfig(
            backend=self.backend,
            model=ModelConfig(path=(dirs or self.dirs).for_role(role), dtype="float32"),
            options=copy.deepcopy(self.options),
            optim=optim,
            micro_batch=micro_batch,
            device=self.device,
            seed=0,
            **flags,
        )
        engine = build_engine(config, role, self.registry)
        engine.initialize()
        self._record_topology(engine)
        return engine

    def topology(self) -> Topology:
        """This rank's DP rank, DP size and output-rank flag. Before any check has built an engine,
        builds one to learn them: a collective, so call it on every rank."""
        if self._layout.topology is None:
            self.engine()
        return self._layout.topology

    @property
    def dp_rank(self) -> int:
        """This rank's DP rank: whose share of every batch it gets."""
        return self._recorded_topology().dp_rank

    @property
    def dp_size(self) -> int:
        """The engine's DP size: how many shares every batch is split into."""
        return self._recorded_topology().dp_size

    def _recorded_topology(self) -> Topology:
        if self._layout.topology is None:
            raise RuntimeError(
                "conformance kit bug: the DP layout was read before any engine was built; call "
                "ctx.engine() or ctx.topology() (on every rank) first"
            )
        return self._layout.topology

    def _record_topology(self, engine: Any) -> None:
        """Keep the first engine's DP layout; refuse a later engine that reports another one (the
        batches are already sharded by the first)."""
        mine = Topology(engine.dp_rank, engine.dp_size, engine.is_output_rank)
        first = self._layout.topology
        if first is not None:
            if mine != first:
                raise RuntimeError(
                    f"backend '{self.backend}' changed its layout on rank {self.rank}: the first engine of "
                    f"this job reported {first}, this one {mine}; every engine of one job must report the "
                    "same dp_rank, dp_size and is_output_rank, since the job's batches are sharded by the "
                    "first (for engines of another layout, use another RankContext)"
                )
            return
        topologies: list[Any] = [mine]
        if dist.is_initialized():
            topologies = [None] * dist.get_world_size()
            dist.all_gather_object(topologies, mine)
        # What the trainer requires too: one DP size, and one output rank per DP rank (the kit
        # compares each DP share's outputs on the rank that owns them).
        check_topologies(topologies, f"backend '{self.backend}'")
        if BATCH_SIZE % mine.dp_size:
            raise ValueError(
                f"backend '{self.backend}' reports dp_size={mine.dp_size} at world_size={self.world_size}, "
                f"which does not divide the conformance batch of {BATCH_SIZE} sequences; use a world size "
                f"whose DP size divides {BATCH_SIZE}"
            )
        self._layout.topology = mine

    # -- batches ---------------------------------------------------------------------------------

    @property
    def rows(self) -> slice:
        """This rank's rows of every batch: its DP rank's share."""
        return shard(self.samples["A"], self.dp_rank, self.dp_size)

    def share(self, name: str, dp_rank: int) -> list[Sample]:
        """The samples of batch ``name`` that DP rank ``dp_rank`` trains on."""
        return self.samples[name][shard(self.samples[name], dp_rank, self.dp_size)]

    def local_batch(self, name: str) -> TensorDict:
        """This rank's share of batch ``name`` (fresh: engines attach counts to what they get)."""
        batch = collate(self.share(name, self.dp_rank))
        batch.set_non_tensor(TEMPERATURE, KIT_TEMPERATURE)
        batch.set_non_tensor(COMPUTE_ENTROPY, True)
        return batch

    def local_token_mask(self) -> torch.Tensor:
        """Where this rank's share of batch A has response tokens."""
        return response_token_mask(collate(self.share("A", self.dp_rank)))

    # -- reference -------------------------------------------------------------------------------

    def reference_outputs(self, role: str) -> dict[str, torch.Tensor]:
        """Reference outputs on batch A for this rank's rows."""
        key = f"outputs/{role}"
        if key not in self._cache:
            model = reference.load_reference_model(self.dirs.for_role(role), role)
            self._cache[key] = reference.reference_outputs(model, self.samples["A"], role, KIT_TEMPERATURE)
        return {name: values[self.rows] for name, values in self._cache[key].items()}

    def reference_step(self, role: str = "lm") -> reference.ReferenceStep:
        """One reference AdamW step of the full batch A with ``BASE_OPTIM``."""
        key = f"step/{role}"
        if key not in self._cache:
            self._cache[key] = reference.reference_step(
                self.dirs.for_role(role), role, self.samples["A"], BASE_OPTIM, KIT_TEMPERATURE
            )
        return self._cache[key]

    def reference_schedule(self) -> list[reference.ReferenceStep]:
        """Three reference AdamW steps (batches A, B, C) at the rates of ``SCHEDULE_OPTIM``."""
        if "schedule" not in self._cache:
            batches = [self.samples[name] for name in "ABC"]
            self._cache["schedule"] = reference.reference_steps(
                self.dirs.lm, "lm", batches, SCHEDULE_OPTIM, KIT_TEMPERATURE
            )
        return self._cache["schedule"]

    def other_model_dirs(self) -> ModelDirs:
        """A tiny model of another size (hidden 48), saved by rank 0: a checkpoint must not load into it."""
        if "other" not in self._cache:
            directory = self.workdir / "other_model"
            if self.rank == 0:
                save_tiny_models(directory, TinyModelSpec(hidden_size=48, intermediate_size=96))
            dist.barrier()
            self._cache["other"] = ModelDirs.under(directory)
        return self._cache["other"]

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights as ``from_pretrained`` loads them."""
        if "initial" not in self._cache:
            self._cache["initial"] = reference.hf_state_dict(self.dirs.lm, "lm")
        return self._cache["initial"]


def exported(engine: BaseEngine) -> list[tuple[str, torch.Tensor]]:
    """Everything ``get_per_tensor_param`` yields, copied to CPU (a collective on sharded engines)."""
    return [(name, tensor.detach().to("cpu").clone()) for name, tensor in engine.get_per_tensor_param()]


def train_step(engine: BaseEngine, batch: TensorDict, role: str = "lm") -> dict[str, float]:
    loss_fn = value_loss_fn if role == "value" else policy_loss_fn
    with engine.train_mode():
        return engine.train_batch(batch, loss_fn)


def infer(engine: BaseEngine, batch: TensorDict) -> TensorDict | None:
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs


# -- comparisons used by several checks -----------------------------------------------------------


def _compare_outputs(
    ctx: RankContext,
    check: str,
    outputs: TensorDict | None,
    names: tuple[str, ...],
    role: str = "lm",
    prefix: str = "",
) -> list[Comparison]:
    """Engine outputs on batch A against the reference, on every real response token."""
    if outputs is None:
        return [Comparison(check, f"{prefix}outputs", ctx.rank, False, "infer_batch returned no outputs")]
    expected = ctx.reference_outputs(role)
    mask = ctx.local_token_mask()
    return [
        compare_tensors(
            check,
            f"{prefix}{name}",
            outputs.get(name, None),
            expected[name],
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask,
        )
        for name in names
    ]


def _compare_first_step(
    ctx: RankContext,
    check: str,
    metrics: Mapping[str, float],
    params: list[tuple[str, torch.Tensor]],
    prefix: str = "",
    role: str = "lm",
) -> list[Comparison]:
    """Loss, gradient norm, learning rate and parameters after step 1 against the reference step."""
    step = ctx.reference_step(role)
    return _compare_step(ctx, check, metrics, params, step, prefix, BITWISE, "parameters after step 1")


def _compare_step(
    ctx: RankContext,
    check: str,
    metrics: Mapping[str, float],
    params: list[tuple[str, torch.Tensor]],
    step: reference.ReferenceStep,
    prefix: str = "",
    lr_tolerance: Tolerance = LR_TOLERANCE,
    params_label: str = "parameters",
) -> list[Comparison]:
    """One step's reported loss, gradient norm and learning rate, and the weights after it, against
    the reference's step."""
    return [
        compare_scalars(
            check, f"{prefix}loss", metrics.get("loss"), step.loss, STEP_SCALAR_TOLERANCE, ctx.rank
        ),
        compare_scalars(
            check,
            f"{prefix}grad_norm",
            metrics.get("grad_norm"),
            step.grad_norm,
            STEP_SCALAR_TOLERANCE,
            ctx.rank,
        ),
        compare_scalars(check, f"{prefix}lr", metrics.get("lr"), step.lr, lr_tolerance, ctx.rank),
        *compare_state_dicts(
            check, f"{prefix}{params_label}", params, step.params, STEP_PARAM_TOLERANCE, ctx.rank
        ),
    ]


def _compare_runs(
    check: str, quantity: str, actual: Any, expected: Any, rank: int, against: str
) -> list[Comparison]:
    """Bitwise comparison of two runs' results: scalars, tensors, or exported parameters."""
    if isinstance(expected, list):
        return compare_state_dicts(check, quantity, actual, dict(expected), BITWISE, rank, against=against)
    if isinstance(expected, torch.Tensor):
        return [compare_tensors(check, quantity, actual, expected, BITWISE, rank, against=against)]
    return [compare_scalars(check, quantity, actual, expected, BITWISE, rank, against=against)]


# -- the checks ------------------------------------------------------------------------------------


def check_log_probs(ctx: RankContext) -> list[Comparison]:
    engine = ctx.engine()
    outputs = infer(engine, ctx.local_batch("A"))
    if not engine.is_output_rank:
        return []
    return _compare_outputs(ctx, "log_probs", outputs, ("log_probs", "entropy"))


def check_values(ctx: RankContext) -> list[Comparison]:
    if "value" not in ctx.roles:
        raise CheckSkipped(f"backend '{ctx.backend}' does not list role 'value' (its roles: {ctx.roles})")
    engine = ctx.engine(role="value")
    outputs = infer(engine, ctx.local_batch("A"))
    comparisons = []
    if engine.is_output_rank:
        comparisons += _compare_outputs(ctx, "values", outputs, ("values",), role="value")
    # The critic trains too: its head must take gradients like the backbone.
    metrics = train_step(engine, ctx.local_batch("A"), role="value")
    return comparisons + _compare_first_step(
        ctx, "values", metrics, exported(engine), prefix="value ", role="value"
    )


def check_first_step(ctx: RankContext) -> list[Comparison]:
    engine = ctx.engine()
    metrics = train_step(engine, ctx.local_batch("A"))
    return _compare_first_step(ctx, "first_step", metrics, exported(engine))


def micro_batch_splits(ctx: RankContext) -> dict[str, MicroBatchConfig]:
    """The splits whose results must not differ: one sequence, the whole share, a token budget."""
    local_size = len(ctx.share("A", ctx.topology().dp_rank))
    return {
        "micro_batch_size=1": MicroBatchConfig(micro_batch_size=1),
        f"micro_batch_size={local_size} (whole share)": MicroBatchConfig(micro_batch_size=local_size),
        f"dynamic, max_token_len={DYNAMIC_MAX_TOKEN_LEN}": MicroBatchConfig(
            use_dynamic_bsz=True, max_token_len=DYNAMIC_MAX_TOKEN_LEN
        ),
    }


def check_micro_batch_invariance(ctx: RankContext) -> list[Comparison]:
    comparisons = []
    for label, split in micro_batch_splits(ctx).items():
        comparisons += _outputs_and_first_step(ctx, "micro_batch_invariance", split, f"{label}: ")
    return comparisons


def check_packing(ctx: RankContext) -> list[Comparison]:
    """Padding-free micro-batches (``micro_batch.packing``) change nothing: the same outputs and the
    same first step as the reference, which runs every sample alone (attention crossing from one
    packed sequence into the next shows as a difference). One micro-batch holds the rank's whole
    share, so that the samples of a prompt group meet in it (an engine may pack their prompt once)."""
    split = attrs.evolve(BASE_MICRO_BATCH, micro_batch_size=BATCH_SIZE, packing=True)
    return _outputs_and_first_step(ctx, "packing", split, "packed: ")


def check_logits_chunks(ctx: RankContext) -> list[Comparison]:
    """Log-probs from the LM head ``LOGITS_CHUNK_SIZE`` tokens at a time (``micro_batch.logits_chunk_size``)
    change nothing, padded and packed: the same outputs and first step (whose gradients flow back
    through the recomputed chunks) as the reference, which computes all the logits at once. The kit's
    micro-batches of two sequences predict up to 16 tokens, far below the default chunk, so it is set
    small enough for several chunks and a partial last one."""
    comparisons = []
    for label, packing in (("padded", False), ("packed", True)):
        split = attrs.evolve(BASE_MICRO_BATCH, packing=packing, logits_chunk_size=LOGITS_CHUNK_SIZE)
        comparisons += _outputs_and_first_step(
            ctx, "logits_chunks", split, f"{label}, logits_chunk_size={LOGITS_CHUNK_SIZE}: "
        )
    return comparisons


def _outputs_and_first_step(
    ctx: RankContext, check: str, split: MicroBatchConfig, prefix: str
) -> list[Comparison]:
    """A fresh engine with micro-batching ``split``: its log-probs and entropy on batch A, then its
    first step on A, against the reference."""
    engine = ctx.engine(micro_batch=split)
    outputs = infer(engine, ctx.local_batch("A"))
    comparisons = []
    if engine.is_output_rank:
        comparisons += _compare_outputs(ctx, check, outputs, ("log_probs", "entropy"), prefix=prefix)
    metrics = train_step(engine, ctx.local_batch("A"))
    return comparisons + _compare_first_step(ctx, check, metrics, exported(engine), prefix)


def check_dp_invariance(ctx: RankContext) -> list[Comparison]:
    # The layout an earlier check's engine reported: no engine is built only to be skipped.
    if ctx.topology().dp_size == 1:
        raise CheckSkipped(
            f"needs 2 or more DP ranks: backend '{ctx.backend}' has dp_size=1 at world_size={ctx.world_size} "
            "(data-parallel invariance is checked at a world size that gives dp_size > 1)"
        )
    engine = ctx.engine()
    tokens = [sum(int(s.loss_mask.sum()) for s in ctx.share("A", dp_rank)) for dp_rank in range(ctx.dp_size)]
    if len(set(tokens)) == 1:
        raise RuntimeError(
            f"conformance kit bug: the DP shares must carry unequal token counts, got {tokens}"
        )
    metrics = train_step(engine, ctx.local_batch("A"))
    params = exported(engine)
    comparisons = _compare_first_step(ctx, "dp_invariance", metrics, params, f"{tokens} tokens per DP rank: ")
    # Every rank (every DP rank, and every model-parallel rank of a replica) must end the step with
    # the same weights and report the same global numbers.
    mine = {"loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "params": params}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        for key in ("loss", "grad_norm", "params"):
            comparisons += _compare_runs(
                "dp_invariance", f"{key} (vs rank 0)", mine[key], gathered[0][key], ctx.rank, "rank 0"
            )
    return comparisons


def check_lr_schedule(ctx: RankContext) -> list[Comparison]:
    engine = ctx.engine(optim=SCHEDULE_OPTIM)
    comparisons = []
    for number, (name, step) in enumerate(zip("ABC", ctx.reference_schedule(), strict=True), start=1):
        metrics = train_step(engine, ctx.local_batch(name))
        comparisons += _compare_step(ctx, "lr_schedule", metrics, exported(engine), step, f"step {number}: ")
    return comparisons


def check_checkpoint(ctx: RankContext) -> list[Comparison]:
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

    resumed = ctx.engine(optim=SCHEDULE_OPTIM)
    step = resumed.load_checkpoint(str(path))
    against = "uninterrupted run"
    comparisons = [
        Comparison(
            "checkpoint",
            "checkpoint present when save_checkpoint returns",
            ctx.rank,
            present,
            f"{path} is in place on this rank"
            if present
            else f"{path} does not exist yet on this rank: "
            "save_checkpoint returned before the writing rank finished (end it with a barrier over every "
            "rank that calls it, as verl_core.engine.atomic_checkpoint does)",
        ),
        Comparison(
            "checkpoint",
            "global step",
            ctx.rank,
            step == 2,
            f"load_checkpoint returned {step!r}, saved with global_step=2",
        ),
    ]
    for number, name, (metrics, params) in zip((3, 4), "CA", expected, strict=True):
        actual = train_step(resumed, ctx.local_batch(name))
        for key in ("loss", "grad_norm", "lr"):
            comparisons += _compare_runs(
                "checkpoint", f"step {number} {key}", actual.get(key), metrics.get(key), ctx.rank, against
            )
        comparisons += _compare_runs(
            "checkpoint", f"parameters after step {number}", exported(resumed), params, ctx.rank, against
        )
    del resumed
    comparisons.append(_refuses(ctx, "a checkpoint with a truncated file", _damaged_copy(ctx, path)))
    comparisons.append(_refuses(ctx, "a checkpoint of another model", path, dirs=ctx.other_model_dirs()))
    comparisons.append(_refuses(ctx, "a checkpoint of another backend", _foreign_checkpoint(ctx)))
    return comparisons


def _foreign_checkpoint(ctx: RankContext) -> Path:
    """An (empty) complete checkpoint that another engine backend wrote."""
    from verl_core.engine.checkpoint import atomic_checkpoint

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
    from verl_core.engine.checkpoint import CheckpointError

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


def check_weight_export(ctx: RankContext) -> list[Comparison]:
    engine = ctx.engine()
    first = exported(engine)
    comparisons = compare_state_dicts(
        "weight_export",
        "get_per_tensor_param",
        first,
        ctx.initial_state_dict(),
        BITWISE,
        ctx.rank,
        against="Hugging Face state dict",
    )
    # The rollout pulls weights after every step: a second export must give the same again.
    comparisons += compare_state_dicts(
        "weight_export",
        "second get_per_tensor_param",
        exported(engine),
        dict(first),
        BITWISE,
        ctx.rank,
        against="first export",
    )
    return comparisons


def check_hf_export(ctx: RankContext) -> list[Comparison]:
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
        return [
            Comparison(
                "hf_export",
                "export present when save_hf_model returns",
                ctx.rank,
                False,
                f"{path}/config.json does not exist yet on this rank: save_hf_model returned before the "
                "writing rank finished (end it with a barrier over every rank that calls it: the DP group, "
                "or the world for a model-parallel engine)",
            )
        ]
    loaded = reference.load_reference_model(path, "lm")
    comparisons = compare_state_dicts(
        "hf_export",
        "from_pretrained(export)",
        loaded.state_dict().items(),
        ctx.reference_step().params,
        STEP_PARAM_TOLERANCE,
        ctx.rank,
        against="reference after step 1",
    )
    if not engine.is_output_rank:
        return comparisons
    if engine_outputs is None:
        return [
            *comparisons,
            Comparison("hf_export", "outputs", ctx.rank, False, "infer_batch returned no outputs"),
        ]
    # The export's own config decides its logits: a wrong rope_theta, norm epsilon or head count
    # shows here even when every tensor is right.
    from_export = reference.reference_outputs(loaded, ctx.share("A", ctx.dp_rank), "lm", KIT_TEMPERATURE)
    for name in ("log_probs", "entropy"):
        comparisons.append(
            compare_tensors(
                "hf_export",
                f"{name} of from_pretrained(export)",
                from_export[name],
                engine_outputs.get(name, None),
                OUTPUT_TOLERANCE,
                ctx.rank,
                ctx.local_token_mask(),
                against="engine's infer_batch",
            )
        )
    return comparisons


def check_offload(ctx: RankContext) -> list[Comparison]:
    not_exercised = (
        "not exercised: the engine computes on the CPU, where to('cpu') and param/optimizer offload move "
        "nothing, so neither the move nor the round trip can be observed; run the kit with device='cuda'"
    )
    if ctx.device.split(":")[0] == "cpu":  # no engine is built only to be skipped
        raise CheckSkipped(not_exercised)
    probe = ctx.engine()
    if probe.device.type == "cpu":  # an engine that runs on the CPU whatever it is asked
        raise CheckSkipped(not_exercised)
    comparisons = _offload_frees_device_memory(ctx, probe)
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
                comparisons += _compare_runs(
                    "offload",
                    f"{label}: {key}",
                    results[key]["log_probs"],
                    baseline[key]["log_probs"],
                    ctx.rank,
                    against,
                )
        for key in ("step 1", "step 2"):
            for metric in ("loss", "grad_norm"):
                comparisons += _compare_runs(
                    "offload",
                    f"{label}: {key} {metric}",
                    results[key].get(metric),
                    baseline[key].get(metric),
                    ctx.rank,
                    against,
                )
        comparisons += _compare_runs(
            "offload",
            f"{label}: parameters after step 2",
            results["parameters"],
            baseline["parameters"],
            ctx.rank,
            against,
        )
    return comparisons


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


@attrs.frozen
class Check:
    """A named check with a one-line statement of what it proves (docs/conformance.md has more)."""

    name: str
    run: Callable[[RankContext], list[Comparison]]
    proves: str


CHECKS: dict[str, Check] = {
    check.name: check
    for check in (
        Check(
            "log_probs",
            check_log_probs,
            "log-probs and entropy at temperature 0.7 equal the unpadded HF model's",
        ),
        Check(
            "values",
            check_values,
            "a value engine's per-token values, and one critic step, equal the token-classification model's",
        ),
        Check(
            "first_step",
            check_first_step,
            "loss, grad norm, lr and weights after one AdamW step equal the reference",
        ),
        Check(
            "micro_batch_invariance",
            check_micro_batch_invariance,
            "micro-batch size 1, the whole share, and token-budget batching all give the reference's results",
        ),
        Check(
            "packing",
            check_packing,
            "padding-free micro-batches (micro_batch.packing) give the reference's outputs and first step",
        ),
        Check(
            "logits_chunks",
            check_logits_chunks,
            "log-probs from the LM head 3 tokens at a time (micro_batch.logits_chunk_size), padded and packed, "
            "give the reference's outputs and first step",
        ),
        Check(
            "dp_invariance",
            check_dp_invariance,
            "DP ranks with unequal token counts together equal the single-process full batch, and all "
            "ranks agree",
        ),
        Check(
            "lr_schedule",
            check_lr_schedule,
            "three steps of a schedule whose rate changes every step: rates, losses and weights equal the reference",
        ),
        Check(
            "checkpoint",
            check_checkpoint,
            "save after step 2, load into a fresh engine: steps 3 and 4 are bitwise identical; damaged "
            "checkpoints and another model's are refused with CheckpointError",
        ),
        Check(
            "weight_export", check_weight_export, "get_per_tensor_param: HF names, order, shapes and values"
        ),
        Check(
            "hf_export",
            check_hf_export,
            "save_hf_model: from_pretrained gets the trained weights and the engine's log-probs",
        ),
        Check(
            "offload",
            check_offload,
            "to('cpu') frees the device, param/optimizer offload keeps it free; results bitwise unchanged "
            "(not exercised on the CPU)",
        ),
    )
}
