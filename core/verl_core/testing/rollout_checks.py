"""The rollout conformance checks: does a rollout backend sample what the engine would score?

A check is a function ``(RolloutContext) -> list[Comparison]``, run in one process against one
initialised rollout of the kit's tiny model (``save_rollout_model``); one that cannot be exercised
raises the engine kit's ``CheckSkipped`` (none of today's checks needs to: they all run on any
device). ``ROLLOUT_CHECKS`` lists them in the order they run; ``weight_sync``, which replaces the
rollout's weights (and puts the original ones back), runs last.

Every number is compared with the independent reference of ``verl_core.testing.reference``: the
Hugging Face model run on each sample alone, unpadded, teacher-forced (``response_logits``), with
``log_softmax(logits / T)``: what a training engine computes for the same tokens. The responses
are read through the rollout's own ``response_mask``, so a layout bug shows in ``batch_contract``
and not again in every other check. Prompts of different lengths in one call are the subject of
``prompt_lengths`` (and of ``batch_contract``'s layout): the other checks give prompts of one
length, so that a padding bug fails one check, named for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from verl_core.data.batch import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from verl_core.testing import reference
from verl_core.testing.context import BASE_OPTIM
from verl_core.testing.report import BITWISE, Check, Comparison, compare_tensors
from verl_core.testing.rollout_context import (
    GREEDY_TIE_TOLERANCE,
    LOG_PROB_TOLERANCE,
    MIXED_PROMPT_LENGTHS,
    N_SAMPLES,
    PROMPT_LENGTH,
    SAMPLING_Z_LIMIT,
    SYNC_MIN_CHANGE,
    TEMPERATURES,
    RolloutContext,
    compare_log_probs,
    make_prompts,
    reference_log_probs,
    rows_of,
    save_rollout_model,
)
from verl_core.testing.rollout_layout import check_batch_contract
from verl_core.testing.tiny import make_samples

__all__ = ["ROLLOUT_CHECKS", "RolloutCheck", "RolloutContext", "save_rollout_model"]

# -- the checks -------------------------------------------------------------------------------------


def check_log_probs(ctx: RolloutContext) -> list[Comparison]:
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=102)
    comparisons = []
    for temperature in TEMPERATURES:
        output = ctx.generate(prompts, seed=11, temperature=temperature)
        expected, mask = reference_log_probs(ctx.reference(), output, temperature)
        comparisons.append(
            compare_log_probs(
                "log_probs", f"T={temperature}: rollout_log_probs", output, expected, mask, "reference"
            )
        )
    return comparisons


def check_sampling(ctx: RolloutContext) -> list[Comparison]:
    """Under ``softmax(logits / T)`` the log-probability of a sampled token has mean ``-H`` (minus the
    entropy) and variance ``V``; summed over every sampled token (each given the tokens before it),
    ``z = sum(log p + H) / sqrt(sum V)`` is about standard normal when the tokens really are drawn
    from that distribution. Sampled at a higher temperature, or from a distribution that some filter
    cut (top-k, top-p applied when off), the tokens are less or more likely than that: ``|z|`` grows
    with the number of tokens (~0.47 per token at T = 0.7 for a rollout that samples at T = 1)."""
    prompts = make_prompts([PROMPT_LENGTH] * 48, seed=103)
    comparisons = []
    for temperature in TEMPERATURES:
        output = ctx.generate(prompts, seed=13, temperature=temperature, max_new_tokens=24)
        centred = variance = 0.0
        log_prob_sum = entropy_sum = 0.0
        tokens = 0
        model = ctx.reference()
        for row in rows_of(output):
            if not row.response:
                continue
            logits = reference.response_logits(model, row.prompt, row.response).double()
            log_p = torch.log_softmax(logits / temperature, dim=-1)
            p = log_p.exp()
            entropy = -(p * log_p).sum(dim=-1)
            spread = (p * log_p.square()).sum(dim=-1) - entropy.square()
            sampled = log_p.gather(-1, torch.tensor(row.response)[:, None])[:, 0]
            centred += float((sampled + entropy).sum())
            variance += float(spread.sum())
            log_prob_sum += float(sampled.sum())
            entropy_sum += float(entropy.sum())
            tokens += len(row.response)
        quantity = f"T={temperature}: sampled tokens follow softmax(logits / T)"
        if tokens == 0:
            comparisons.append(Comparison("sampling", quantity, 0, False, "the rollout sampled no tokens"))
            continue
        z = centred / math.sqrt(variance)
        passed = abs(z) <= SAMPLING_Z_LIMIT
        detail = (
            f"mean log-prob of the {tokens} sampled tokens under the reference's softmax(logits / T) "
            f"{log_prob_sum / tokens:.4f}, expected {-entropy_sum / tokens:.4f} (minus the mean entropy): "
            f"z = {z:.2f} (|z| <= {SAMPLING_Z_LIMIT:g})"
        )
        if z < -SAMPLING_Z_LIMIT:
            detail += (
                "; the tokens are less likely than T makes them: sampled at a higher temperature (T ignored?)"
            )
        elif z > SAMPLING_Z_LIMIT:
            detail += (
                "; the tokens are more likely than T makes them: sampled at a lower temperature, or filtered "
                "(a top-k or top-p applied although top_k=0, top_p=1)"
            )
        comparisons.append(Comparison("sampling", quantity, 0, passed, detail, abs(z)))
    return comparisons


def check_greedy(ctx: RolloutContext) -> list[Comparison]:
    check = "greedy"
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=104)
    output = ctx.generate(prompts, seed=0, temperature=0.0)
    model = ctx.reference()
    wrong = []
    total, closest = 0, math.inf
    for index, row in enumerate(rows_of(output)):
        if not row.response:
            continue
        logits = reference.response_logits(model, row.prompt, row.response).double()
        top2 = logits.topk(2, dim=-1)
        for t, token in enumerate(row.response):
            total += 1
            best, runner_up = float(top2.values[t, 0]), float(top2.values[t, 1])
            gap = best - float(logits[t, token])
            if gap > GREEDY_TIE_TOLERANCE:
                wrong.append((gap, index, t, token, float(logits[t, token]), int(top2.indices[t, 0]), best))
            else:
                closest = min(closest, best - runner_up)
    if total == 0:
        tokens = Comparison(
            check, "tokens are the reference's argmax", 0, False, "the rollout generated nothing"
        )
    elif wrong:
        gap, index, t, token, chosen, argmax, best = max(wrong)
        tokens = Comparison(
            check,
            "tokens are the reference's argmax",
            0,
            False,
            f"{len(wrong)} of {total} tokens are not the argmax of the reference's logits (given the tokens "
            f"before them); worst at [{index}, {t}]: the rollout chose {token} (logit {chosen:.6g}), the "
            f"argmax is {argmax} (logit {best:.6g}; gap {gap:.3g}, ties within {GREEDY_TIE_TOLERANCE:g})",
            gap,
        )
    else:
        tokens = Comparison(
            check,
            "tokens are the reference's argmax",
            0,
            True,
            f"all {total} tokens are the argmax (smallest gap to the runner-up {closest:.3g})",
            0.0,
        )
    expected, mask = reference_log_probs(model, output, 0.0)
    comparisons = [
        tokens,
        compare_log_probs(check, "rollout_log_probs (untempered)", output, expected, mask, "reference"),
    ]
    again = ctx.generate(prompts, seed=1, temperature=0.0)
    comparisons.append(
        compare_tensors(
            check,
            "another seed gives the same responses",
            again[RESPONSES],
            output[RESPONSES],
            BITWISE,
            0,
            against="seed 0's",
            subject="seed 1's",
        )
    )
    return comparisons


def check_prompt_lengths(ctx: RolloutContext) -> list[Comparison]:
    lengths = MIXED_PROMPT_LENGTHS * 2
    prompts = make_prompts(lengths, seed=105)
    output = ctx.generate(prompts, seed=17)
    expected, mask = reference_log_probs(ctx.reference(), output, 1.0)
    longest = torch.tensor([length == max(lengths) for length in lengths])[:, None]
    low, high = min(lengths), max(lengths)
    return [
        compare_log_probs(
            "prompt_lengths",
            f"rollout_log_probs of the {high}-token prompts (no padding)",
            output,
            expected,
            mask & longest,
            "reference",
        ),
        compare_log_probs(
            "prompt_lengths",
            f"rollout_log_probs of the {low}- to {high - 1}-token prompts (left-padded in the same call)",
            output,
            expected,
            mask & ~longest,
            "reference (each sample alone)",
        ),
    ]


def check_n_samples(ctx: RolloutContext) -> list[Comparison]:
    check = "n_samples"
    distinct = make_prompts([PROMPT_LENGTH - 1] * 4, seed=106)
    prompts = [prompt for prompt in distinct for _ in range(N_SAMPLES)]
    output = ctx.generate(prompts, seed=19)
    rows = rows_of(output)
    if len(rows) != len(prompts) or [row.prompt for row in rows] != prompts:
        return [
            Comparison(
                check,
                "one row per prompt, in order",
                0,
                False,
                f"{len(rows)} rows for {len(prompts)} prompts ({len(distinct)} prompts x {N_SAMPLES}), or "
                "rows whose prompt is not the one at their index",
            )
        ]
    groups = [
        {tuple(row.response) for row in rows[i * N_SAMPLES : (i + 1) * N_SAMPLES]}
        for i in range(len(distinct))
    ]
    copies = [i for i, group in enumerate(groups) if len(group) == 1]
    expected, mask = reference_log_probs(ctx.reference(), output, 1.0)
    return [
        Comparison(check, "one row per prompt, in order", 0, True, f"{len(rows)} rows, each with its prompt"),
        Comparison(
            check,
            f"each prompt's {N_SAMPLES} responses are samples of their own",
            0,
            not copies,
            f"distinct responses per prompt: {[len(group) for group in groups]}"
            + (
                f"; prompt(s) {copies} got one response {N_SAMPLES} times (sampled once per distinct prompt "
                "and copied?)"
                if copies
                else ""
            ),
        ),
        compare_log_probs(check, "rollout_log_probs", output, expected, mask, "reference"),
    ]


def check_seed(ctx: RolloutContext) -> list[Comparison]:
    check = "seed"
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=107)
    # The global RNG is set to another state before every call: a rollout must draw from its seed only.
    devices = [torch.device(ctx.device).index or 0] if torch.device(ctx.device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(1)
        first = ctx.generate(prompts, seed=23)
        torch.manual_seed(2)
        other = ctx.generate(prompts, seed=24)
        torch.manual_seed(3)
        again = ctx.generate(prompts, seed=23)
    comparisons = [
        compare_tensors(
            check,
            f"same seed: {key}",
            again[key],
            first[key],
            BITWISE,
            0,
            against="first call's",
            subject="third call's",
        )
        for key in (RESPONSES, RESPONSE_MASK)
    ]
    comparisons.append(
        compare_tensors(
            check,
            f"same seed: {ROLLOUT_LOG_PROBS}",
            again[ROLLOUT_LOG_PROBS],
            first[ROLLOUT_LOG_PROBS],
            LOG_PROB_TOLERANCE,
            0,
            against="first call's",
            subject="third call's",
        )
    )
    same = other[RESPONSES].shape == first[RESPONSES].shape and torch.equal(
        other[RESPONSES], first[RESPONSES]
    )
    comparisons.append(
        Comparison(
            check,
            "another seed: other samples",
            0,
            not same,
            "seed 24 gave exactly seed 23's responses: the seed is not used"
            if same
            else "seed 24's responses differ from seed 23's",
        )
    )
    return comparisons


def check_weight_sync(ctx: RolloutContext) -> list[Comparison]:
    check = "weight_sync"
    # One AdamW step of the engine kit's policy loss (its BASE_OPTIM), taken by the plain reference.
    trained = reference.reference_step(ctx.model_dir, "lm", make_samples(1), BASE_OPTIM, 1.0).model.eval()
    original = ctx.reference()
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=108)
    comparisons = []
    for label, weights, stale in (
        ("the trained weights", trained, original),
        ("the original weights back", original, trained),
    ):
        ctx.rollout.update_weights(_weight_stream(weights, ctx.device))
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
            check, f"after syncing {label}: rollout_log_probs", output, expected, mask, "synced reference"
        )
        comparisons.append(comparison)
        if not comparison.passed:
            old = compare_log_probs(check, "", output, before, mask, "")
            if old.passed:
                comparisons.append(
                    Comparison(
                        check,
                        f"after syncing {label}: not the weights before the sync",
                        0,
                        False,
                        f"the rollout's log-probs are those of the weights before the sync (max |difference| "
                        f"{old.max_abs_diff:.3g}, while the sync moves them by up to {change:.3g}): "
                        "update_weights does not reach the weights it samples with",
                        old.max_abs_diff,
                    )
                )
    return comparisons


def _weight_stream(model: torch.nn.Module, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as an engine's ``get_per_tensor_param`` yields them: one full tensor at a time,
    Hugging Face names, state-dict order, on the rollout's device."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach().to(device, copy=True)


#: The rollout kit's checks are ``Check`` s of a ``RolloutContext``.
RolloutCheck = Check


ROLLOUT_CHECKS: dict[str, RolloutCheck] = {
    check.name: check
    for check in (
        RolloutCheck(
            "batch_contract",
            check_batch_contract,
            "prompts left-padded in order, responses right-padded, masks and positions of the batch contract; "
            "a response stops at its first EOS and keeps it inside its mask, or runs to max_new_tokens",
        ),
        RolloutCheck(
            "log_probs",
            check_log_probs,
            "rollout_log_probs at T = 0.7 and 1.0 equal log_softmax(logits / T) of the HF model on each sample alone",
        ),
        RolloutCheck(
            "sampling",
            check_sampling,
            "the sampled tokens are drawn from softmax(logits / T) (z-test at T = 0.7 and 1.0), not another "
            "temperature or a filtered distribution",
        ),
        RolloutCheck(
            "greedy",
            check_greedy,
            "temperature 0 picks the reference's argmax token by token, with untempered log-probs, whatever the seed",
        ),
        RolloutCheck(
            "prompt_lengths",
            check_prompt_lengths,
            "prompts of 1 to 8 tokens in one call: every row's log-probs equal the reference's on that sample alone",
        ),
        RolloutCheck(
            "n_samples",
            check_n_samples,
            "a prompt repeated n times gets n rows in order, sampled independently, with correct log-probs",
        ),
        RolloutCheck(
            "seed",
            check_seed,
            "the same seed gives the same responses whatever the global RNG; another seed gives others",
        ),
        RolloutCheck(
            "weight_sync",
            check_weight_sync,
            "after update_weights with the weights of a training step, log-probs are the trained model's "
            "(not the old one's); syncing the original weights back restores them",
        ),
    )
}
