"""The conformance check of LoRA, for backends that declare ``EngineBackend(lora=True)``. See
``checks`` for how checks run.

After one AdamW step of a rank-``LORA_RANK`` adapter (``B`` starts at zero, so before it the adapter
changes nothing and every broken variant would pass): the reference policy (``reference()``) is the
base model; the weight export is the model the engine runs (the Hugging Face model loaded with it
gives the engine's log-probs in eval mode, so a stale merge, the base weights or adapter dropout left
on at inference fail), after the first step and again after a second (a merge computed once and
reused fails there); exactly the target modules' weights changed, each by a matrix of rank at most
``LORA_RANK`` (trained base weights change norms and embeddings and give full-rank changes; ignored
target modules change others); the merged change scales with ``lora_alpha`` (an engine with twice the
alpha, the same seed and step, changes the weights twice as much); and a checkpoint restores the
adapter exactly.

The configuration differs from peft's defaults in every key (rank 8, alpha 8, the model type's q/v
projections, no dropout), so that an engine that ignores one of them, and so runs peft's default,
fails: with the defaults, it would pass.
"""

from __future__ import annotations

import attrs
import torch

from verl_core.data.batch import LOG_PROBS
from verl_core.engine.base import BaseEngine
from verl_core.hookspecs import Kind
from verl_core.testing import reference
from verl_core.testing.context import (
    BASE_OPTIM,
    OUTPUT_TOLERANCE,
    CheckSkipped,
    RankContext,
    compare_runs,
    exported,
    infer,
    train_step,
)
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.report import Comparison, compare_tensors

LORA_RANK = 4
#: Linear layers of the kit's Qwen2 that the adapter adapts: neither peft's default for the model type
#: (q_proj, v_proj) nor every linear layer.
LORA_TARGETS = ("q_proj", "k_proj", "o_proj", "down_proj")
#: Model fields of the check's engines, none at peft's default.
LORA_MODEL = {
    "lora_rank": LORA_RANK,
    "lora_alpha": 3 * LORA_RANK,
    "target_modules": list(LORA_TARGETS),
    "lora_dropout": 0.25,
}
#: The seed of the steps compared across engines (dropout draws the same masks in each).
STEP_SEED = 1234
#: The kit's optimiser with AdamW's ``eps`` at 1e-12: its first step moves each element of ``B`` by
#: ``lr * g / (|g| + eps)``, the same for a gradient twice as large only while ``|g| >> eps`` (at the
#: kit's 1e-4, elements of the tiny model's ``B`` with gradients near it made the ratio below 2.14).
LORA_OPTIM = attrs.evolve(BASE_OPTIM, eps=1e-12)
#: How far the ratio of the merged changes of two engines, one with twice the other's alpha, may be
#: from 2.
ALPHA_RATIO_TOLERANCE = 0.02
#: A change of a weight counts as rank ``k`` when its ``k+1``-th singular value is below this share of
#: its largest: a merge in float32 adds rounding noise ~1e-5 of the adapter's change, a trained base
#: weight changes by singular values of the order of the largest.
RANK_THRESHOLD = 1e-3


def check_lora(ctx: RankContext) -> list[Comparison]:
    descriptor = ctx.registry.entry(Kind.ENGINE_BACKENDS, ctx.backend).descriptor
    if not descriptor.lora:
        raise CheckSkipped(f"backend '{ctx.backend}' does not declare EngineBackend(lora=True)")
    engine = ctx.engine(optim=LORA_OPTIM, model=LORA_MODEL)
    _seeded_step(ctx, engine)
    comparisons = _reference_is_the_base(ctx, engine)
    weights = exported(engine)
    comparisons += _export_is_what_runs(ctx, engine, weights, "after a step")
    comparisons.append(_only_the_targets_trained(ctx, weights))
    comparisons.append(_change_scales_with_alpha(ctx, weights))
    comparisons += _checkpoint_restores_the_adapter(ctx, engine)  # a second step on the engine
    return comparisons + _export_is_what_runs(ctx, engine, exported(engine), "after a second step")


def _seeded_step(ctx: RankContext, engine: BaseEngine) -> None:
    """One step on batch ``A`` from ``STEP_SEED`` (the adapter's dropout masks), the kit's RNG state
    left as it was."""
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(STEP_SEED)
        train_step(engine, ctx.local_batch("A"))


def _reference_is_the_base(ctx: RankContext, engine: BaseEngine) -> list[Comparison]:
    if not engine.serves_reference:
        return [
            Comparison(
                "lora",
                "serves_reference",
                ctx.rank,
                False,
                "a LoRA engine must serve the reference policy (the base model) through reference()",
            )
        ]
    with engine.reference():
        outputs = infer(engine, ctx.local_batch("A"))
    if not engine.is_output_rank:
        return []
    expected = ctx.reference_outputs("lm")[LOG_PROBS]
    return [
        compare_tensors(
            "lora",
            "reference() log-probs after a step",
            outputs[LOG_PROBS],
            expected,
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask=ctx.local_token_mask(),
            against="the base model",
        )
    ]


def _export_is_what_runs(
    ctx: RankContext, engine: BaseEngine, weights: list[tuple[str, torch.Tensor]], when: str
) -> list[Comparison]:
    outputs = infer(engine, ctx.local_batch("A"))
    if not engine.is_output_rank:
        return []
    model = reference.load_reference_model(ctx.dirs.lm, "lm")
    model.load_state_dict(dict(weights))
    expected = reference.reference_outputs(model, ctx.share("A", ctx.dp_rank), "lm", KIT_TEMPERATURE)
    return [
        compare_tensors(
            "lora",
            f"log-probs of the HF model loaded with the weight export, {when}",
            outputs[LOG_PROBS],
            expected[LOG_PROBS],
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask=ctx.local_token_mask(),
            against="the engine's own log-probs (the export must be the merged model of now)",
            subject="export",
        )
    ]


def _only_the_targets_trained(ctx: RankContext, weights: list[tuple[str, torch.Tensor]]) -> Comparison:
    initial = ctx.initial_state_dict()
    targeted = {
        name for name in initial if name.endswith(tuple(f".{target}.weight" for target in LORA_TARGETS))
    }
    problems, changed = [], set()
    for name, tensor in weights:
        change = tensor.double() - initial[name].double()
        if not change.any():
            continue
        changed.add(name)
        rank = _rank(change) if change.dim() == 2 else None
        if rank is None:
            problems.append(f"{name} changed, and no adapter covers a {change.dim()}-D weight")
        elif rank > LORA_RANK:
            problems.append(f"{name} changed by a rank-{rank} update, beyond the adapter's {LORA_RANK}")
    if changed - targeted:
        problems.append(
            f"{sorted(changed - targeted)[:3]} changed, outside target_modules {list(LORA_TARGETS)}: base weights "
            "trained, or the configured target modules ignored"
        )
    if targeted - changed:
        problems.append(
            f"{sorted(targeted - changed)[:3]} did not change, though target_modules {list(LORA_TARGETS)} name "
            "them: the configured target modules are ignored (or the adapter did not train or merge)"
        )
    detail = (
        f"{len(changed)} weights changed, those of {list(LORA_TARGETS)}, each by at most rank {LORA_RANK}"
    )
    return Comparison(
        "lora",
        "exactly the target modules' weights changed, each through the adapter (base weights frozen)",
        ctx.rank,
        not problems,
        "; ".join(problems[:4]) if problems else detail,
    )


def _change_scales_with_alpha(ctx: RankContext, weights: list[tuple[str, torch.Tensor]]) -> Comparison:
    """The merged change of an engine with twice the alpha, after the same seeded step, is twice as
    large: the adapter's scale is ``lora_alpha / lora_rank``."""
    twin = ctx.engine(optim=LORA_OPTIM, model={**LORA_MODEL, "lora_alpha": 2 * LORA_MODEL["lora_alpha"]})
    _seeded_step(ctx, twin)
    initial = ctx.initial_state_dict()

    def change(exported_weights: list[tuple[str, torch.Tensor]]) -> float:
        return sum(float((t.double() - initial[n].double()).norm() ** 2) for n, t in exported_weights) ** 0.5

    base, doubled = change(weights), change(exported(twin))
    ratio = doubled / base if base else float("nan")
    return Comparison(
        "lora",
        "the merged change with twice the lora_alpha, after the same step",
        ctx.rank,
        abs(ratio - 2.0) <= ALPHA_RATIO_TOLERANCE,
        f"{ratio:.4f} times the change at lora_alpha {LORA_MODEL['lora_alpha']}, expected 2 "
        f"(within {ALPHA_RATIO_TOLERANCE}): the scale is lora_alpha / lora_rank; 1 means lora_alpha is ignored",
    )


def _rank(change: torch.Tensor) -> int:
    singular = torch.linalg.svdvals(change)
    return int((singular > singular[0] * RANK_THRESHOLD).sum())


def _checkpoint_restores_the_adapter(ctx: RankContext, engine: BaseEngine) -> list[Comparison]:
    path = ctx.workdir / "lora_checkpoint"
    engine.save_checkpoint(str(path), global_step=1)
    saved = exported(engine)
    train_step(engine, ctx.local_batch("B"))
    expected = exported(engine)
    resumed = ctx.engine(optim=LORA_OPTIM, model=LORA_MODEL)
    resumed.load_checkpoint(str(path))
    against = "the engine that saved it"
    comparisons = compare_runs("lora", "weights after loading", exported(resumed), saved, ctx.rank, against)
    train_step(resumed, ctx.local_batch("B"))
    return comparisons + compare_runs(
        "lora", "weights one step after loading", exported(resumed), expected, ctx.rank, against
    )
