"""The conformance check of LoRA, for backends that declare ``EngineBackend(lora=True)``. See
``checks`` for how checks run.

After one AdamW step of a rank-``LORA_RANK`` adapter (``B`` starts at zero, so before it the adapter
changes nothing and every broken variant would pass): the reference policy (``reference()``) is the
base model; the weight export is the model the engine runs (the Hugging Face model loaded with it
gives the engine's log-probs, so a stale merge or the base weights fail); only the adapter trained
(every exported tensor equals the base one, or differs from it by a matrix of rank at most
``LORA_RANK``: trained base weights change norms and embeddings and give full-rank changes); and a
checkpoint restores the adapter exactly.
"""

from __future__ import annotations

import torch

from verl_core.data.batch import LOG_PROBS
from verl_core.engine.base import BaseEngine
from verl_core.hookspecs import Kind
from verl_core.testing import reference
from verl_core.testing.context import (
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
#: Model fields of the check's engines: the default targets (every linear layer but the LM head).
LORA_MODEL = {"lora_rank": LORA_RANK, "lora_alpha": 2 * LORA_RANK}
#: A change of a weight counts as rank ``k`` when its ``k+1``-th singular value is below this share of
#: its largest: a merge in float32 adds rounding noise ~1e-5 of the adapter's change, a trained base
#: weight changes by singular values of the order of the largest.
RANK_THRESHOLD = 1e-3


def check_lora(ctx: RankContext) -> list[Comparison]:
    descriptor = ctx.registry.entry(Kind.ENGINE_BACKENDS, ctx.backend).descriptor
    if not descriptor.lora:
        raise CheckSkipped(f"backend '{ctx.backend}' does not declare EngineBackend(lora=True)")
    engine = ctx.engine(model=LORA_MODEL)
    train_step(engine, ctx.local_batch("A"))
    comparisons = _reference_is_the_base(ctx, engine)
    weights = exported(engine)
    comparisons += _export_is_what_runs(ctx, engine, weights)
    comparisons.append(_only_the_adapter_trained(ctx, weights))
    return comparisons + _checkpoint_restores_the_adapter(ctx, engine)


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
    ctx: RankContext, engine: BaseEngine, weights: list[tuple[str, torch.Tensor]]
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
            "log-probs of the HF model loaded with the weight export",
            outputs[LOG_PROBS],
            expected[LOG_PROBS],
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask=ctx.local_token_mask(),
            against="the engine's own log-probs (the export must be the merged model of now)",
            subject="export",
        )
    ]


def _only_the_adapter_trained(ctx: RankContext, weights: list[tuple[str, torch.Tensor]]) -> Comparison:
    initial = ctx.initial_state_dict()
    problems, changed = [], 0
    for name, tensor in weights:
        change = tensor.double() - initial[name].double()
        if not change.any():
            continue
        changed += 1
        rank = _rank(change) if change.dim() == 2 else None
        if rank is None:
            problems.append(f"{name} changed, and no adapter covers a {change.dim()}-D weight")
        elif rank > LORA_RANK:
            problems.append(f"{name} changed by a rank-{rank} update, beyond the adapter's {LORA_RANK}")
    if not changed:
        problems.append("no exported weight changed after a step: the adapter did not train (or merge)")
    detail = f"{changed} weights changed, each by at most rank {LORA_RANK}"
    return Comparison(
        "lora",
        "weights changed only through the adapter (base weights frozen)",
        ctx.rank,
        not problems,
        "; ".join(problems[:4]) if problems else detail,
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
    resumed = ctx.engine(model=LORA_MODEL)
    resumed.load_checkpoint(str(path))
    against = "the engine that saved it"
    comparisons = compare_runs("lora", "weights after loading", exported(resumed), saved, ctx.rank, against)
    train_step(resumed, ctx.local_batch("B"))
    return comparisons + compare_runs(
        "lora", "weights one step after loading", exported(resumed), expected, ctx.rank, against
    )
