"""The rollout kit's weight checks: ``weight_sync`` (the weights an engine sends are the weights the
rollout samples with, every one of them), ``weight_refusals`` (what does not fit the model is
refused, and a refused update leaves the rollout unusable until a complete one), and contract 2's
``weight_buckets`` (the same through verified buckets: a corrupt, missing or truncated stream is
refused) and ``sleep`` (sleep then wake keeps the weights). They replace the rollout's weights and put
the original ones back; they run last.

Weights are sent as an engine's ``get_per_tensor_param`` sends them (``send_weights``): a generator
of full tensors under Hugging Face names, in state-dict order, on the rollout's device. Once
``update_weights`` returns, the kit zeroes every tensor it sent, as the next optimiser step of an
engine that sends views of its live parameters (an unsharded one) overwrites them: a rollout must
copy what it keeps.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Iterator

import attrs
import torch

from verl_core.data.batch import RESPONSES, ROLLOUT_LOG_PROBS
from verl_core.testing import reference
from verl_core.testing.context import BASE_OPTIM
from verl_core.testing.report import BITWISE, CheckSkipped, Comparison, compare_tensors
from verl_core.testing.rollout_context import (
    LOG_PROB_TOLERANCE,
    PROMPT_LENGTH,
    SYNC_MIN_CHANGE,
    RolloutContext,
    Row,
    compare_log_probs,
    make_prompts,
    reference_log_probs,
    rows_of,
)
from verl_core.testing.tiny import make_samples

#: The seed of the probe weights (``probe_weights``).
PROBE_SEED = 5
#: At most this many tensors are named when the rollout's log-probs are explained by tensors that
#: kept their values from before an update.
MAX_STALE_NAMED = 8


def check_weight_sync(ctx: RolloutContext) -> Iterator[Comparison]:
    """Three updates, each followed by 8 prompts at T = 1 whose log-probs must be those of the weights
    sent: the weights after one AdamW step of the engine kit's policy loss (what a trainer sends;
    it moves the log-probs by up to ~0.25, but some tensors, the q/k biases, by ~1e-5 only), then
    the probe weights (every tensor changed: leaving any single one at its original value moves the
    log-probs by more than ``SYNC_MIN_CHANGE``, which the kit verifies on the rollout's own tokens),
    then the original weights back."""
    check = "weight_sync"
    trained = reference.reference_step(ctx.model_dir, "lm", make_samples(1), BASE_OPTIM, 1.0).model.eval()
    original = ctx.reference()
    probe = probe_weights(original)
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=108)
    for label, weights, stale in (
        ("the trained weights", trained, original),
        ("the probe weights (every tensor changed)", probe, trained),
        ("the original weights back", original, probe),
    ):
        send_weights(ctx, weights)
        output = ctx.generate(prompts, seed=29)
        expected, mask = reference_log_probs(weights, output, 1.0)
        before, _ = reference_log_probs(stale, output, 1.0)
        change = float((expected - before).abs()[mask].max()) if bool(mask.any()) else 0.0
        if change < SYNC_MIN_CHANGE:
            raise RuntimeError(
                f"rollout kit bug: the weight update moves the reference's log-probs by only {change:.3g} "
                f"(< {SYNC_MIN_CHANGE:g}), too little to tell new weights from old"
            )
        comparison = compare_log_probs(
            check,
            f"after syncing {label}: rollout_log_probs",
            output,
            expected,
            mask,
            "synced reference",
            ctx.tolerance,
        )
        if weights is probe and comparison.passed:  # tokens drawn from the probe: a fair test of it
            _every_tensor_matters(probe, original, rows_of(output))
        yield comparison
        if not comparison.passed:
            # A tensor an update skips keeps its original value: after the probe, each one shows.
            initial = original if weights is probe else None
            diagnosis = _diagnose(check, label, output, mask, weights, stale, change, initial)
            if diagnosis is not None:
                yield diagnosis


def check_weight_refusals(ctx: RolloutContext) -> Iterator[Comparison]:
    """``update_weights`` with the original weights but for one defect (a name the model does not
    have, sent in addition; a weight left out; a weight transposed) must raise ``RolloutError``
    naming the tensor, and until a complete update succeeds ``generate`` must raise too (the weights
    may be half-written). Each is followed by a complete update; after the last one the rollout
    must sample with the original weights again."""
    from verl_core.errors import RolloutError

    check = "weight_refusals"
    original = ctx.reference()
    state = original.state_dict()
    names = list(state)
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=112)
    # A fused name some engines export (vLLM's, Megatron's layouts), holding what it fuses.
    unknown = "model.layers.0.self_attn.qkv_proj.weight"
    fused = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    missing = "model.norm.weight"
    misshapen = next(name for name in names if state[name].dim() == 2 and len(set(state[name].shape)) == 2)
    defects = {
        f"an unknown name ({unknown!r}, besides every weight)": (
            unknown,
            [*state.items(), (unknown, fused)],
        ),
        f"a missing weight ({missing!r} left out)": (
            missing,
            [(name, tensor) for name, tensor in state.items() if name != missing],
        ),
        f"a misshapen weight ({misshapen!r} transposed)": (
            misshapen,
            [(name, tensor.t() if name == misshapen else tensor) for name, tensor in state.items()],
        ),
    }
    for label, (culprit, tensors) in defects.items():
        quantity = f"update_weights with {label}"
        try:
            ctx.rollout.update_weights(
                (name, tensor.detach().to(ctx.device, copy=True)) for name, tensor in tensors
            )
        except RolloutError as error:
            refused = True
            names_it = culprit in str(error)
            yield Comparison(
                check,
                quantity,
                0,
                names_it,
                f"refused with RolloutError{'' if names_it else f', but the message does not name {culprit!r}'}: "
                f"{error}",
            )
        except Exception as error:
            refused = True
            yield Comparison(
                check,
                quantity,
                0,
                False,
                f"raised {type(error).__name__}: {error}; the contract raises verl_core.rollout.RolloutError "
                f"naming {culprit!r}",
            )
        else:
            refused = False
            yield Comparison(
                check,
                quantity,
                0,
                False,
                f"accepted without an error: a weight an engine sends under a name, or in a shape, the rollout's "
                f"model does not have is silently dropped (or {culprit!r} silently left as it was); the contract "
                f"raises RolloutError naming {culprit!r}",
            )
        if refused:
            yield _refuses_to_generate(ctx, f"generate after refusing {label}", prompts)
        # What a rollout keeps of the tensors it was sent is weight_sync's to check, not this one's.
        send_weights(ctx, original, overwrite=False)
    yield samples_with(
        ctx, check, "after a complete update: rollout_log_probs", original, prompts, 43, "original reference"
    )


def _refuses_to_generate(
    ctx: RolloutContext, quantity: str, prompts: list[list[int]], check: str = "weight_refusals"
) -> Comparison:
    """``generate`` must raise ``RolloutError`` now: after a refused update, or (``check`` ``sleep``) asleep."""
    from verl_core.errors import RolloutError

    try:
        ctx.generate(prompts, seed=43)
    except RolloutError as error:
        return Comparison(check, quantity, 0, True, f"refused with RolloutError: {error}")
    except Exception as error:
        return Comparison(
            check,
            quantity,
            0,
            False,
            f"raised {type(error).__name__}: {error}; the contract raises verl_core.rollout.RolloutError",
        )
    if check == "sleep":
        why = (
            "generated while asleep: the contract has generate raise RolloutError naming wake_up() until then"
        )
    else:
        why = (
            "generated after a refused update, from weights that may be half-written: the contract leaves the "
            "rollout unusable (generate raises RolloutError) until a complete update succeeds"
        )
    return Comparison(check, quantity, 0, False, why)


def samples_with(
    ctx: RolloutContext,
    check: str,
    quantity: str,
    model: torch.nn.Module,
    prompts: list[list[int]],
    seed: int,
    against: str,
) -> Comparison:
    """``generate`` at T = 1 on ``prompts``: its log-probs must be ``model``'s (the weights the rollout
    should sample with now), within ``ctx.tolerance``."""
    output = ctx.generate(prompts, seed=seed)
    expected, mask = reference_log_probs(model, output, 1.0)
    return compare_log_probs(check, quantity, output, expected, mask, against, ctx.tolerance)


def send_weights(ctx: RolloutContext, model: torch.nn.Module, overwrite: bool = True) -> None:
    """``update_weights`` with ``model``'s weights as an engine's ``get_per_tensor_param`` yields them:
    one full tensor at a time, Hugging Face names, state-dict order, on the rollout's device. Once
    it returns, every tensor sent is zeroed (``overwrite``), as an engine's next step overwrites the
    live parameters it sent."""
    sent: list[torch.Tensor] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():
            sent.append(tensor.detach().to(ctx.device, copy=True))
            yield name, sent[-1]

    ctx.rollout.update_weights(stream())
    if overwrite:
        with torch.no_grad():
            for tensor in sent:
                tensor.zero_()


def probe_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every tensor changed by seeded noise: ``std`` of the tensor, or 0.1
    for a constant one (norm weights, zero biases), so that each tensor moves the log-probs."""
    probe = copy.deepcopy(model).eval()
    generator = torch.Generator().manual_seed(PROBE_SEED)
    with torch.no_grad():
        for tensor in probe.state_dict().values():
            scale = max(float(tensor.float().std()), 0.1) if tensor.numel() > 1 else 0.1
            tensor.add_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * scale)
    return probe


def _every_tensor_matters(new: torch.nn.Module, old: torch.nn.Module, rows: list[Row]) -> None:
    """Raise (a kit bug) unless leaving any single tensor of ``new`` at its ``old`` value moves the
    log-probs of the rollout's tokens by ``SYNC_MIN_CHANGE`` or more: then the comparison with
    ``new``'s log-probs shows any tensor an update missed."""
    width = max((int(row.columns.max()) + 1 for row in rows if row.response), default=0)
    synced = _log_probs_with(new, rows, width)
    for name, stale in _stale_variants(new, old):
        change = float((_log_probs_with(stale, rows, width) - synced).abs().max())
        if change < SYNC_MIN_CHANGE:
            raise RuntimeError(
                f"rollout kit bug: the probe weights with {name!r} left as before move the log-probs by "
                f"only {change:.3g} (< {SYNC_MIN_CHANGE:g}): an update that missed it could not be seen"
            )


def _stale_variants(new: torch.nn.Module, old: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, new with that tensor at its old value)`` for every tensor, one at a time (the tensor
    is put back before the next)."""
    new_state, old_state = new.state_dict(), old.state_dict()
    with torch.no_grad():
        for name, tensor in new_state.items():
            kept = tensor.clone()
            tensor.copy_(old_state[name])
            try:
                yield name, new
            finally:
                tensor.copy_(kept)


def _log_probs_with(model: torch.nn.Module, rows: list[Row], width: int) -> torch.Tensor:
    """``[B, width]`` log-probs at T = 1 of every row's response under ``model``, at the row's response
    columns (0 elsewhere). Faster than ``reference_log_probs`` for the many models compared here: the
    rows (prompts of ``PROMPT_LENGTH`` tokens) run in one batch, responses right-padded, which in a
    causal model changes nothing before the padding."""
    longest = max((len(row.response) for row in rows), default=0)
    input_ids = torch.zeros(len(rows), PROMPT_LENGTH + longest, dtype=torch.int64)
    for index, row in enumerate(rows):
        input_ids[index, : len(row.prompt) + len(row.response)] = torch.tensor([*row.prompt, *row.response])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, PROMPT_LENGTH - 1 : -1].double()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, PROMPT_LENGTH:, None])[..., 0]
    placed = torch.zeros(len(rows), width, dtype=torch.float64)
    for index, row in enumerate(rows):
        placed[index, row.columns] = log_probs[index, : len(row.response)]
    return placed


def _diagnose(
    check: str,
    label: str,
    output,
    mask: torch.Tensor,
    weights: torch.nn.Module,
    stale: torch.nn.Module,
    change: float,
    initial: torch.nn.Module | None,
) -> Comparison | None:
    """Why the log-probs after syncing ``label`` are not ``weights``': those of ``stale``, the weights
    before the update (nothing reached the sampler), of the zeros the kit wrote into the tensors it
    sent (the rollout shares them), or, given the ``initial`` weights (after the probe, where each
    tensor shows), of ``weights`` with some tensors left at their initial values (named)."""
    actual = output[ROLLOUT_LOG_PROBS].double()

    def theirs(model: torch.nn.Module, quantity: str, whose: str) -> Comparison | None:
        expected, _ = reference_log_probs(model, output, 1.0)
        same = compare_log_probs(check, "", output, expected, mask, "")
        if not same.passed:
            return None
        return Comparison(
            check,
            f"after syncing {label}: {quantity}",
            0,
            False,
            f"the rollout's log-probs are those of {whose} (max |difference| {same.max_abs_diff:.3g}, while "
            f"the sync moves them by up to {change:.3g}): update_weights does not reach the weights it "
            "samples with",
            same.max_abs_diff,
        )

    before = theirs(stale, "not the weights before the sync", "the weights before the sync")
    if before is not None:
        return before
    vocabulary = weights.get_output_embeddings().weight.shape[0]
    uniform = torch.full_like(actual, -math.log(vocabulary))
    close = torch.isclose(actual, uniform, atol=LOG_PROB_TOLERANCE.atol, rtol=LOG_PROB_TOLERANCE.rtol)
    if bool(close[mask].all()):
        return Comparison(
            check,
            f"after syncing {label}: not the tensors it was sent",
            0,
            False,
            f"every log-prob is log(1/{vocabulary}): the rollout samples with the zeros the kit wrote into the "
            "tensors it had sent, once update_weights returned: it keeps the sent tensors instead of copying "
            "them (load_state_dict(..., assign=True), param.data = tensor), so an engine's next step changes "
            "the rollout's weights",
        )
    if initial is None:
        return None
    still = theirs(initial, "still the initial weights", "the weights it was initialised with")
    if still is not None:
        return still
    named = _stale_tensors(weights, initial, rows_of(output), actual, mask)
    if not named:
        return None
    return Comparison(
        check,
        f"after syncing {label}: weights left as before",
        0,
        False,
        f"the rollout's log-probs are those of the weights sent but for {len(named)} tensor(s) left at their "
        f"initial values: {', '.join(named)}; update_weights skips them (a name map that lacks them? a "
        "loader written for another architecture?)",
    )


def _stale_tensors(
    weights: torch.nn.Module,
    stale: torch.nn.Module,
    rows: list[Row],
    actual: torch.Tensor,
    mask: torch.Tensor,
) -> list[str]:
    """The smallest set of tensors (at most ``MAX_STALE_NAMED``, found greedily) that, left at their
    ``stale`` values in ``weights``, give the rollout's log-probs ``actual``; empty if none does."""
    weights = copy.deepcopy(weights)
    old_state = stale.state_dict()
    chosen: list[str] = []
    for _ in range(MAX_STALE_NAMED):
        best = None
        for name, variant in _stale_variants(weights, stale):
            if name in chosen:
                continue
            difference = float((_log_probs_with(variant, rows, actual.shape[1]) - actual).abs()[mask].max())
            if best is None or difference < best[0]:
                best = (difference, name)
        if best is None:
            return []
        chosen.append(best[1])
        with torch.no_grad():
            weights.state_dict()[best[1]].copy_(old_state[best[1]])
        if best[0] <= LOG_PROB_TOLERANCE.atol + LOG_PROB_TOLERANCE.rtol * float(actual.abs()[mask].max()):
            return chosen
    return []


# -- contract 2: bucketed sync -------------------------------------------------------------------------

#: ``weight_buckets``: the bucket size, small enough that the kit's model (105 KiB) travels in 13.
KIT_BUCKET_BYTES = 8192


def check_weight_buckets(ctx: RolloutContext) -> Iterator[Comparison]:
    """``update_weights_from_buckets`` with the probe weights packed by ``weight_buckets`` into buckets of
    ``KIT_BUCKET_BYTES``: the rollout samples with them, also once the kit has zeroed the buckets (a
    sender reusing its buffer). Then the original weights' stream with one
    defect each (a byte of bucket 1 flipped after its checksum was taken; bucket 2 left out; the final
    bucket left out) must raise ``RolloutError`` naming the bucket, and ``generate`` must refuse until a
    complete stream has arrived, after which the rollout samples with the original weights."""
    from verl_core.errors import RolloutError
    from verl_core.rollout.buckets import weight_buckets

    check = "weight_buckets"
    original = ctx.reference()
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=120)

    def stream(model: torch.nn.Module) -> list:
        state = (
            (name, tensor.detach().to(ctx.device, copy=True)) for name, tensor in model.state_dict().items()
        )
        return list(weight_buckets(state, KIT_BUCKET_BYTES))

    probe_model = probe_weights(original)
    probe = stream(probe_model)
    ctx.rollout.update_weights_from_buckets(iter(probe))
    # A sender may reuse its staging buffer for the next bucket (verl's does): a rollout copies what it keeps.
    for bucket in probe:
        bucket.buffer.zero_()
    buckets = stream(original)
    yield samples_with(
        ctx,
        check,
        f"after {len(probe)} buckets of the probe weights: rollout_log_probs",
        probe_model,
        prompts,
        53,
        "probe reference",
    )
    corrupt = buckets[1].buffer.clone()
    corrupt[len(corrupt) // 2] ^= 0x40
    defects = {
        "a corrupt bucket (a byte of bucket 1 flipped)": (
            "bucket 1",
            [buckets[0], attrs.evolve(buckets[1], buffer=corrupt), *buckets[2:]],
        ),
        "a missing bucket (bucket 2 left out)": ("bucket 2", [*buckets[:2], *buckets[3:]]),
        "a truncated stream (the final bucket left out)": ("final", buckets[:-1]),
    }
    for label, (named, defective) in defects.items():
        quantity = f"update_weights_from_buckets with {label}"
        try:
            ctx.rollout.update_weights_from_buckets(iter(defective))
        except RolloutError as error:
            names_it = named in str(error)
            yield Comparison(
                check,
                quantity,
                0,
                names_it,
                f"refused with RolloutError{'' if names_it else f', but the message does not say {named!r}'}: {error}",
            )
        except Exception as error:
            yield Comparison(
                check,
                quantity,
                0,
                False,
                f"raised {type(error).__name__}: {error}; the contract raises verl_core.rollout.RolloutError",
            )
        else:
            yield Comparison(
                check,
                quantity,
                0,
                False,
                "accepted without an error: a bucket stream is checked as it arrives (verl_core.rollout.buckets."
                "unpack_buckets: the checksum, the index, the final bucket) and a defective one refused",
            )
        yield _refuses_to_generate(ctx, f"generate after {label}", prompts, check)
    ctx.rollout.update_weights_from_buckets(iter(buckets))
    yield samples_with(
        ctx, check, "after a complete stream: rollout_log_probs", original, prompts, 53, "original reference"
    )


# -- contract 2: sleep ---------------------------------------------------------------------------------


def check_sleep(ctx: RolloutContext) -> Iterator[Comparison]:
    """After syncing the probe weights (so that waking up with the weights it was initialised with shows),
    greedy responses; then ``sleep()``: ``generate``, ``generate_request`` and a weight update raise
    ``RolloutError`` naming ``wake_up()``; then ``wake_up()``: the same greedy responses and log-probs as
    before (compared with themselves, not the reference: which weights an update reaches is
    ``weight_sync``'s to check). The original weights are synced back at the end."""
    from verl_core.errors import RolloutError
    from verl_core.rollout.requests import RolloutRequest

    check = "sleep"
    if not ctx.capabilities.sleep:
        raise CheckSkipped(f"backend '{ctx.backend}' declares sleep=False: sleep() and wake_up() do nothing")
    original = ctx.reference()
    probe = probe_weights(original)
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=121)
    send_weights(ctx, probe, overwrite=False)  # what a rollout keeps of the tensors is weight_sync's to check
    before = ctx.generate(prompts, seed=0, temperature=0.0, max_new_tokens=8)
    ctx.rollout.sleep()
    try:
        yield _refuses_to_generate(ctx, "generate while asleep", prompts, check)

        async def request() -> None:
            await ctx.rollout.generate_request(
                RolloutRequest(prompts[0], ctx.sampling(), request_id="kit-asleep")
            )

        for label, call in (
            ("generate_request while asleep", lambda: asyncio.run(request())),
            ("update_weights while asleep", lambda: send_weights(ctx, probe, overwrite=False)),
        ):
            try:
                call()
            except RolloutError as error:
                names_it = "wake_up" in str(error)
                yield Comparison(
                    check,
                    label,
                    0,
                    names_it,
                    f"refused with RolloutError{'' if names_it else ' not naming wake_up()'}: {error}",
                )
            except Exception as error:
                yield Comparison(
                    check, label, 0, False, f"raised {type(error).__name__}: {error}, not RolloutError"
                )
            else:
                yield Comparison(
                    check,
                    label,
                    0,
                    False,
                    "accepted while asleep: the contract raises RolloutError naming wake_up()",
                )
    finally:
        ctx.rollout.wake_up()
    after = ctx.generate(prompts, seed=0, temperature=0.0, max_new_tokens=8)
    tokens = compare_tensors(
        check,
        "after wake_up: the greedy responses of before",
        after[RESPONSES],
        before[RESPONSES],
        BITWISE,
        0,
        against="before sleep()",
        subject="after wake_up()",
    )
    yield tokens
    if tokens.passed:
        log_probs = compare_tensors(
            check,
            "after wake_up: the rollout_log_probs of before",
            after[ROLLOUT_LOG_PROBS],
            before[ROLLOUT_LOG_PROBS],
            ctx.tolerance,
            0,
            against="before sleep()",
            subject="after wake_up()",
        )
        if not log_probs.passed:
            initial, mask = reference_log_probs(original, after, 0.0)
            if compare_log_probs(check, "", after, initial, mask, "", ctx.tolerance).passed:
                log_probs = attrs.evolve(
                    log_probs,
                    detail=f"{log_probs.detail}; they are the log-probs of the weights the rollout was "
                    "initialised with: wake_up() reloads the checkpoint instead of the weights the rollout had "
                    "when it slept",
                )
        yield log_probs
    send_weights(ctx, original, overwrite=False)
