"""The conformance checks. Each runs on every rank of one spawned job against fresh engines.

A check is a function ``(RankContext) -> list[Comparison]``; it raises ``CheckSkipped`` when it
does not apply (no value role, a single rank). Every rank calls the engine in the same order, so
the engine's collectives line up; comparisons are local (each rank compares its own share) except
where a check gathers from all ranks on purpose. ``CHECKS`` lists them in the order they run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.engine.base import COMPUTE_ENTROPY, TEMPERATURE, BaseEngine
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
from verl_core.testing.tiny import ModelDirs, Sample, collate, make_samples, response_token_mask, shard

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
#: Two sequences per micro-batch: the base engine already accumulates gradients.
BASE_MICRO_BATCH = MicroBatchConfig(micro_batch_size=2)
#: A schedule whose rate changes between step 1 and step 2 (0.5e-3 then 1e-3), so a checkpoint
#: that loses the scheduler's state is caught.
CHECKPOINT_OPTIM = attrs.evolve(BASE_OPTIM, lr_warmup_steps=2, lr_scheduler="linear", total_steps=6)
#: The token budget of the dynamic micro-batching split (sequences hold 5 to 14 tokens).
DYNAMIC_MAX_TOKEN_LEN = 20
#: Seeds of the two batches: step 1 trains on A, step 2 on B.
BATCH_A_SEED, BATCH_B_SEED = 1, 2


class CheckSkipped(Exception):
    """The check does not apply to this backend or world size; the message says why."""


@attrs.define
class RankContext:
    """What every check on one rank needs: the backend, this rank's place, the tiny model and the
    batches, and the reference results (computed once, on first use)."""

    backend: str
    roles: tuple[str, ...]
    options: Any
    registry: Any
    rank: int
    world_size: int
    device: str
    dirs: ModelDirs
    workdir: Path
    samples: dict[str, list[Sample]] = attrs.field(
        init=False, factory=lambda: {"A": make_samples(BATCH_A_SEED), "B": make_samples(BATCH_B_SEED)}
    )
    _cache: dict[str, Any] = attrs.field(init=False, factory=dict)

    # -- engines ---------------------------------------------------------------------------------

    def engine(
        self,
        role: str = "lm",
        optim: OptimConfig = BASE_OPTIM,
        micro_batch: MicroBatchConfig = BASE_MICRO_BATCH,
        **flags: Any,
    ) -> BaseEngine:
        """A fresh, initialised engine of the backend under test, found through the registry."""
        from verl_core.engine import build_engine

        config = EngineConfig(
            backend=self.backend,
            model=ModelConfig(path=self.dirs.for_role(role), dtype="float32"),
            options=copy.deepcopy(self.options),
            optim=optim,
            micro_batch=micro_batch,
            device=self.device,
            seed=0,
            **flags,
        )
        engine = build_engine(config, role, self.registry)
        engine.initialize()
        return engine

    # -- batches ---------------------------------------------------------------------------------

    @property
    def rows(self) -> slice:
        """This rank's rows of every batch."""
        return shard(self.samples["A"], self.rank, self.world_size)

    def share(self, name: str, rank: int) -> list[Sample]:
        """The samples of batch ``name`` that DP rank ``rank`` trains on."""
        return self.samples[name][shard(self.samples[name], rank, self.world_size)]

    def local_batch(self, name: str) -> TensorDict:
        """This rank's share of batch ``name`` (fresh: engines attach counts to what they get)."""
        batch = collate(self.share(name, self.rank))
        batch.set_non_tensor(TEMPERATURE, KIT_TEMPERATURE)
        batch.set_non_tensor(COMPUTE_ENTROPY, True)
        return batch

    def local_token_mask(self) -> torch.Tensor:
        """Where this rank's share of batch A has response tokens."""
        return response_token_mask(collate(self.share("A", self.rank)))

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
        compare_scalars(check, f"{prefix}lr", metrics.get("lr"), step.lr, BITWISE, ctx.rank),
        *compare_state_dicts(
            check, f"{prefix}parameters after step 1", params, step.params, STEP_PARAM_TOLERANCE, ctx.rank
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
    local_size = len(ctx.share("A", ctx.rank))
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
        engine = ctx.engine(micro_batch=split)
        outputs = infer(engine, ctx.local_batch("A"))
        if engine.is_output_rank:
            comparisons += _compare_outputs(
                ctx, "micro_batch_invariance", outputs, ("log_probs", "entropy"), prefix=f"{label}: "
            )
        metrics = train_step(engine, ctx.local_batch("A"))
        comparisons += _compare_first_step(
            ctx, "micro_batch_invariance", metrics, exported(engine), f"{label}: "
        )
    return comparisons


def check_dp_invariance(ctx: RankContext) -> list[Comparison]:
    if ctx.world_size == 1:
        raise CheckSkipped("needs world_size > 1: data-parallel invariance is checked at 2 or more ranks")
    tokens = [sum(int(s.loss_mask.sum()) for s in ctx.share("A", rank)) for rank in range(ctx.world_size)]
    if len(set(tokens)) == 1:
        raise RuntimeError(
            f"conformance kit bug: the DP shares must carry unequal token counts, got {tokens}"
        )
    engine = ctx.engine()
    metrics = train_step(engine, ctx.local_batch("A"))
    params = exported(engine)
    comparisons = _compare_first_step(ctx, "dp_invariance", metrics, params, f"{tokens} tokens per rank: ")
    # Every rank must end the step with the same weights and report the same global numbers.
    mine = {"loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "params": params}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        for key in ("loss", "grad_norm", "params"):
            comparisons += _compare_runs(
                "dp_invariance", f"{key} (vs rank 0)", mine[key], gathered[0][key], ctx.rank, "rank 0"
            )
    return comparisons


def check_checkpoint(ctx: RankContext) -> list[Comparison]:
    path = str(ctx.workdir / "checkpoint")
    original = ctx.engine(optim=CHECKPOINT_OPTIM)
    train_step(original, ctx.local_batch("A"))
    original.save_checkpoint(path, global_step=1)
    expected = train_step(original, ctx.local_batch("B"))
    expected_params = exported(original)
    del original

    resumed = ctx.engine(optim=CHECKPOINT_OPTIM)
    step = resumed.load_checkpoint(path)
    actual = train_step(resumed, ctx.local_batch("B"))
    against = "uninterrupted run"
    comparisons = [
        Comparison(
            "checkpoint",
            "global step",
            ctx.rank,
            step == 1,
            f"load_checkpoint returned {step!r}, saved with global_step=1",
        )
    ]
    for key in ("loss", "grad_norm", "lr"):
        comparisons += _compare_runs(
            "checkpoint", f"step 2 {key}", actual.get(key), expected.get(key), ctx.rank, against
        )
    comparisons += _compare_runs(
        "checkpoint", "parameters after step 2", exported(resumed), expected_params, ctx.rank, against
    )
    return comparisons


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
    engine.save_hf_model(path)
    dist.barrier()  # whichever rank writes has finished
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
    from_export = reference.reference_outputs(loaded, ctx.share("A", ctx.rank), "lm", KIT_TEMPERATURE)
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
    comparisons = []
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
            "dp_invariance",
            check_dp_invariance,
            "ranks with unequal token counts together equal the single-process full batch, and agree",
        ),
        Check(
            "checkpoint",
            check_checkpoint,
            "save after step 1, load into a fresh engine: step 2 is bitwise identical",
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
            "offload", check_offload, "to('cpu') and back, param/optimizer offload: results bitwise unchanged"
        ),
    )
}
