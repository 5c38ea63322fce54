"""What every conformance check on one rank works with: the engines of the backend under test, built
as a user's config would build them, this rank's share of the kit's batches, the single-process
reference's results (computed once), the configurations and tolerances the checks use, and the
comparisons several checks share.

Batches are sharded by the engine's data-parallel layout (``dp_rank`` of ``dp_size``, as the first
engine of the job reports it), not by the world: the tensor- and pipeline-parallel ranks of one
model replica all get their DP rank's share, as the trainer sends it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.data.batch import CANDIDATE_IDS, COMPUTE_ENTROPY, TEACHER_TOP_K_LOG_PROBS, TEMPERATURE, TOP_K
from verl_core.engine.base import BaseEngine, LossFn
from verl_core.engine.topology import Topology, check_topologies
from verl_core.testing import reference
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.losses import policy_loss_fn, value_loss_fn
from verl_core.testing.report import (
    BITWISE,
    Comparison,
    Tolerance,
    compare_scalars,
    compare_state_dicts,
    compare_tensors,
)

# Its home is the report (a skip is what a check records); the checks import it from here.
from verl_core.testing.report import CheckSkipped as CheckSkipped
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
    teacher_top_k,
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
#: The ``top_k_log_probs`` check's ``k``: the engine's top-k, and the teacher's top-k ids it is
#: given as ``candidate_ids``.
TOP_K_SIZE = 4
#: On CUDA, what ``to("cpu")`` must free of what an engine held after a step: the AdamW moments are
#: twice the parameters, so moving only the optimiser frees at least a quarter, moving all of it
#: leaves at most a twentieth (caches, the odd scalar).
OPTIMIZER_SHARE_FREED = 0.25
LEFT_AFTER_FULL_OFFLOAD = 0.05


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
        model: Mapping[str, Any] | None = None,
        **flags: Any,
    ) -> BaseEngine:
        """A fresh, initialised engine of the backend under test, found through the registry.
        ``model``: further ``ModelConfig`` fields (LoRA's)."""
        from verl_core.engine.factory import build_engine

        config = EngineConfig(
            backend=self.backend,
            model=ModelConfig(path=(dirs or self.dirs).for_role(role), dtype="float32", **(model or {})),
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

    def local_distillation_batch(self) -> TensorDict:
        """``local_batch("A")`` asking for the top ``TOP_K_SIZE`` tokens (``top_k``) and the log-probs at
        a teacher's top-k ids (``candidate_ids``), whose log-probs ``teacher_top_k_log_probs`` the
        distillation loss reads (``teacher_top_k``: 0 after each response)."""
        batch = self.local_batch("A")
        ids, log_probs = zip(*self.teacher_top_k()[self.rows], strict=True)
        batch[CANDIDATE_IDS] = reference.pad_responses(ids)
        batch[TEACHER_TOP_K_LOG_PROBS] = reference.pad_responses(log_probs)
        batch.set_non_tensor(TOP_K, TOP_K_SIZE)
        return batch

    def teacher_top_k(self) -> list[reference.TeacherTopK]:
        """A made-up teacher's top ``TOP_K_SIZE`` ids and log-probs at each response token of batch A."""
        if "teacher" not in self._cache:
            self._cache["teacher"] = teacher_top_k(self.samples["A"], TOP_K_SIZE, seed=BATCH_SEEDS["A"])
        return self._cache["teacher"]

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

    def reference_log_softmax(self) -> torch.Tensor:
        """The reference's tempered log-softmax ``[b, R, V]`` on batch A for this rank's rows."""
        if "log_softmax" not in self._cache:
            model = reference.load_reference_model(self.dirs.lm, "lm")
            self._cache["log_softmax"] = reference.reference_log_softmax(
                model, self.samples["A"], KIT_TEMPERATURE
            )
        return self._cache["log_softmax"][self.rows]

    def reference_distillation_step(self) -> reference.ReferenceStep:
        """One reference AdamW step of the full batch A with ``BASE_OPTIM`` on the distillation loss
        (``teacher_top_k``)."""
        if "step/distillation" not in self._cache:
            self._cache["step/distillation"] = reference.reference_step(
                self.dirs.lm, "lm", self.samples["A"], BASE_OPTIM, KIT_TEMPERATURE, self.teacher_top_k()
            )
        return self._cache["step/distillation"]

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


def train_step(
    engine: BaseEngine, batch: TensorDict, role: str = "lm", loss_fn: LossFn | None = None
) -> dict[str, float]:
    """One step of ``engine`` on ``batch`` with ``loss_fn`` (by default the kit's loss for ``role``)."""
    loss_fn = loss_fn or (value_loss_fn if role == "value" else policy_loss_fn)
    with engine.train_mode():
        return engine.train_batch(batch, loss_fn)


def infer(engine: BaseEngine, batch: TensorDict) -> TensorDict | None:
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs


# -- comparisons used by several checks -----------------------------------------------------------


def compare_outputs(
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


def compare_first_step(
    ctx: RankContext,
    check: str,
    metrics: Mapping[str, float],
    params: list[tuple[str, torch.Tensor]],
    prefix: str = "",
    role: str = "lm",
) -> list[Comparison]:
    """Loss, gradient norm, learning rate and parameters after step 1 against the reference step."""
    step = ctx.reference_step(role)
    return compare_step(ctx, check, metrics, params, step, prefix, BITWISE, "parameters after step 1")


def compare_step(
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


def compare_runs(
    check: str, quantity: str, actual: Any, expected: Any, rank: int, against: str
) -> list[Comparison]:
    """Bitwise comparison of two runs' results: scalars, tensors, or exported parameters."""
    if isinstance(expected, list):
        return compare_state_dicts(check, quantity, actual, dict(expected), BITWISE, rank, against=against)
    if isinstance(expected, torch.Tensor):
        return [compare_tensors(check, quantity, actual, expected, BITWISE, rank, against=against)]
    return [compare_scalars(check, quantity, actual, expected, BITWISE, rank, against=against)]
