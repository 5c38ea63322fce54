"""What every rollout conformance check works with: the kit's model (its logits scaled, so that
temperature matters) and sampling setup, the tolerances, the rollout under test in a
``RolloutContext`` (with the capabilities its descriptor declares), its output read row by row, and
the reference's log-probs of the same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from tensordict import TensorDict

from verl_core.data.batch import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
)
from verl_core.descriptors import LogProbSemantics, RolloutCapabilities
from verl_core.rollout.base import BaseRollout, SamplingParams
from verl_core.rollout.requests import RolloutRequest, RolloutResponse
from verl_core.testing import reference
from verl_core.testing.report import Comparison, Tolerance, compare_tensors
from verl_core.testing.tiny import PAD_TOKEN_ID, TinyModelSpec

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
#: ``sampling``'s first tokens: prompts, each response's first token checked alone, at this
#: temperature. A first token drawn at T = 1 when asked for 0.7 moves z by ~0.46 per token: z ~ -15.
FIRST_TOKEN_PROMPTS = 1024
FIRST_TOKEN_TEMPERATURE = 0.7
#: ``n_samples``' independence test: prompts, each repeated ``N_SAMPLES`` times.
INDEPENDENCE_PROMPTS = 32
#: ``filters``: the top-k and top-p (nucleus) settings whose restrictions are checked, at T = 1.
FILTER_TOP_K = 8
FILTER_TOP_P = 0.5

# -- tolerances (fp32 on CPU; a correct rollout differs from the reference by ~1e-6) -----------------

#: Log-probs of the sampled tokens against the reference: the engine kit's tolerance for the engine's
#: own log-probs, so that rollout and engine agree within twice this. A backend declaring a looser
#: ``RolloutCapabilities.log_prob_tolerance`` is held to its own (``RolloutContext.tolerance``).
LOG_PROB_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5)
#: Greedy decoding: a token whose reference logit is within this of the largest counts as the argmax
#: (a tie that float rounding may break either way). The smallest gap between the two most likely
#: tokens along the kit's greedy responses is ~1e-3, far above it.
GREEDY_TIE_TOLERANCE = 1e-5
#: ``sampling``: the largest ``|z|`` of the sampled tokens' mean log-probability under the reference's
#: ``softmax(logits / T)`` (a correct rollout fails with probability ~6e-7 per temperature).
SAMPLING_Z_LIMIT = 5.0
#: ``sampling``: the largest ``|z|`` of the first tokens alone. Drawn independently from known
#: distributions (one per prompt), so the chance that a correct rollout exceeds it is bounded
#: exactly (Chernoff, on the kit's prompts): below 1e-7 per temperature (docs/conformance.md).
FIRST_TOKEN_Z_LIMIT = 6.0
#: ``n_samples``: the smallest chance, under independent draws, of as many prompts whose n first
#: tokens repeat one as observed; a correct rollout falls below it with probability at most this.
INDEPENDENCE_P_LIMIT = 1e-7
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
    """What every check needs: the rollout under test, what its descriptor declares
    (``capabilities``), its model and device, and the reference."""

    backend: str
    rollout: BaseRollout
    model_dir: str
    device: str
    capabilities: RolloutCapabilities = attrs.field(factory=RolloutCapabilities)
    _reference: torch.nn.Module | None = attrs.field(default=None, init=False, repr=False)

    @property
    def declared(self) -> Tolerance:
        """The log-prob tolerance the backend declares: ``log_probs`` holds it to exactly that."""
        tolerance = self.capabilities.log_prob_tolerance
        return Tolerance(atol=tolerance, rtol=tolerance)

    @property
    def tolerance(self) -> Tolerance:
        """The log-prob tolerance of every other check: the declared one, or the kit's where that is
        looser (those checks test what is sampled and under which weights, not precision)."""
        declared = self.capabilities.log_prob_tolerance
        return self.declared if declared >= LOG_PROB_TOLERANCE.atol else LOG_PROB_TOLERANCE

    def sampling(
        self,
        temperature: float = 1.0,
        max_new_tokens: int = 12,
        eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,),
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_token_ids,
            pad_token_id=PAD_TOKEN_ID,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )

    def requests(self, requests: Sequence[RolloutRequest]) -> list[RolloutResponse]:
        """The rollout's ``generate_request`` for every request, all in flight together, in order."""

        async def all_of() -> list[RolloutResponse]:
            return list(await asyncio.gather(*(self.rollout.generate_request(r) for r in requests)))

        responses = asyncio.run(all_of())
        for request, response in zip(requests, responses, strict=True):
            if not isinstance(response, RolloutResponse):
                raise TypeError(
                    f"generate_request returned {type(response).__name__}, not a verl_core.rollout.RolloutResponse"
                )
            if response.request_id != request.request_id:
                raise ValueError(
                    f"generate_request({request.request_id!r}) answered with request_id {response.request_id!r}"
                )
        return responses

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
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> TensorDict:
        """The rollout's ``generate`` (by default top-k and top-p off), its result checked to have the
        keys the checks read."""
        sampling = self.sampling(temperature, max_new_tokens, eos_token_ids, top_k, top_p)
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


def first_tokens(output: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``output`` with a response, and the first token of each (at the first column of
    its ``response_mask``)."""
    mask = output[RESPONSE_MASK].to("cpu").bool()
    rows = mask.any(dim=-1).nonzero()[:, 0]
    columns = mask[rows].int().argmax(dim=-1)
    return rows, output[RESPONSES].to("cpu")[rows, columns]


def reference_log_probs(
    model: torch.nn.Module,
    output: TensorDict,
    temperature: float,
    semantics: LogProbSemantics = LogProbSemantics.TEMPERED,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's log-probs of every response token of ``output`` (``[B, R]``, at the rollout's
    columns, zero elsewhere) at ``temperature`` (0: untempered, as for greedy decoding), and the
    mask of the columns that hold a response token. ``semantics`` other than the contract's: those a
    backend declares (``declared_log_probs``)."""
    expected = torch.zeros(output[RESPONSES].shape, dtype=torch.float64)
    mask = torch.zeros(output[RESPONSES].shape, dtype=torch.bool)
    for index, row in enumerate(rows_of(output)):
        if not row.response or not row.prompt:
            continue
        logits = reference.response_logits(model, row.prompt, row.response).double()
        log_probs = declared_log_probs(logits, temperature, semantics, top_k, top_p)
        expected[index, row.columns] = log_probs.gather(-1, torch.tensor(row.response)[:, None])[:, 0]
        mask[index, row.columns] = True
    return expected, mask


def declared_log_probs(
    logits: torch.Tensor, temperature: float, semantics: LogProbSemantics, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """``[r, V]`` log-probs of ``logits`` ``[r, V]`` under ``semantics`` (``LogProbSemantics``): the
    contract's ``log_softmax(logits / T)`` (untempered for greedy decoding), untempered ones (``raw``),
    or the tempered distribution after top-k / top-p, renormalised (``filtered``)."""
    from verl_core.rollout.sampling import filter_logits

    if temperature == 0 or semantics is LogProbSemantics.RAW:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if semantics is LogProbSemantics.FILTERED:
        scaled = filter_logits(scaled, top_k, top_p)
    return torch.log_softmax(scaled, dim=-1)


def compare_log_probs(
    check: str,
    quantity: str,
    output: TensorDict,
    expected: torch.Tensor,
    mask: torch.Tensor,
    against: str,
    tolerance: Tolerance = LOG_PROB_TOLERANCE,
) -> Comparison:
    """The rollout's ``rollout_log_probs`` of ``output`` against ``expected`` where ``mask`` holds, within
    ``tolerance`` (a check passes ``ctx.tolerance``)."""
    if not bool(mask.any()):  # a comparison of nothing would pass, and prove nothing
        return Comparison(check, quantity, 0, False, "no response token to compare: every response_mask is 0")
    return compare_tensors(
        check,
        quantity,
        output[ROLLOUT_LOG_PROBS],
        expected,
        tolerance,
        0,
        mask,
        against=against,
        subject="rollout",
    )


def passed(check: str, quantity: str, problems: list[str], fine: str) -> Comparison:
    """A comparison that passes when ``problems`` is empty and otherwise names the first few."""
    if not problems:
        return Comparison(check, quantity, 0, True, fine)
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return Comparison(check, quantity, 0, False, shown)


def follows(
    check: str,
    quantity: str,
    log_probs: list[torch.Tensor],
    sampled: list[torch.Tensor],
    limit: float,
    hint: str,
) -> Comparison:
    """Whether the tokens ``sampled`` were drawn from the distributions ``log_probs`` (one row each):
    ``|z|`` of ``rollout_statistics.log_prob_z`` within ``limit``; ``hint`` is added to a failure's
    explanation."""
    from verl_core.testing.rollout_statistics import log_prob_z

    if not log_probs:
        return Comparison(check, quantity, 0, False, "the rollout sampled no tokens")
    test = log_prob_z(torch.cat(log_probs), torch.cat(sampled))
    detail = (
        f"mean log-prob of the {test.tokens} sampled tokens under the reference's softmax(logits / T) "
        f"{test.mean_log_prob:.4f}, expected {test.expected_mean:.4f} (minus the mean entropy): "
        f"z = {test.z:.2f} (|z| <= {limit:g})"
    )
    if test.z < -limit:
        detail += (
            "; the tokens are less likely than T makes them: sampled at a higher temperature (T ignored?)"
            + hint
        )
    elif test.z > limit:
        detail += (
            "; the tokens are more likely than T makes them: sampled at a lower temperature, or filtered "
            "(a top-k or top-p applied although top_k=0, top_p=1)" + hint
        )
    return Comparison(check, quantity, 0, abs(test.z) <= limit, detail, abs(test.z))
