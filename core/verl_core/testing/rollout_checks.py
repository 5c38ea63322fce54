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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import torch
from tensordict import TensorDict

from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from verl_core.rollout.base import ROLLOUT_LOG_PROBS, BaseRollout, SamplingParams
from verl_core.testing import reference
from verl_core.testing.context import BASE_OPTIM
from verl_core.testing.report import BITWISE, Comparison, Tolerance, compare_tensors
from verl_core.testing.tiny import PAD_TOKEN_ID, TinyModelSpec, make_samples

# -- the model and the sampling setup ----------------------------------------------------------------

#: The kit's model is the engine kit's tiny Qwen2 with its LM head scaled by this factor: the tiny
#: model's own logits spread by ~0.1, so its next-token distributions are nearly uniform and
#: temperature hardly changes them. Scaled, they spread by ~1 (entropy ~4.2 nats of 4.85 at T = 1,
#: ~3.7 at T = 0.7): sampling at the wrong temperature shows, and greedy decoding has clear winners.
ROLLOUT_LOGIT_SCALE = 10.0
#: The EOS token of the checks that sample with one EOS id.
EOS_TOKEN_ID = 2
#: The EOS ids of ``batch_contract``: 16 of the 128 tokens, about 1/8 of the probability at each step,
#: so that in one call of 32 prompts and 6 new tokens some responses stop at an EOS and some run to
#: ``max_new_tokens`` (the chance that either case is missing is below 1e-8 for a correct rollout).
EOS_TOKEN_IDS = tuple(range(EOS_TOKEN_ID, 128, 8))
#: The temperatures at which sampled log-probs and the sampling distribution are checked.
TEMPERATURES = (0.7, 1.0)
#: The prompt length of every check but ``prompt_lengths`` and ``batch_contract``.
PROMPT_LENGTH = 6
#: The prompt lengths that ``prompt_lengths`` mixes in one call (twice each).
MIXED_PROMPT_LENGTHS = (1, 8, 3, 6, 2, 7, 4, 5)
#: Responses per prompt in ``n_samples`` (each prompt repeated ``N_SAMPLES`` times in a row, as the
#: trainer asks for ``rollout.n`` responses).
N_SAMPLES = 4

# -- tolerances (fp32 on CPU; a correct rollout differs from the reference by ~1e-6) -----------------

#: Log-probs of the sampled tokens against the reference: the engine kit's tolerance for the engine's
#: own log-probs, so that rollout and engine agree within twice this.
LOG_PROB_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5)
#: Greedy decoding: a token whose reference logit is within this of the largest counts as the argmax
#: (a tie that float rounding may break either way). The smallest gap between the two most likely
#: tokens along the kit's greedy responses is ~1e-3, far above it.
GREEDY_TIE_TOLERANCE = 1e-5
#: ``sampling``: the largest ``|z|`` of the sampled tokens' mean log-probability under the reference's
#: ``softmax(logits / T)`` (a correct rollout fails with probability ~6e-7 per temperature).
SAMPLING_Z_LIMIT = 5.0
#: ``weight_sync``: the trained weights must move the reference's log-probs of the sampled tokens by
#: at least this (100 times the log-prob tolerance), or the check could not tell them from the old
#: ones (the kit's training step moves them by up to ~0.25).
SYNC_MIN_CHANGE = 1e-3


def save_rollout_model(
    directory: str | Path, spec: TinyModelSpec | None = None, logit_scale: float = ROLLOUT_LOGIT_SCALE
) -> str:
    """Build the rollout kit's model (the tiny causal LM of ``spec``, by default the engine kit's
    ``TinyModelSpec()``, seeded, its LM head scaled by ``logit_scale``), save it with
    ``save_pretrained`` in ``directory`` and return the path."""
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    path = Path(directory)
    model.save_pretrained(path)
    return str(path)


def make_prompts(lengths: Sequence[int], seed: int, vocab_size: int = 128) -> list[list[int]]:
    """One prompt per length, random tokens (never the pad id), all different, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    for length in lengths:
        prompt = torch.randint(1, vocab_size, (length,), generator=generator).tolist()
        while prompt in prompts:  # a repeated prompt is n_samples' subject only
            prompt = torch.randint(1, vocab_size, (length,), generator=generator).tolist()
        prompts.append(prompt)
    return prompts


# -- the context ------------------------------------------------------------------------------------


@attrs.define
class RolloutContext:
    """What every check needs: the rollout under test, its model and device, and the reference."""

    backend: str
    rollout: BaseRollout
    model_dir: str
    device: str
    _reference: torch.nn.Module | None = attrs.field(default=None, init=False, repr=False)

    def reference(self) -> torch.nn.Module:
        """The reference model: the same weights as the rollout's, loaded by ``from_pretrained``."""
        if self._reference is None:
            self._reference = reference.load_reference_model(self.model_dir, "lm").eval()
        return self._reference

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seed: int,
        temperature: float = 1.0,
        max_new_tokens: int = 12,
        eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,),
    ) -> TensorDict:
        """The rollout's ``generate`` (top-k and top-p off), its result checked to have the keys the
        checks read."""
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            pad_token_id=PAD_TOKEN_ID,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
        )
        output = self.rollout.generate([list(prompt) for prompt in prompts], sampling, seed)
        missing = [key for key in REQUIRED_KEYS if key not in output.keys()]
        if missing:
            raise KeyError(
                f"generate() returned no {missing} (it returned {sorted(output.keys())}): the batch "
                f"contract is {list(REQUIRED_KEYS)}, see verl_core.rollout.BaseRollout.generate"
            )
        return output


#: What ``generate`` must return (``verl_core.data.batch`` and ``verl_core.rollout.base``).
REQUIRED_KEYS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS)


@attrs.frozen
class Row:
    """One row of a rollout's output, read through its masks: the prompt, the response tokens and
    their positions in the row's response columns."""

    prompt: list[int]
    response: list[int]
    columns: torch.Tensor  # [r] indices into the response columns


def rows_of(output: TensorDict) -> list[Row]:
    """Each row's prompt (the attention mask's prompt columns) and response (``response_mask``)."""
    output = output.to("cpu")  # a batch on the device is batch_contract's to report
    width = output[RESPONSES].shape[-1]
    prompt_ids = output[INPUT_IDS][:, :-width] if width else output[INPUT_IDS]
    prompt_mask = output[ATTENTION_MASK][:, : prompt_ids.shape[-1]].bool()
    rows = []
    for row in range(output.batch_size[0]):
        columns = output[RESPONSE_MASK][row].bool().nonzero()[:, 0]
        rows.append(
            Row(
                prompt_ids[row][prompt_mask[row]].tolist(),
                output[RESPONSES][row][columns].tolist(),
                columns,
            )
        )
    return rows


def reference_log_probs(
    model: torch.nn.Module, output: TensorDict, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs of every response token of ``output`` (``[B, R]``, at the rollout's
    columns, zero elsewhere) at ``temperature`` (0: untempered, as for greedy decoding), and the
    mask of the columns that hold a response token."""
    expected = torch.zeros(output[RESPONSES].shape, dtype=torch.float64)
    mask = torch.zeros(output[RESPONSES].shape, dtype=torch.bool)
    scale = temperature if temperature > 0 else 1.0
    for index, row in enumerate(rows_of(output)):
        if not row.response or not row.prompt:
            continue
        logits = reference.response_logits(model, row.prompt, row.response).double()
        log_probs = torch.log_softmax(logits / scale, dim=-1)
        expected[index, row.columns] = log_probs.gather(-1, torch.tensor(row.response)[:, None])[:, 0]
        mask[index, row.columns] = True
    return expected, mask


def _compare_log_probs(
    check: str, quantity: str, output: TensorDict, expected: torch.Tensor, mask: torch.Tensor, against: str
) -> Comparison:
    if not bool(mask.any()):  # a comparison of nothing would pass, and prove nothing
        return Comparison(check, quantity, 0, False, "no response token to compare: every response_mask is 0")
    return compare_tensors(
        check,
        quantity,
        output[ROLLOUT_LOG_PROBS],
        expected,
        LOG_PROB_TOLERANCE,
        0,
        mask,
        against=against,
        subject="rollout",
    )


def _passed(check: str, quantity: str, problems: list[str], fine: str) -> Comparison:
    """A comparison that passes when ``problems`` is empty and otherwise names the first few."""
    if not problems:
        return Comparison(check, quantity, 0, True, fine)
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return Comparison(check, quantity, 0, False, shown)


# -- the checks -------------------------------------------------------------------------------------


def check_batch_contract(ctx: RolloutContext) -> list[Comparison]:
    check = "batch_contract"
    max_new_tokens = 6
    # Every length from 1 to 8, four times, so that prompts are left-padded by 0 to 7 tokens.
    prompts = make_prompts([1 + i % 8 for i in range(32)], seed=101)
    output = ctx.generate(prompts, seed=7, max_new_tokens=max_new_tokens, eos_token_ids=EOS_TOKEN_IDS)
    comparisons = [_layout_shapes(check, output, len(prompts), max_new_tokens)]
    if not comparisons[0].passed:
        return comparisons  # nothing below can be read from tensors of the wrong shapes
    devices = sorted({str(output[key].device) for key in REQUIRED_KEYS} - {"cpu"})
    comparisons.append(
        _passed(
            check,
            "on the CPU",
            [f"tensors on {devices}: generate() returns its batch on the CPU"] if devices else [],
            "every tensor on the CPU",
        )
    )
    output = output.to("cpu")
    batch, width = output[RESPONSES].shape
    prompt_width = output[INPUT_IDS].shape[-1] - width
    attention_mask = output[ATTENTION_MASK]
    response_mask = output[RESPONSE_MASK]
    pad = PAD_TOKEN_ID

    problems = []
    for row, prompt in enumerate(prompts):
        expected_mask = [0] * (prompt_width - len(prompt)) + [1] * len(prompt)
        got_mask = attention_mask[row, :prompt_width].tolist()
        got_ids = output[INPUT_IDS][row, :prompt_width].tolist()
        if got_mask != expected_mask:
            problems.append(f"row {row} (a {len(prompt)}-token prompt): attention_mask {got_mask}")
        elif got_ids[prompt_width - len(prompt) :] != prompt:
            problems.append(
                f"row {row}: prompt tokens {got_ids} are not its prompt {prompt} (rows out of order?)"
            )
        elif any(token != pad for token in got_ids[: prompt_width - len(prompt)]):
            problems.append(f"row {row}: prompt padding {got_ids} is not the pad id {pad}")
    comparisons.append(
        _passed(
            check,
            "prompts left-padded, in prompt order",
            problems,
            f"all {batch} prompts left-padded to {prompt_width} tokens with the pad id, in order",
        )
    )

    problems = []
    lengths = []
    for row in range(batch):
        mask = response_mask[row].tolist()
        length = int(sum(mask))
        lengths.append(length)
        if mask != [1] * length + [0] * (width - length):
            problems.append(f"row {row}: response_mask {mask} is not 1s then 0s")
            continue
        after = output[RESPONSES][row, length:]
        if bool((after != pad).any()):
            problems.append(
                f"row {row}: tokens {after.tolist()} after the response's {length} tokens are not the pad id "
                f"{pad} (a token left out of the mask?)"
            )
        elif bool((output[ROLLOUT_LOG_PROBS][row, length:] != 0).any()):
            problems.append(f"row {row}: rollout_log_probs after the response are not 0")
    comparisons.append(
        _passed(
            check,
            "responses right-padded",
            problems,
            f"responses of {min(lengths)} to {max(lengths)} tokens right-padded to {width} with the pad "
            "id, log-probs 0 after them",
        )
    )

    problems = []
    if not torch.equal(output[INPUT_IDS][:, prompt_width:], output[RESPONSES]):
        problems.append("input_ids' response columns are not responses")
    if not torch.equal(attention_mask[:, prompt_width:], response_mask):
        problems.append("attention_mask's response columns are not response_mask")
    expected_positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    if not torch.equal(output[POSITION_IDS], expected_positions):
        differs = (output[POSITION_IDS] != expected_positions).any(dim=-1).nonzero()[:, 0].tolist()
        problems.append(
            f"position_ids of rows {differs[:5]} are not (attention_mask.cumsum(-1) - 1).clamp(min=0): "
            "positions must count real tokens only"
        )
    comparisons.append(
        _passed(
            check,
            "input_ids, attention_mask, position_ids",
            problems,
            "[prompt | response] columns, masks and positions as the batch contract computes them",
        )
    )

    eos = set(EOS_TOKEN_IDS)
    problems = []
    stopped = full = 0
    # Read through the mask, wherever it is: a response mask that is not 1s then 0s is reported above.
    for row, read in enumerate(rows_of(output)):
        response = read.response
        early = [t for t, token in enumerate(response[:-1]) if token in eos]
        if not response:
            problems.append(f"row {row}: an empty response (a response has at least one token)")
        elif early:
            problems.append(
                f"row {row}: response {response} holds EOS id {response[early[0]]} at token {early[0]} "
                "and goes on (generation must stop at the first EOS and keep it as the last token)"
            )
        elif response[-1] in eos:
            stopped += 1
        elif len(response) == max_new_tokens:
            full += 1
        else:
            after = output[RESPONSES][row, int(read.columns[-1]) + 1 :].tolist()
            dropped = (
                " (an EOS id follows outside the mask: the EOS was dropped from it)"
                if any(token in eos for token in after)
                else ""
            )
            problems.append(
                f"row {row}: response {response} ends after {len(response)} of {max_new_tokens} tokens "
                f"without an EOS id{dropped}"
            )
    comparisons.append(
        _passed(
            check,
            "EOS ends a response, inside its mask",
            problems,
            f"{stopped} responses end with their EOS (kept, in the mask), {full} run to max_new_tokens",
        )
    )
    exercised = stopped > 0 and full > 0
    comparisons.append(
        Comparison(
            check,
            "both endings exercised",
            0,
            exercised or bool(problems),  # a response read wrongly is already reported above
            f"{stopped} of {batch} responses ended at an EOS and {full} ran to max_new_tokens={max_new_tokens}"
            + (
                ""
                if exercised
                else "; the kit expects both (with its 16 EOS ids holding ~1/8 of the probability, a correct "
                "rollout misses either with a chance below 1e-8): are eos_token_ids or max_new_tokens ignored?"
            ),
        )
    )
    return comparisons


def _layout_shapes(check: str, output: TensorDict, batch: int, max_new_tokens: int) -> Comparison:
    problems = []
    if output.batch_size[:1] != torch.Size([batch]):
        problems.append(f"batch size {list(output.batch_size)} for {batch} prompts")
    width = output[RESPONSES].shape[-1] if output[RESPONSES].dim() == 2 else -1
    sequence = output[INPUT_IDS].shape[-1] if output[INPUT_IDS].dim() == 2 else -1
    for key in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS):
        if list(output[key].shape) != [batch, sequence]:
            problems.append(
                f"{key} has shape {list(output[key].shape)}, input_ids {list(output[INPUT_IDS].shape)}"
            )
    for key in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS):
        if list(output[key].shape) != [batch, width]:
            problems.append(
                f"{key} has shape {list(output[key].shape)}, responses {list(output[RESPONSES].shape)}"
            )
    if width > max_new_tokens:
        problems.append(f"{width} response columns for max_new_tokens={max_new_tokens}")
    for key in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, RESPONSES, RESPONSE_MASK):
        if output[key].dtype != torch.int64:
            problems.append(f"{key} is {output[key].dtype}, not torch.int64")
    if not output[ROLLOUT_LOG_PROBS].is_floating_point():
        problems.append(f"{ROLLOUT_LOG_PROBS} is {output[ROLLOUT_LOG_PROBS].dtype}, not floating point")
    return _passed(
        check,
        "keys, shapes, dtypes",
        problems,
        f"[{batch}, P + R] sequences and [{batch}, R] responses, int64 ids and masks",
    )


def check_log_probs(ctx: RolloutContext) -> list[Comparison]:
    prompts = make_prompts([PROMPT_LENGTH] * 8, seed=102)
    comparisons = []
    for temperature in TEMPERATURES:
        output = ctx.generate(prompts, seed=11, temperature=temperature)
        expected, mask = reference_log_probs(ctx.reference(), output, temperature)
        comparisons.append(
            _compare_log_probs(
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
        _compare_log_probs(check, "rollout_log_probs (untempered)", output, expected, mask, "reference"),
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
        _compare_log_probs(
            "prompt_lengths",
            f"rollout_log_probs of the {high}-token prompts (no padding)",
            output,
            expected,
            mask & longest,
            "reference",
        ),
        _compare_log_probs(
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
        _compare_log_probs(check, "rollout_log_probs", output, expected, mask, "reference"),
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
        comparison = _compare_log_probs(
            check, f"after syncing {label}: rollout_log_probs", output, expected, mask, "synced reference"
        )
        comparisons.append(comparison)
        if not comparison.passed:
            old = _compare_log_probs(check, "", output, before, mask, "")
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


@attrs.frozen
class RolloutCheck:
    """A named rollout check with a one-line statement of what it proves (docs/conformance.md has more)."""

    name: str
    run: Callable[[RolloutContext], list[Comparison]]
    proves: str


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
