"""The rollout conformance checks: does a rollout backend sample what the engine would score?

A check is a function ``(RolloutContext) -> Iterator[Comparison]`` that yields its comparisons as
it makes them (so one that raises partway still reports them), run in one process against one
initialised rollout of the kit's tiny model (``save_rollout_model``); one that cannot be exercised
raises the engine kit's ``CheckSkipped``: contract 2's checks of a capability the backend does not
declare (``RolloutCapabilities``: ``abort_resume``, ``prefix_caching``, ``sleep``). ``ROLLOUT_CHECKS``
lists them in the order they run: contract 1's, the request-level ones (``rollout_requests``), then the
weight checks (``rollout_weights``), which replace the rollout's weights (and put the original ones
back), last.

Every number is compared with the independent reference of ``verl_core.testing.reference``: the
Hugging Face model run on each sample alone, unpadded, teacher-forced (``response_logits``), with
``log_softmax(logits / T)``: what a training engine computes for the same tokens. The responses
are read through the rollout's own ``response_mask``, so a layout bug shows in ``batch_contract``
and not again in every other check. Prompts of different lengths in one call are the subject of
``prompt_lengths`` (and of ``batch_contract``'s layout): the other checks give prompts of one
length, so that a padding bug fails one check, named for it. The statistical tests are in
``rollout_statistics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import torch

from verl_core.data.batch import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from verl_core.descriptors import LogProbSemantics
from verl_core.testing import reference
from verl_core.testing.report import BITWISE, Check, Comparison, compare_tensors
from verl_core.testing.rollout_context import (
    FILTER_TOP_K,
    FILTER_TOP_P,
    FIRST_TOKEN_PROMPTS,
    FIRST_TOKEN_TEMPERATURE,
    FIRST_TOKEN_Z_LIMIT,
    GREEDY_TIE_TOLERANCE,
    INDEPENDENCE_P_LIMIT,
    INDEPENDENCE_PROMPTS,
    MIXED_PROMPT_LENGTHS,
    N_SAMPLES,
    PROMPT_LENGTH,
    SAMPLING_Z_LIMIT,
    TEMPERATURES,
    RolloutContext,
    compare_log_probs,
    first_tokens,
    follows,
    make_prompts,
    reference_log_probs,
    rows_of,
    save_rollout_model,
)
from verl_core.testing.rollout_layout import check_batch_contract
from verl_core.testing.rollout_requests import (
    check_abort_resume,
    check_prefix_caching,
    check_request_isolation,
    check_requests,
    check_resume,
    check_stopping,
)
from verl_core.testing.rollout_statistics import repeated_draws
from verl_core.testing.rollout_weights import (
    check_sleep,
    check_weight_buckets,
    check_weight_refusals,
    check_weight_sync,
)

__all__ = ["ROLLOUT_CHECKS", "RolloutCheck", "RolloutContext", "save_rollout_model"]

# -- the checks -------------------------------------------------------------------------------------


def check_log_probs(ctx: RolloutContext) -> Iterator[Comparison]:
    """At T = 0.7 and 1.0, ``rollout_log_probs`` equal the reference's under the declared semantics
    (``RolloutCapabilities.log_prob_semantics``; the contract's ``log_softmax(logits / T)``) within the
    declared ``log_prob_tolerance``, which is then reported against the largest difference measured."""
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=102)
    semantics = ctx.capabilities.log_prob_semantics
    worst, tokens = 0.0, 0
    for temperature in TEMPERATURES:
        output = ctx.generate(prompts, seed=11, temperature=temperature)
        expected, mask = reference_log_probs(ctx.reference(), output, temperature, semantics)
        comparison = compare_log_probs(
            "log_probs",
            f"T={temperature}: rollout_log_probs",
            output,
            expected,
            mask,
            "reference",
            ctx.declared,
        )
        yield comparison
        if bool(mask.any()):
            difference = (output[ROLLOUT_LOG_PROBS].double() - expected).abs() / (1 + expected.abs())
            worst, tokens = max(worst, float(difference[mask].max())), tokens + int(mask.sum())
    declared = ctx.capabilities.log_prob_tolerance
    yield Comparison(
        "log_probs",
        "the declared log_prob_tolerance holds",
        0,
        tokens > 0 and worst <= declared,
        f"measured max |rollout - reference| / (1 + |reference|) = {worst:.3g} over {tokens} tokens "
        f"({semantics} log-probs), declared log_prob_tolerance {declared:g}"
        + ("" if worst <= declared else ": declare the tolerance the backend meets (RolloutCapabilities)"),
        worst,
    )


def check_sampling(ctx: RolloutContext) -> Iterator[Comparison]:
    """The sampled tokens follow ``softmax(logits / T)`` (``rollout_statistics.log_prob_z``): all of
    them together (~1000 tokens; ``|z|`` grows with their number, ~0.46 per token at T = 0.7 for a
    rollout that samples at T = 1), then the first token of each response alone, in a call of its
    own with enough prompts to see it: the first token often comes from a path of its own (the
    prefill's logits), which the other tokens would outvote 20 to 1 in the pooled test."""
    prompts = make_prompts([PROMPT_LENGTH] * 48, seed=103)
    model = ctx.reference()
    for temperature in TEMPERATURES:
        output = ctx.generate(prompts, seed=13, temperature=temperature, max_new_tokens=24)
        log_probs, sampled = [], []
        for row in rows_of(output):
            if row.response:
                logits = reference.response_logits(model, row.prompt, row.response).double()
                log_probs.append(torch.log_softmax(logits / temperature, dim=-1))
                sampled.append(torch.tensor(row.response))
        yield follows(
            "sampling",
            f"T={temperature}: sampled tokens follow softmax(logits / T)",
            log_probs,
            sampled,
            SAMPLING_Z_LIMIT,
            "",
        )
    # The first tokens at T = 0.7 only: a first token drawn from the wrong logits shows at either
    # temperature, one drawn without the temperature at this one only.
    prompts = make_prompts([PROMPT_LENGTH] * FIRST_TOKEN_PROMPTS, seed=109)
    output = ctx.generate(prompts, seed=31, temperature=FIRST_TOKEN_TEMPERATURE, max_new_tokens=2)
    rows, tokens = first_tokens(output)
    logits = reference.next_token_logits(model, prompts).double()[rows]
    yield follows(
        "sampling",
        f"T={FIRST_TOKEN_TEMPERATURE}: first tokens follow softmax(logits / T)",
        [torch.log_softmax(logits / FIRST_TOKEN_TEMPERATURE, dim=-1)] if len(rows) else [],
        [tokens],
        FIRST_TOKEN_Z_LIMIT,
        " (the first token of each response alone: drawn differently from the tokens after it? "
        "the prefill's logits sampled without the temperature, or another position's logits)",
    )


def check_greedy(ctx: RolloutContext) -> Iterator[Comparison]:
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
    yield tokens
    expected, mask = reference_log_probs(model, output, 0.0)
    yield compare_log_probs(
        check, "rollout_log_probs (untempered)", output, expected, mask, "reference", ctx.tolerance
    )
    again = ctx.generate(prompts, seed=1, temperature=0.0)
    yield compare_tensors(
        check,
        "another seed gives the same responses",
        again[RESPONSES],
        output[RESPONSES],
        BITWISE,
        0,
        against="seed 0's",
        subject="seed 1's",
    )


def check_prompt_lengths(ctx: RolloutContext) -> Iterator[Comparison]:
    lengths = MIXED_PROMPT_LENGTHS * 2
    prompts = make_prompts(lengths, seed=105)
    output = ctx.generate(prompts, seed=17)
    expected, mask = reference_log_probs(ctx.reference(), output, 1.0)
    longest = torch.tensor([length == max(lengths) for length in lengths])[:, None]
    low, high = min(lengths), max(lengths)
    yield compare_log_probs(
        "prompt_lengths",
        f"rollout_log_probs of the {high}-token prompts (no padding)",
        output,
        expected,
        mask & longest,
        "reference",
        ctx.tolerance,
    )
    yield compare_log_probs(
        "prompt_lengths",
        f"rollout_log_probs of the {low}- to {high - 1}-token prompts (left-padded in the same call)",
        output,
        expected,
        mask & ~longest,
        "reference (each sample alone)",
        ctx.tolerance,
    )


def check_n_samples(ctx: RolloutContext) -> Iterator[Comparison]:
    check = "n_samples"
    distinct = make_prompts([PROMPT_LENGTH - 1] * 4, seed=106)
    prompts = [prompt for prompt in distinct for _ in range(N_SAMPLES)]
    output = ctx.generate(prompts, seed=19)
    rows = rows_of(output)
    in_order = len(rows) == len(prompts) and [row.prompt for row in rows] == prompts
    yield Comparison(
        check,
        "one row per prompt, in order",
        0,
        in_order,
        f"{len(rows)} rows, each with its prompt"
        if in_order
        else f"{len(rows)} rows for {len(prompts)} prompts ({len(distinct)} prompts x {N_SAMPLES}), or "
        "rows whose prompt is not the one at their index",
    )
    if not in_order:
        return
    groups = [
        {tuple(row.response) for row in rows[i * N_SAMPLES : (i + 1) * N_SAMPLES]}
        for i in range(len(distinct))
    ]
    copies = [i for i, group in enumerate(groups) if len(group) == 1]
    yield Comparison(
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
    )
    expected, mask = reference_log_probs(ctx.reference(), output, 1.0)
    yield compare_log_probs(check, "rollout_log_probs", output, expected, mask, "reference", ctx.tolerance)
    yield _first_tokens_independent(ctx)


def _first_tokens_independent(ctx: RolloutContext) -> Comparison:
    """The ``n`` first tokens of one prompt are independent draws (``rollout_statistics.repeated_draws``):
    a prompt's rows share its prefill, and a rollout that samples the first token once per prompt
    (or from one random number per prompt) gives its rows one first token, whatever follows."""
    quantity = f"the first tokens of a prompt's {N_SAMPLES} responses are independent draws"
    distinct = make_prompts([PROMPT_LENGTH] * INDEPENDENCE_PROMPTS, seed=110)
    output = ctx.generate(
        [prompt for prompt in distinct for _ in range(N_SAMPLES)], seed=37, max_new_tokens=2
    )
    rows, tokens = first_tokens(output)
    if output[RESPONSES].shape[0] != len(distinct) * N_SAMPLES:
        return Comparison(
            "n_samples",
            quantity,
            0,
            False,
            f"{output[RESPONSES].shape[0]} rows for {len(distinct) * N_SAMPLES} prompts",
        )
    draws = [[] for _ in distinct]
    for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
        draws[row // N_SAMPLES].append(token)
    probabilities = torch.softmax(reference.next_token_logits(ctx.reference(), distinct).double(), dim=-1)
    test = repeated_draws(probabilities, draws)
    passed = test.p_value >= INDEPENDENCE_P_LIMIT
    detail = (
        f"{test.repeated} of {test.groups} prompts got a first token twice or more among their {N_SAMPLES} "
        f"responses; independent draws do so in {test.expected:.1f} on average, and in {test.repeated} or "
        f"more with probability {test.p_value:.2g} (limit {INDEPENDENCE_P_LIMIT:g})"
    )
    if not passed:
        detail += (
            f": the {N_SAMPLES} responses of a prompt share their first token (sampled once per prompt from "
            "the prefill its rows share and copied to them?) or are otherwise drawn together"
        )
    return Comparison("n_samples", quantity, 0, passed, detail)


def check_seed(ctx: RolloutContext) -> Iterator[Comparison]:
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
    for key, tolerance in (
        (RESPONSES, BITWISE),
        (RESPONSE_MASK, BITWISE),
        (ROLLOUT_LOG_PROBS, ctx.tolerance),
    ):
        yield compare_tensors(
            check,
            f"same seed: {key}",
            again[key],
            first[key],
            tolerance,
            0,
            against="first call's",
            subject="third call's",
        )
    same = other[RESPONSES].shape == first[RESPONSES].shape and torch.equal(
        other[RESPONSES], first[RESPONSES]
    )
    yield Comparison(
        check,
        "another seed: other samples",
        0,
        not same,
        "seed 24 gave exactly seed 23's responses: the seed is not used"
        if same
        else "seed 24's responses differ from seed 23's",
    )


def check_filters(ctx: RolloutContext) -> Iterator[Comparison]:
    """With top-k, then top-p, on (T = 1): every sampled token is one the filter keeps, and its
    reported log-prob is still the unfiltered ``log_softmax(logits / T)``: the filters restrict what
    is drawn, not the distribution the engine scores the tokens under (``BaseRollout``). About half
    of the probability lies outside either filter, so a rollout that ignores it draws about half of
    the ~100 tokens outside."""
    check = "filters"
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=111)
    model = ctx.reference()
    for top_k, top_p in ((FILTER_TOP_K, 1.0), (0, FILTER_TOP_P)):
        label = f"top_k={top_k}" if top_k else f"top_p={top_p}"
        output = ctx.generate(prompts, seed=41, top_k=top_k, top_p=top_p)
        shape = output[RESPONSES].shape
        expected, filtered = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        mask = torch.zeros(shape, dtype=torch.bool)
        outside, total = [], 0
        for index, row in enumerate(rows_of(output)):
            if not row.response:
                continue
            logits = reference.response_logits(model, row.prompt, row.response).double()
            kept = _kept_by(logits, top_k, top_p)
            tokens = torch.tensor(row.response)[:, None]
            expected[index, row.columns] = torch.log_softmax(logits, dim=-1).gather(-1, tokens)[:, 0]
            renormalised = torch.log_softmax(logits.masked_fill(~kept, -math.inf), dim=-1)
            filtered[index, row.columns] = renormalised.gather(-1, tokens)[:, 0]
            mask[index, row.columns] = True
            for t, token in enumerate(row.response):
                total += 1
                if not kept[t, token]:
                    rank = int((logits[t] > logits[t, token] + GREEDY_TIE_TOLERANCE).sum()) + 1
                    outside.append(f"[{index}, {t}]: token {token}, the {rank}th most likely")
        if not total:
            detail = "the rollout sampled no tokens"
        elif outside:
            detail = (
                f"{len(outside)} of {total} sampled tokens are outside {label} ({'; '.join(outside[:3])}): "
                "the filter is not applied when sampling"
            )
        else:
            detail = f"all {total} sampled tokens are inside {label}"
        yield Comparison(
            check, f"{label}: sampled tokens are ones the filter keeps", 0, total > 0 and not outside, detail
        )
        if ctx.capabilities.log_prob_semantics is LogProbSemantics.FILTERED:  # what the backend declares
            yield compare_log_probs(
                check,
                f"{label}: rollout_log_probs (filtered, as declared)",
                output,
                filtered,
                mask,
                "reference",
                ctx.tolerance,
            )
            continue
        comparison = compare_log_probs(
            check,
            f"{label}: rollout_log_probs (unfiltered)",
            output,
            expected,
            mask,
            "reference",
            ctx.tolerance,
        )
        if (
            not comparison.passed
            and compare_log_probs(check, "", output, filtered, mask, "", ctx.tolerance).passed
        ):
            comparison = attrs.evolve(
                comparison,
                detail=f"{comparison.detail}; they are the log-probs of the filtered, renormalised "
                "distribution: report log_softmax(logits / T) before the filter, which the engine computes",
            )
        yield comparison


def _kept_by(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[r, V]``: the tokens that top-k (the ``top_k`` largest logits) and top-p (the smallest set of
    most likely tokens whose probability reaches ``top_p``) keep, at T = 1. A token tied with a kept
    one (within ``GREEDY_TIE_TOLERANCE``) counts as kept: float rounding may order ties either way."""
    above = logits[:, None, :] > logits[:, :, None] + GREEDY_TIE_TOLERANCE  # [r, token, more likely]
    kept = torch.ones_like(logits, dtype=torch.bool)
    if top_k:
        kept &= above.sum(dim=-1) < top_k
    if top_p < 1.0:
        probabilities = torch.softmax(logits, dim=-1)
        kept &= (above * probabilities[:, None, :]).sum(dim=-1) < top_p
    return kept


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
            "rollout_log_probs at T = 0.7 and 1.0 equal log_softmax(logits / T) of the HF model on each sample "
            "alone, within the declared log_prob_tolerance (the measured value is reported)",
        ),
        RolloutCheck(
            "sampling",
            check_sampling,
            "the sampled tokens are drawn from softmax(logits / T) (z-test at T = 0.7 and 1.0, all tokens "
            "and the first tokens alone), not another temperature or a filtered distribution",
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
            "a prompt repeated n times gets n rows in order, sampled independently (their first tokens too), "
            "with correct log-probs",
        ),
        RolloutCheck(
            "seed",
            check_seed,
            "the same seed gives the same responses whatever the global RNG; another seed gives others",
        ),
        RolloutCheck(
            "filters",
            check_filters,
            "with top-k or top-p on, every sampled token is one the filter keeps, and its log-prob is the "
            "unfiltered log_softmax(logits / T)",
        ),
        RolloutCheck(
            "requests",
            check_requests,
            "generate_request, many in flight at T = 0.7: responses end as they say, tokens follow "
            "softmax(logits / T) with the reference's log-probs, and the same seed gives the same tokens",
        ),
        RolloutCheck(
            "resume",
            check_resume,
            "a request resumed from a partial response keeps it and runs to max_new_tokens, its new tokens "
            "drawn from the distribution given the prompt and the partial tokens",
        ),
        RolloutCheck(
            "request_isolation",
            check_request_isolation,
            "requests with different sampling in flight together: each greedy, top-k, EOS and length setting "
            "applies to its own request only",
        ),
        RolloutCheck(
            "stopping",
            check_stopping,
            "an EOS on the last allowed token ends the response there (finish eos), max_new_tokens exactly, "
            "an EOS id in the prompt stops nothing, max_new_tokens=1; in a call and as a request",
        ),
        RolloutCheck(
            "abort_resume",
            check_abort_resume,
            "(abort_resume) an abort stops a request mid-generation with its tokens and log-probs; resumed, "
            "it samples the uninterrupted distribution",
        ),
        RolloutCheck(
            "prefix_caching",
            check_prefix_caching,
            "(prefix_caching) prompts sharing a long prefix, in one call and as requests twice over: every "
            "log-prob is the reference's on that sample alone",
        ),
        RolloutCheck(
            "sleep",
            check_sleep,
            "(sleep) asleep, the rollout refuses to generate or update naming wake_up(); awake again, it gives "
            "the same greedy responses with the weights it had",
        ),
        RolloutCheck(
            "weight_sync",
            check_weight_sync,
            "after update_weights with the weights of a training step, then with every weight changed, "
            "log-probs are the new model's (not the old one's, nor those of tensors the rollout still "
            "shares with the sender); syncing the original weights back restores them",
        ),
        RolloutCheck(
            "weight_refusals",
            check_weight_refusals,
            "update_weights refuses an unknown name, a missing weight and a misshapen one with RolloutError "
            "naming it, and the rollout refuses to generate until a complete update succeeds",
        ),
        RolloutCheck(
            "weight_buckets",
            check_weight_buckets,
            "update_weights_from_buckets takes the weights as verified buckets; a corrupt bucket, a missing one "
            "and a truncated stream are refused naming it, and generate refuses until a complete stream arrives",
        ),
    )
}
