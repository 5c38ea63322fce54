"""The conformance checks. Each runs on every rank of one spawned job against fresh engines.

A check is a function ``(RankContext) -> Iterator[Comparison]`` that yields its comparisons as it
makes them, so that one that raises partway still reports them (``report.run_check``); it raises
``CheckSkipped`` when it does not apply (no value role, a single DP rank). Every rank calls the engine in the same order, so
the engine's collectives line up; comparisons are local (each rank compares its own share) except
where a check gathers from all ranks on purpose. ``CHECKS`` lists them in the order they run: the
numbers here (outputs, steps, invariances, the schedule), the state in ``state_checks``
(checkpoints, exports, offload). ``context`` holds what they share, the tolerances included.
Outputs are compared on ``is_output_rank`` ranks only; the reported loss, grad norm and learning rate
and the exported weights on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from verl_core.config.engine import MicroBatchConfig
from verl_core.data.batch import (
    CANDIDATE_IDS,
    CANDIDATE_LOG_PROBS,
    ENTROPY,
    LOG_PROBS,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    VALUES,
)
from verl_core.hookspecs import Kind
from verl_core.testing import lora_checks, state_checks
from verl_core.testing.context import (
    BASE_MICRO_BATCH,
    BASE_OPTIM,
    DYNAMIC_MAX_TOKEN_LEN,
    LOGITS_CHUNK_SIZE,
    OUTPUT_TOLERANCE,
    SCHEDULE_OPTIM,
    STEP_PARAM_TOLERANCE,
    STEP_SCALAR_TOLERANCE,
    TOP_K_SIZE,
    CheckSkipped,
    RankContext,
    compare_first_step,
    compare_outputs,
    compare_runs,
    compare_step,
    exported,
    infer,
    train_step,
)
from verl_core.testing.losses import distillation_loss_fn
from verl_core.testing.report import BITWISE, Check, Comparison, compare_tensors
from verl_core.testing.tiny import BATCH_SIZE

__all__ = [
    "BASE_MICRO_BATCH",
    "BASE_OPTIM",
    "CHECKS",
    "OUTPUT_TOLERANCE",
    "SCHEDULE_OPTIM",
    "STEP_PARAM_TOLERANCE",
    "STEP_SCALAR_TOLERANCE",
    "Check",
    "CheckSkipped",
    "RankContext",
]


# -- the checks ------------------------------------------------------------------------------------


def check_log_probs(ctx: RankContext) -> Iterator[Comparison]:
    engine = ctx.engine()
    outputs = infer(engine, ctx.local_batch("A"))
    if engine.is_output_rank:
        yield from compare_outputs(ctx, "log_probs", outputs, (LOG_PROBS, ENTROPY))


def check_values(ctx: RankContext) -> Iterator[Comparison]:
    if "value" not in ctx.roles:
        raise CheckSkipped(f"backend '{ctx.backend}' does not list role 'value' (its roles: {ctx.roles})")
    engine = ctx.engine(role="value")
    outputs = infer(engine, ctx.local_batch("A"))
    if engine.is_output_rank:
        yield from compare_outputs(ctx, "values", outputs, (VALUES,), role="value")
    # The critic trains too: its head must take gradients like the backbone.
    metrics = train_step(engine, ctx.local_batch("A"), role="value")
    yield from compare_first_step(ctx, "values", metrics, exported(engine), prefix="value ", role="value")


def check_first_step(ctx: RankContext) -> Iterator[Comparison]:
    engine = ctx.engine()
    metrics = train_step(engine, ctx.local_batch("A"))
    yield from compare_first_step(ctx, "first_step", metrics, exported(engine))


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


def check_micro_batch_invariance(ctx: RankContext) -> Iterator[Comparison]:
    for label, split in micro_batch_splits(ctx).items():
        yield from outputs_and_first_step(ctx, "micro_batch_invariance", split, f"{label}: ")


def check_packing(ctx: RankContext) -> Iterator[Comparison]:
    """Padding-free micro-batches (``micro_batch.packing``) change nothing: the same outputs and the
    same first step as the reference, which runs every sample alone (attention crossing from one
    packed sequence into the next shows as a difference). One micro-batch holds the rank's whole
    share; every sample packs its own prompt (sharing them is the ``shared_prompts`` check's)."""
    split = attrs.evolve(BASE_MICRO_BATCH, micro_batch_size=BATCH_SIZE, packing=True, share_prompts=False)
    yield from outputs_and_first_step(ctx, "packing", split, "packed: ")


def check_shared_prompts(ctx: RankContext) -> Iterator[Comparison]:
    """For backends that declare ``EngineBackend(shared_prompts=True)``: packed micro-batches whose
    samples of one prompt share a single copy of it (``micro_batch.share_prompts``) change nothing.
    Batch A's samples come in groups of two or three with one prompt, as GRPO's do, and one
    micro-batch holds the rank's whole share: a response that reads a sibling's tokens, or whose
    positions restart after the shared prompt, differs from the reference, which runs every sample
    alone."""
    if not ctx.registry.entry(Kind.ENGINE_BACKENDS, ctx.backend).descriptor.shared_prompts:
        raise CheckSkipped(f"backend '{ctx.backend}' does not declare EngineBackend(shared_prompts=True)")
    split = attrs.evolve(BASE_MICRO_BATCH, micro_batch_size=BATCH_SIZE, packing=True, share_prompts=True)
    yield from outputs_and_first_step(ctx, "shared_prompts", split, "shared prompts: ")


def check_logits_chunks(ctx: RankContext) -> Iterator[Comparison]:
    """Log-probs from the LM head ``LOGITS_CHUNK_SIZE`` tokens at a time (``micro_batch.logits_chunk_size``)
    change nothing, padded and packed: the same outputs and first step (whose gradients flow back
    through the recomputed chunks) as the reference, which computes all the logits at once. The kit's
    micro-batches of two sequences predict up to 16 tokens, far below the default chunk, so it is set
    small enough for several chunks and a partial last one."""
    for label, packing in (("padded", False), ("packed", True)):
        split = attrs.evolve(BASE_MICRO_BATCH, packing=packing, logits_chunk_size=LOGITS_CHUNK_SIZE)
        yield from outputs_and_first_step(
            ctx, "logits_chunks", split, f"{label}, logits_chunk_size={LOGITS_CHUNK_SIZE}: "
        )


def check_top_k_log_probs(ctx: RankContext) -> Iterator[Comparison]:
    """For backends that declare ``EngineBackend(top_k_log_probs=True)``: with ``top_k`` and a
    teacher's top-k ids as ``candidate_ids`` on batch A, the ``k`` likeliest tokens and the log-probs
    at the given ids equal the reference's tempered log-softmax, and one step on the distillation
    loss over the candidates' log-probs (gradients through them) equals the reference's step. Padded
    micro-batches of two, then packed ones (prompts shared where the backend shares them) under a
    token budget with the LM head 3 tokens at a time."""
    if not ctx.registry.entry(Kind.ENGINE_BACKENDS, ctx.backend).descriptor.top_k_log_probs:
        raise CheckSkipped(f"backend '{ctx.backend}' does not declare EngineBackend(top_k_log_probs=True)")
    packed = attrs.evolve(
        BASE_MICRO_BATCH,
        packing=True,
        use_dynamic_bsz=True,
        max_token_len=DYNAMIC_MAX_TOKEN_LEN,
        logits_chunk_size=LOGITS_CHUNK_SIZE,
    )
    splits = {
        "padded: ": BASE_MICRO_BATCH,
        f"packed, max_token_len={DYNAMIC_MAX_TOKEN_LEN}, logits_chunk_size={LOGITS_CHUNK_SIZE}: ": packed,
    }
    for prefix, split in splits.items():
        engine = ctx.engine(micro_batch=split)
        outputs = infer(engine, ctx.local_distillation_batch())
        if engine.is_output_rank:
            yield from compare_top_k(ctx, outputs, prefix)
        metrics = train_step(engine, ctx.local_distillation_batch(), loss_fn=distillation_loss_fn)
        step = ctx.reference_distillation_step()
        yield from compare_step(
            ctx,
            "top_k_log_probs",
            metrics,
            exported(engine),
            step,
            prefix,
            BITWISE,
            "parameters after step 1",
        )


def compare_top_k(ctx: RankContext, outputs: Any, prefix: str) -> list[Comparison]:
    """The engine's top-k and candidate log-probs on batch A against the reference's log-softmax, on
    every real response token. The top-k log-probs must be the reference's ``k`` largest, descending;
    the reference's log-probs at the engine's top-k ids must be those too (the ids are the likeliest
    tokens, in order; where the reference ties, either order of the tied tokens passes)."""
    check = "top_k_log_probs"
    if outputs is None:
        return [Comparison(check, f"{prefix}outputs", ctx.rank, False, "infer_batch returned no outputs")]
    log_softmax = ctx.reference_log_softmax()
    mask = ctx.local_token_mask()[..., None]
    top_log_probs, top_ids = outputs.get(TOP_K_LOG_PROBS, None), outputs.get(TOP_K_IDS, None)
    at_ids = None
    if top_ids is not None:
        if top_ids.dtype != torch.int64 or top_ids.shape != (*mask.shape[:2], TOP_K_SIZE):
            return [
                Comparison(
                    check,
                    f"{prefix}{TOP_K_IDS}",
                    ctx.rank,
                    False,
                    f"{top_ids.dtype} {list(top_ids.shape)}, expected torch.int64 "
                    f"{[*mask.shape[:2], TOP_K_SIZE]}",
                )
            ]
        at_ids = log_softmax.gather(-1, top_ids.to("cpu").clamp(0, log_softmax.shape[-1] - 1))
    expected_top = log_softmax.topk(TOP_K_SIZE, dim=-1).values
    candidates = ctx.local_distillation_batch()[CANDIDATE_IDS]
    return [
        compare_tensors(
            check, f"{prefix}{TOP_K_LOG_PROBS}", top_log_probs, expected_top, OUTPUT_TOLERANCE, ctx.rank, mask
        ),
        compare_tensors(
            check,
            f"{prefix}reference log-probs at {TOP_K_IDS}",
            at_ids,
            expected_top,
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask,
            subject="reference at the engine's ids",
            against="reference's top-k",
        ),
        compare_tensors(
            check,
            f"{prefix}{CANDIDATE_LOG_PROBS}",
            outputs.get(CANDIDATE_LOG_PROBS, None),
            log_softmax.gather(-1, candidates),
            OUTPUT_TOLERANCE,
            ctx.rank,
            mask,
        ),
    ]


def outputs_and_first_step(
    ctx: RankContext, check: str, split: MicroBatchConfig, prefix: str
) -> Iterator[Comparison]:
    """A fresh engine with micro-batching ``split``: its log-probs and entropy on batch A, then its
    first step on A, against the reference."""
    engine = ctx.engine(micro_batch=split)
    outputs = infer(engine, ctx.local_batch("A"))
    if engine.is_output_rank:
        yield from compare_outputs(ctx, check, outputs, (LOG_PROBS, ENTROPY), prefix=prefix)
    metrics = train_step(engine, ctx.local_batch("A"))
    yield from compare_first_step(ctx, check, metrics, exported(engine), prefix)


def check_dp_invariance(ctx: RankContext) -> Iterator[Comparison]:
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
    yield from compare_first_step(ctx, "dp_invariance", metrics, params, f"{tokens} tokens per DP rank: ")
    # Every rank (every DP rank, and every model-parallel rank of a replica) must end the step with
    # the same weights and report the same global numbers.
    mine = {"loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"), "params": params}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        for key in ("loss", "grad_norm", "params"):
            yield from compare_runs(
                "dp_invariance", f"{key} (vs rank 0)", mine[key], gathered[0][key], ctx.rank, "rank 0"
            )


def check_lr_schedule(ctx: RankContext) -> Iterator[Comparison]:
    engine = ctx.engine(optim=SCHEDULE_OPTIM)
    for number, (name, step) in enumerate(zip("ABC", ctx.reference_schedule(), strict=True), start=1):
        metrics = train_step(engine, ctx.local_batch(name))
        yield from compare_step(ctx, "lr_schedule", metrics, exported(engine), step, f"step {number}: ")


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
            "shared_prompts",
            check_shared_prompts,
            "packed micro-batches whose samples of one prompt share one copy of it (backends declaring "
            "shared_prompts=True) give the reference's outputs and first step",
        ),
        Check(
            "top_k_log_probs",
            check_top_k_log_probs,
            "with top_k and a teacher's top-k ids as candidate_ids (backends declaring top_k_log_probs=True), "
            "padded and packed under a token budget with chunked logits: the top-k log-probs and ids and the "
            "candidates' log-probs equal the reference's, and one distillation step on them equals the reference",
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
            state_checks.check_checkpoint,
            "save after step 2, load into a fresh engine: steps 3 and 4 are bitwise identical; damaged "
            "checkpoints and another model's are refused with CheckpointError",
        ),
        Check(
            "weight_export",
            state_checks.check_weight_export,
            "get_per_tensor_param: HF names, order, shapes and values",
        ),
        Check(
            "hf_export",
            state_checks.check_hf_export,
            "save_hf_model: from_pretrained gets the trained weights and the engine's log-probs",
        ),
        Check(
            "lora",
            lora_checks.check_lora,
            "with a rank-4 adapter (backends declaring lora=True), after a step: reference() gives the base "
            "model's log-probs, the weight export is the model the engine runs, only low-rank changes, and "
            "a checkpoint restores the adapter bitwise",
        ),
        Check(
            "offload",
            state_checks.check_offload,
            "to('cpu') frees the device, param/optimizer offload keeps it free; results bitwise unchanged "
            "(not exercised on the CPU)",
        ),
    )
}
