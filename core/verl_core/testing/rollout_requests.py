"""The rollout kit's request-level checks (rollout contract 2): ``generate_request`` samples what
``generate`` samples, resumes a partial response, keeps concurrent requests apart, stops where the
contract says, aborts mid-generation where the backend declares it can, and shares prefills without
changing a log-prob.

Every rollout has a request path (``BaseRollout``'s default serves each request as a ``generate`` call
of one prompt), so ``requests``, ``resume``, ``request_isolation`` and ``stopping`` run on every
backend; ``abort_resume`` and ``prefix_caching`` check a capability the backend declares
(``RolloutCapabilities``) and are skipped, saying why, for one that does not. The reference is the
one of ``rollout_checks``: the Hugging Face model on each sample alone, teacher-forced.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence

import attrs
import torch

from verl_core.data.batch import RESPONSE_MASK, RESPONSES
from verl_core.rollout.requests import FinishReason, RolloutRequest, RolloutResponse
from verl_core.testing import reference
from verl_core.testing.report import CheckSkipped, Comparison, compare_tensors
from verl_core.testing.rollout_context import (
    EOS_TOKEN_ID,
    EOS_TOKEN_IDS,
    FILTER_TOP_K,
    GREEDY_TIE_TOLERANCE,
    N_SAMPLES,
    PROMPT_LENGTH,
    SAMPLING_Z_LIMIT,
    RolloutContext,
    declared_log_probs,
    follows,
    make_prompts,
    passed,
)
from verl_core.testing.rollout_weights import probe_weights, samples_with, send_weights

#: ``requests``: prompts sent as requests all at once, their temperature and length.
REQUEST_PROMPTS = 16
REQUEST_TEMPERATURE = 0.7
REQUEST_MAX_NEW_TOKENS = 16
#: ``requests``: how many of them are sent again with the same seed.
SAME_SEED_REQUESTS = 2
#: ``resume``: prompts, the longest partial response resumed, and the whole response's length.
RESUME_PROMPTS = 8
RESUME_MAX_PARTIAL = 6
RESUME_MAX_NEW_TOKENS = 16
#: ``abort_resume``: the length of a request to abort (no EOS: it runs to its end unless aborted; the
#: kit's model has 56 positions), the mid-generation aborts wanted and the tries allowed for them, and
#: the first wait before aborting (doubled while aborts land before the first token, halved while they
#: land after the last: abort is timed against a request the kit cannot watch).
ABORT_MAX_NEW_TOKENS = 32
ABORTS_WANTED = 4
ABORT_TRIES = 40
ABORT_FIRST_DELAY = 0.002
#: ``stopping``: the greedy continuation's length, and the smallest gap between its tokens' logits and
#: the runner-up's for a prompt to be used (a near-tie may be broken either way by rounding).
STOP_AT = 6
STOP_MIN_GAP = 1e-3
#: ``prefix_caching``: prompts sharing a prefix of this many tokens (one cache block of vLLM's CPU
#: backend at its smallest block size, 32), with suffixes of their own.
SHARED_PREFIX = 32
SHARED_PROMPTS = 4
#: ``prefix_caching``: a conversation's next turn, its prompt the previous turn's prompt, response and
#: this many more tokens, up to this many new tokens (the whole within the kit model's 56 positions).
TURN_TOKENS = 2
TURN_MAX_NEW_TOKENS = 8


def check_requests(ctx: RolloutContext) -> Iterator[Comparison]:
    """``REQUEST_PROMPTS`` requests in flight together at T = 0.7: each response is well-formed, its
    tokens follow ``softmax(logits / T)`` (as ``sampling`` checks ``generate``'s) and its log-probs are
    the reference's; the same requests again (the same seeds) give the same tokens."""
    check = "requests"
    prompts = make_prompts([PROMPT_LENGTH] * REQUEST_PROMPTS, seed=113)
    sampling = ctx.sampling(temperature=REQUEST_TEMPERATURE, max_new_tokens=REQUEST_MAX_NEW_TOKENS)
    requests = [
        RolloutRequest(prompt, sampling, seed=200 + i, request_id=f"kit-requests-{i}")
        for i, prompt in enumerate(prompts)
    ]
    responses = ctx.requests(requests)
    yield well_formed(check, requests, responses)
    yield from _sampled_and_scored(ctx, check, requests, responses, f"T={REQUEST_TEMPERATURE}")
    again = ctx.requests(
        [
            attrs.evolve(request, request_id=f"{request.request_id}-again")
            for request in requests[:SAME_SEED_REQUESTS]
        ]
    )
    differ = [
        f"request {i}: {list(first.token_ids)} then {list(second.token_ids)}"
        for i, (first, second) in enumerate(zip(responses, again, strict=False))
        if first.token_ids != second.token_ids
    ]
    yield passed(
        check,
        "the same request again (the same seed): the same tokens",
        differ,
        f"{len(again)} requests sent again gave the same tokens",
    )


def check_resume(ctx: RolloutContext) -> Iterator[Comparison]:
    """Responses cut after 1 to ``RESUME_MAX_PARTIAL`` tokens, resumed (``resume_from``) to
    ``RESUME_MAX_NEW_TOKENS`` at T = 1: each keeps its partial tokens and their log-probs, runs to its
    length, and its new tokens follow the distribution given the prompt and the partial tokens, with
    the reference's log-probs. A ``resume_from`` that is already complete comes back as it is."""
    check = "resume"
    prompts = make_prompts([PROMPT_LENGTH] * RESUME_PROMPTS, seed=115)
    full = ctx.sampling(max_new_tokens=RESUME_MAX_NEW_TOKENS, eos_token_ids=())
    cut = [
        RolloutRequest(
            prompt,
            attrs.evolve(full, max_new_tokens=1 + i % RESUME_MAX_PARTIAL),
            seed=300 + i,
            request_id=f"kit-partial-{i}",
        )
        for i, prompt in enumerate(prompts)
    ]
    partials = [
        attrs.evolve(response, finish_reason=FinishReason.ABORTED, request_id=f"kit-resume-{i}")
        for i, response in enumerate(ctx.requests(cut))
    ]
    resumed = [
        RolloutRequest(prompt, full, seed=400 + i, request_id=f"kit-resume-{i}", resume_from=partial)
        for i, (prompt, partial) in enumerate(zip(prompts, partials, strict=True))
    ]
    responses = ctx.requests(resumed)
    yield well_formed(check, resumed, responses)
    yield _keeps_partials(check, resumed, responses)
    yield from _sampled_and_scored(ctx, check, resumed, responses, "T=1.0, the resumed tokens", new_only=True)
    # Nothing left to generate: the response comes back as it was, ending as it ended.
    complete = responses[0]
    eos_ended = attrs.evolve(
        complete, token_ids=(*complete.token_ids[:3], EOS_TOKEN_ID), log_probs=complete.log_probs[:4]
    )
    problems = []
    for label, partial, sampling, finish in (
        ("max_new_tokens tokens", complete, full, FinishReason.LENGTH),
        ("an EOS", eos_ended, attrs.evolve(full, eos_token_ids=(EOS_TOKEN_ID,)), FinishReason.EOS),
    ):
        request = RolloutRequest(prompts[0], sampling, seed=1, request_id="kit-complete", resume_from=partial)
        (response,) = ctx.requests([request])
        if response.token_ids != partial.token_ids or response.finish_reason != finish:
            problems.append(
                f"resume_from ending with {label} came back as {len(response.token_ids)} tokens, finish "
                f"{response.finish_reason} (expected it unchanged, finish {finish})"
            )
    yield passed(check, "a complete resume_from comes back as it is", problems, "both came back unchanged")


def check_request_isolation(ctx: RolloutContext) -> Iterator[Comparison]:
    """Requests with different sampling in flight together each get their own: greedy ones the
    reference's argmax, top-k ones only tokens inside their top-k, each its own ``max_new_tokens`` and
    EOS ids (a backend that batches requests must not apply one request's settings to another)."""
    check = "request_isolation"
    kinds = {
        "greedy, 10 tokens": ctx.sampling(temperature=0.0, max_new_tokens=10, eos_token_ids=()),
        f"top_k={FILTER_TOP_K}, 7 tokens": ctx.sampling(
            max_new_tokens=7, eos_token_ids=(), top_k=FILTER_TOP_K
        ),
        "T=0.7 with 16 EOS ids, 12 tokens": ctx.sampling(temperature=0.7, eos_token_ids=EOS_TOKEN_IDS),
        "T=1.0, 5 tokens": ctx.sampling(max_new_tokens=5, eos_token_ids=()),
    }
    prompts = make_prompts([PROMPT_LENGTH] * 12, seed=117)
    labels = [list(kinds)[i % len(kinds)] for i in range(len(prompts))]
    requests = [
        RolloutRequest(prompt, kinds[label], seed=500 + i, request_id=f"kit-isolation-{i}")
        for i, (prompt, label) in enumerate(zip(prompts, labels, strict=True))
    ]
    responses = ctx.requests(requests)
    # Which finish reason a response reports is stopping's to check; its length and EOS are this one's.
    yield well_formed(check, requests, responses, finish=False)
    all_logits = _response_logits(ctx.reference(), requests, responses)
    problems: dict[str, list[str]] = {label: [] for label in kinds}
    for i, (request, response, label, logits) in enumerate(
        zip(requests, responses, labels, all_logits, strict=True)
    ):
        tokens, sampling = list(response.token_ids), request.sampling
        for t, token in enumerate(tokens):
            above = int((logits[t] > logits[t, token] + GREEDY_TIE_TOLERANCE).sum())
            if sampling.greedy and above:
                problems[label].append(f"request {i} token {t}: {token} is not the argmax")
            elif sampling.top_k and above >= sampling.top_k:
                problems[label].append(f"request {i} token {t}: {token} is the {above + 1}th most likely")
    for label in kinds:
        yield passed(
            check,
            f"{label}: tokens the request's own sampling allows",
            problems[label],
            f"every {label} request sampled as it asked, beside the others",
        )


def check_stopping(ctx: RolloutContext) -> Iterator[Comparison]:
    """Where a response ends, by greedy decoding of a prompt whose greedy continuation ``g`` the
    reference knows, in a ``generate`` call and as a request: with ``g[STOP_AT - 1]`` an EOS id and
    ``max_new_tokens=STOP_AT``, the response is ``g`` ending at that EOS (finish ``eos``, not ``length``:
    the EOS came on the last token allowed); with ``max_new_tokens`` one less, it is ``g`` cut there
    (finish ``length``); an EOS id found only in the prompt stops nothing; ``max_new_tokens=1`` gives
    one token."""
    check = "stopping"
    prompt, greedy, in_prompt = _stopping_case(ctx)
    eos = greedy[-1]
    # (label, EOS ids, max_new_tokens, expected tokens, finish, also in a generate call). An EOS kept in
    # a call's response mask is batch_contract's to check: that case is checked as a request only.
    cases = (
        ("an EOS on the last token allowed", (eos,), STOP_AT, greedy, FinishReason.EOS, False),
        ("max_new_tokens reached exactly", (eos,), STOP_AT - 1, greedy[:-1], FinishReason.LENGTH, True),
        ("an EOS id only in the prompt", (in_prompt,), STOP_AT, greedy, FinishReason.LENGTH, True),
        ("max_new_tokens=1", (), 1, greedy[:1], FinishReason.LENGTH, True),
    )
    for label, eos_ids, max_new_tokens, expected, finish, in_a_call in cases:
        sampling = ctx.sampling(temperature=0.0, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids)
        (response,) = ctx.requests([RolloutRequest(prompt, sampling, seed=0, request_id="kit-stopping")])
        problems = []
        if in_a_call:
            # Where the call's response ends (which tokens greedy decoding picks is greedy's to check): at
            # the greedy length, or earlier only at an EOS id it sampled.
            output = ctx.rollout.generate([prompt], sampling, 0)
            mask = output[RESPONSE_MASK][0].to("cpu").bool()
            batch_tokens = output[RESPONSES][0].to("cpu")[mask].tolist()
            at_eos = bool(batch_tokens) and batch_tokens[-1] in eos_ids
            if len(batch_tokens) > len(expected) or (len(batch_tokens) < len(expected) and not at_eos):
                problems.append(f"generate gave {len(batch_tokens)} tokens: {batch_tokens}")
        if list(response.token_ids) != expected or response.finish_reason != finish:
            problems.append(
                f"generate_request gave {list(response.token_ids)}, finish {response.finish_reason}"
            )
        yield passed(
            check,
            f"{label}: {len(expected)} tokens, finish {finish}",
            [
                f"expected {expected} (eos_token_ids={list(eos_ids)}, max_new_tokens={max_new_tokens}); " + p
                for p in problems
            ],
            f"{expected}, finish {finish}"
            + (", in a call and as a request" if in_a_call else ", as a request"),
        )


def check_abort_resume(ctx: RolloutContext) -> Iterator[Comparison]:
    """Requests of ``ABORT_MAX_NEW_TOKENS`` tokens (no EOS), each aborted after a wait tuned until aborts
    land mid-generation: an aborted response ends early with finish ``aborted`` and the reference's
    log-probs of its tokens; resumed (``resume_from``), it keeps them and runs to its full length, the
    tokens after the abort drawn from the distribution an uninterrupted request draws them from (z-test
    and log-probs at T = 1). Aborting an id not in flight is ignored."""
    check = "abort_resume"
    if not ctx.capabilities.abort_resume:
        raise CheckSkipped(
            f"backend '{ctx.backend}' declares abort_resume=False: an abort stops only a request still "
            "waiting for its turn (resuming is checked by 'resume')"
        )
    sampling = ctx.sampling(max_new_tokens=ABORT_MAX_NEW_TOKENS, eos_token_ids=())
    prompts = make_prompts([PROMPT_LENGTH] * ABORT_TRIES, seed=118)
    aborted, tries, problems = asyncio.run(_abort_rounds(ctx, prompts, sampling))
    yield passed(
        check,
        "an aborted response ends early, finish aborted",
        problems,
        f"{len(aborted)} of {tries} requests aborted mid-generation (after "
        f"{', '.join(str(len(r.resume_from.token_ids)) for r in aborted)} tokens)",
    )
    if len(aborted) < 2:
        yield Comparison(
            check,
            "abort stops a request mid-generation",
            0,
            False,
            f"in {tries} tries no abort landed between a request's first and last token (a wait of "
            f"{ABORT_FIRST_DELAY * 1000:g} ms, doubled while aborts came before the first token, halved while "
            "they came after the last): abort_resume is declared, so abort must stop a request between "
            "decoding steps",
        )
        return
    partials = [request.resume_from for request in aborted]
    yield from _sampled_and_scored(
        ctx,
        check,
        [attrs.evolve(r, resume_from=None) for r in aborted],
        partials,
        "the aborted tokens",
        score_only=True,
    )
    responses = ctx.requests(aborted)
    yield well_formed(check, aborted, responses)
    yield _keeps_partials(check, aborted, responses)
    yield from _sampled_and_scored(
        ctx, check, aborted, responses, "T=1.0, the tokens after the abort", new_only=True
    )

    async def unknown() -> None:
        await ctx.rollout.abort("kit-no-such-request")

    asyncio.run(unknown())  # raises on a backend that refuses it: an abort may cross a request's end


async def _abort_rounds(
    ctx: RolloutContext, prompts: list[list[int]], sampling
) -> tuple[list[RolloutRequest], int, list[str]]:
    """One request at a time, aborted after a tuned wait, until ``ABORTS_WANTED`` aborts landed
    mid-generation: those requests with ``resume_from`` set to what they returned, the tries made, and
    what was wrong with any response."""
    delay, aborted, problems = ABORT_FIRST_DELAY, [], []
    tries = 0
    for i, prompt in enumerate(prompts):
        tries = i + 1
        request = RolloutRequest(prompt, sampling, seed=600 + i, request_id=f"kit-abort-{i}")
        task = asyncio.ensure_future(ctx.rollout.generate_request(request))
        await asyncio.sleep(delay)
        await ctx.rollout.abort(request.request_id)
        response = await task
        problem = _malformed(request, response, may_abort=True)
        if problem:
            problems.append(f"request {i}: {problem}")
        count = len(response.token_ids)
        if count == 0:
            delay *= 2
        elif count >= sampling.max_new_tokens:
            delay /= 2
        elif response.finish_reason is FinishReason.ABORTED:
            aborted.append(attrs.evolve(request, request_id=f"kit-resume-{i}", resume_from=response))
            if len(aborted) == ABORTS_WANTED:
                break
    return aborted, tries, problems


def check_prefix_caching(ctx: RolloutContext) -> Iterator[Comparison]:
    """Prompts sharing a ``SHARED_PREFIX``-token prefix (each ``N_SAMPLES`` times, in one call), then
    the same prompts as requests twice over (the second time a cache can serve them), then each
    request's next turn (its prompt, its response and ``TURN_TOKENS`` more tokens), then in one call and
    as requests again after a weight update: every log-prob is the reference's on that sample alone,
    under the weights of the moment (a cache keyed on less than the whole prompt gives another
    prompt's; one that claims the keys and values of a token it never ran, or puts the new tokens at
    other positions, the wrong context's; one kept across a weight update, the old weights')."""
    check = "prefix_caching"
    if not ctx.capabilities.prefix_caching:
        raise CheckSkipped(f"backend '{ctx.backend}' declares prefix_caching=False")
    (prefix,) = make_prompts([SHARED_PREFIX], seed=116)
    suffixes = make_prompts([2] * SHARED_PROMPTS, seed=119)
    distinct = [prefix + suffix for suffix in suffixes]
    prompts = [prompt for prompt in distinct for _ in range(N_SAMPLES)]
    yield samples_with(
        ctx,
        check,
        f"{len(distinct)} prompts sharing {SHARED_PREFIX} tokens, x{N_SAMPLES} in one call: rollout_log_probs",
        ctx.reference(),
        prompts,
        47,
        "reference (each sample alone)",
    )
    sampling = ctx.sampling()

    def as_requests(
        attempt: str, prompts: Sequence[Sequence[int]], sampling=sampling
    ) -> list[RolloutRequest]:
        return [
            RolloutRequest(prompt, sampling, seed=700 + i, request_id=f"kit-prefix-{attempt}-{i}")
            for i, prompt in enumerate(prompts)
        ]

    for attempt in ("first", "second"):
        requests = as_requests(attempt, distinct)
        responses = ctx.requests(requests)
        yield from _sampled_and_scored(
            ctx, check, requests, responses, f"as requests, the {attempt} time", score_only=True
        )
    answers = make_prompts([TURN_TOKENS] * SHARED_PROMPTS, seed=121)  # an environment's, say
    next_prompts = [
        [*request.prompt_ids, *response.token_ids, *answer]
        for request, response, answer in zip(requests, responses, answers, strict=True)
    ]
    turns = as_requests("turn", next_prompts, ctx.sampling(max_new_tokens=TURN_MAX_NEW_TOKENS))
    label = f"as requests, each one's next turn (its prompt, response and {TURN_TOKENS} more tokens)"
    yield from _sampled_and_scored(ctx, check, turns, ctx.requests(turns), label, score_only=True)
    # A cache filled under the old weights must not serve the new ones (vLLM's prefix cache is reset
    # after every weight load for this): the same prompts after an update, then the weights put back.
    probe = probe_weights(ctx.reference())
    send_weights(ctx, probe, overwrite=False)
    try:
        yield samples_with(
            ctx,
            check,
            "the same prompts after a weight update: rollout_log_probs of the new weights",
            probe,
            prompts,
            47,
            "updated reference",
        )
        requests = as_requests("updated", distinct)
        label = "the same prompts as requests after a weight update, under the new weights"
        yield from _sampled_and_scored(ctx, check, requests, ctx.requests(requests), label, True, True, probe)
    finally:
        send_weights(ctx, ctx.reference(), overwrite=False)


# -- reading responses ------------------------------------------------------------------------------


def well_formed(
    check: str, requests: Sequence[RolloutRequest], responses: Sequence[RolloutResponse], finish: bool = True
) -> Comparison:
    """Every response ends as the contract says (``_malformed``; its finish reason too, with ``finish``)."""
    problems = [
        f"request {i}: {problem}"
        for i, (request, response) in enumerate(zip(requests, responses, strict=True))
        if (problem := _malformed(request, response, finish=finish))
    ]
    lengths = [len(response.token_ids) for response in responses]
    return passed(
        check,
        "responses end at their first EOS or at max_new_tokens" + (", and say which" if finish else ""),
        problems,
        f"{len(responses)} responses of {min(lengths, default=0)} to {max(lengths, default=0)} tokens",
    )


def _malformed(
    request: RolloutRequest, response: RolloutResponse, may_abort: bool = False, finish: bool = True
) -> str | None:
    """What is wrong with how ``response`` ends, or ``None``: tokens after an EOS, more than
    ``max_new_tokens``, or (with ``finish``) a finish reason its tokens contradict (``aborted`` only where
    ``may_abort``; without ``finish``, fewer tokens than ``max_new_tokens`` and no EOS)."""
    tokens, sampling = list(response.token_ids), request.sampling
    eos = set(sampling.eos_token_ids)
    early = [t for t, token in enumerate(tokens[:-1]) if token in eos]
    if early:
        return f"EOS id {tokens[early[0]]} at token {early[0]} of {len(tokens)}: a response stops at its first EOS"
    if len(tokens) > sampling.max_new_tokens:
        return f"{len(tokens)} tokens for max_new_tokens={sampling.max_new_tokens}"
    ended_at_eos = bool(tokens) and tokens[-1] in eos
    if not finish:
        if not ended_at_eos and len(tokens) < sampling.max_new_tokens:
            return f"{len(tokens)} of {sampling.max_new_tokens} tokens without an EOS"
        return None
    reason = response.finish_reason
    if ended_at_eos and reason is not FinishReason.EOS:
        return f"it ends with EOS id {tokens[-1]} but says finish {reason}"
    if not ended_at_eos and len(tokens) == sampling.max_new_tokens and reason is not FinishReason.LENGTH:
        return f"it has max_new_tokens={len(tokens)} tokens and no EOS but says finish {reason}"
    if not ended_at_eos and len(tokens) < sampling.max_new_tokens:
        if reason is not FinishReason.ABORTED:
            return f"{len(tokens)} of {sampling.max_new_tokens} tokens without an EOS, finish {reason}"
        if not may_abort:
            return f"finish aborted after {len(tokens)} tokens, although nothing aborted it"
    return None


def _keeps_partials(
    check: str, requests: Sequence[RolloutRequest], responses: Sequence[RolloutResponse]
) -> Comparison:
    problems = []
    for i, (request, response) in enumerate(zip(requests, responses, strict=True)):
        partial = request.resume_from
        count = len(partial.token_ids)
        if response.token_ids[:count] != partial.token_ids or response.log_probs[:count] != partial.log_probs:
            problems.append(
                f"request {i}: resumed from {list(partial.token_ids)}, it starts {list(response.token_ids[:count])} "
                "(the response is resume_from's tokens and log-probs followed by the new ones)"
            )
        elif len(response.token_ids) != request.sampling.max_new_tokens:
            problems.append(
                f"request {i}: {len(response.token_ids)} tokens after resuming {count}, for max_new_tokens="
                f"{request.sampling.max_new_tokens} and no EOS (max_new_tokens counts the whole response)"
            )
    return passed(
        check,
        "a resumed response keeps its partial tokens and log-probs and runs to max_new_tokens",
        problems,
        f"{len(responses)} resumed responses",
    )


def _sampled_and_scored(
    ctx: RolloutContext,
    check: str,
    requests: Sequence[RolloutRequest],
    responses: Sequence[RolloutResponse],
    label: str,
    new_only: bool = False,
    score_only: bool = False,
    model: torch.nn.Module | None = None,
) -> Iterator[Comparison]:
    """The tokens of ``responses`` (after ``resume_from``'s with ``new_only``) follow the reference's
    ``softmax(logits / T)`` (z-test; not with ``score_only``), and their log-probs are the reference's
    under the declared semantics, within ``ctx.tolerance``; ``model``: another reference (the weights
    of an update)."""
    semantics = ctx.capabilities.log_prob_semantics
    distributions, sampled, actual, expected = [], [], [], []
    all_logits = _response_logits(model or ctx.reference(), requests, responses)
    for request, response, logits in zip(requests, responses, all_logits, strict=True):
        start = len(request.generated) if new_only else 0
        tokens = list(response.token_ids)
        if len(tokens) <= start:
            continue
        sampling = request.sampling
        logits = logits[start:]
        new = torch.tensor(tokens[start:])
        distributions.append(torch.log_softmax(logits / (sampling.temperature or 1.0), dim=-1))
        sampled.append(new)
        scored = declared_log_probs(logits, sampling.temperature, semantics, sampling.top_k, sampling.top_p)
        expected.append(scored.gather(-1, new[:, None])[:, 0])
        actual.append(torch.tensor(response.log_probs[start:], dtype=torch.float64))
    if not score_only:
        yield follows(
            check,
            f"{label}: sampled tokens follow softmax(logits / T)",
            distributions,
            sampled,
            SAMPLING_Z_LIMIT,
            "",
        )
    if not actual:
        yield Comparison(
            check, f"{label}: log_probs", 0, False, "no token to compare: every response is empty"
        )
        return
    yield compare_tensors(
        check,
        f"{label}: log_probs",
        torch.cat(actual),
        torch.cat(expected),
        ctx.tolerance,
        0,
        subject="rollout",
    )


def _stopping_case(ctx: RolloutContext) -> tuple[list[int], list[int], int]:
    """A prompt, its greedy continuation of ``STOP_AT`` tokens under the reference (every argmax clear by
    ``STOP_MIN_GAP``, the last token not among the others) and a token of the prompt found nowhere in
    the continuation."""
    model = ctx.reference()
    for prompt in make_prompts([PROMPT_LENGTH] * 16, seed=114):
        greedy, gap = [], math.inf
        for _ in range(STOP_AT):
            logits = reference.next_token_logits(model, [prompt + greedy]).double()[0]
            top2 = logits.topk(2)
            gap = min(gap, float(top2.values[0] - top2.values[1]))
            greedy.append(int(top2.indices[0]))
        outside = [token for token in prompt if token not in greedy]
        if gap > STOP_MIN_GAP and greedy[-1] not in greedy[:-1] and outside:
            return prompt, greedy, outside[0]
    raise RuntimeError("rollout kit bug: no prompt with a clear greedy continuation for 'stopping'")


@torch.no_grad()
def _response_logits(
    model: torch.nn.Module, requests: Sequence[RolloutRequest], responses: Sequence[RolloutResponse]
) -> list[torch.Tensor]:
    """Per response, the reference's logits ``[r, V]`` (float64) that predict its tokens given its
    request's prompt, teacher-forced: ``reference.response_logits`` for all of them in one forward pass,
    each row ``prompt + response`` from position 0, right-padded (in a causal model the padding after a
    row's tokens changes nothing before it; ``rollout_weights._log_probs_with`` does the same)."""
    rows = [
        [*request.prompt_ids, *response.token_ids]
        for request, response in zip(requests, responses, strict=True)
    ]
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)
    logits = model.eval()(input_ids=input_ids).logits.double()
    return [logits[i, len(request.prompt_ids) - 1 : len(rows[i]) - 1] for i, request in enumerate(requests)]
