"""The rollout conformance kit itself: the built-in ``hf`` rollout passes it, and, run against
deliberately broken rollouts, it fails each of them in exactly the check meant to catch it.

The broken rollouts are subclasses of ``HFRollout``, each with one realistic bug, provided by this
module acting as a plugin (``verl_rollout_backends`` below): the kit looks them up through the
registry exactly as it would an installed plugin's. Every variant runs the whole kit, and the test
asserts which checks fail, so a check that starts catching a bug meant for another, or stops
catching its own, shows. The kit's model is built once for the module.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import attrs
import pytest
import torch

from verl_core import RolloutBackend, hookimpl
from verl_core.data import ROLLOUT_LOG_PROBS
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from verl_core.errors import UnknownNameError
from verl_core.rollout import hf as hf_rollout
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.decoder import decoder_for
from verl_core.rollout.hf import HFRollout
from verl_core.rollout.sampling import filter_logits, sample_next
from verl_core.testing import ROLLOUT_CHECKS, RolloutConformance, run_rollout_conformance, save_rollout_model
from verl_core.testing.report import ConformanceReport

torch.set_num_threads(1)

THIS_PLUGIN = sys.modules[__name__]


# -- broken rollouts, provided by this module as a plugin ---------------------------------------------


@contextlib.contextmanager
def sampling_with(function):
    """``HFRollout`` choosing its tokens with ``function`` instead of ``sample_next``."""
    original = hf_rollout.sample_next
    hf_rollout.sample_next = function
    try:
        yield
    finally:
        hf_rollout.sample_next = original


class UntemperedLogProbsRollout(HFRollout):
    """Samples at the requested temperature but reports ``log_softmax(logits)``: the untempered
    log-probs of the tokens it drew."""

    def generate(self, prompts, sampling, seed):
        def untempered(logits, sampling, generator):
            tokens, _ = sample_next(logits, sampling, generator)
            return tokens, logits.float().log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]

        with sampling_with(untempered):
            return super().generate(prompts, sampling, seed)


class IgnoresTemperatureRollout(HFRollout):
    """Draws every token from ``softmax(logits)`` whatever the temperature, while reporting the
    log-probs of the tempered distribution (what the engine will compute, so they look right)."""

    def generate(self, prompts, sampling, seed):
        def at_temperature_one(logits, sampling, generator):
            if sampling.greedy:
                return sample_next(logits, sampling, generator)
            drawn, _ = sample_next(logits, attrs.evolve(sampling, temperature=1.0), generator)
            reported = (logits.float() / sampling.temperature).log_softmax(dim=-1)
            return drawn, reported.gather(-1, drawn[:, None])[:, 0]

        with sampling_with(at_temperature_one):
            return super().generate(prompts, sampling, seed)


class DefaultTopKRollout(HFRollout):
    """Samples with ``top_k=50`` when asked for ``top_k=0`` (``transformers``' ``generate`` default when
    ``top_k`` is not passed), reporting the unfiltered log-probs."""

    def generate(self, prompts, sampling, seed):
        def top_50(logits, sampling, generator):
            if sampling.greedy:
                return sample_next(logits, sampling, generator)
            scaled = logits.float() / sampling.temperature
            filtered = filter_logits(scaled, sampling.top_k or 50, sampling.top_p)
            tokens = torch.multinomial(filtered.softmax(dim=-1), 1, generator=generator)[:, 0]
            return tokens, scaled.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]

        with sampling_with(top_50):
            return super().generate(prompts, sampling, seed)


class GreedySamplesRollout(HFRollout):
    """Treats ``temperature=0`` as "no temperature": samples from ``softmax(logits)``."""

    def generate(self, prompts, sampling, seed):
        def sampling_greedy(logits, sampling, generator):
            if sampling.greedy:
                return sample_next(logits, attrs.evolve(sampling, temperature=1.0), generator)
            return sample_next(logits, sampling, generator)

        with sampling_with(sampling_greedy):
            return super().generate(prompts, sampling, seed)


class GlobalRngRollout(HFRollout):
    """Ignores the seed: draws from torch's global RNG (``multinomial`` without a generator)."""

    def generate(self, prompts, sampling, seed):
        with sampling_with(lambda logits, sampling, generator: sample_next(logits, sampling, None)):
            return super().generate(prompts, sampling, seed)


class StaleWeightsRollout(HFRollout):
    """Decodes with its own copy of the model made at ``initialize`` (as an inference engine holds its
    weights in its own format); ``update_weights`` checks and writes the Hugging Face model, which
    nothing samples with."""

    def initialize(self):
        super().initialize()
        self._decoder = decoder_for(copy.deepcopy(self.model), self.options.lean_decoder)


class PaddedPositionsDecoder:
    """Wraps a decoder: the positions of generated tokens count from the padded prompt width (the
    usual ``input_ids.shape[1] + step``), while the prompt's own count its real tokens."""

    def __init__(self, inner):
        self.inner = inner
        self.padding = torch.zeros(0, dtype=torch.int64)

    def prefill(self, input_ids, attention_mask, capacity):
        self.padding = (attention_mask == 0).sum(dim=-1)
        return self.inner.prefill(input_ids, attention_mask, capacity)

    def select(self, rows):
        self.padding = self.padding[rows]
        self.inner.select(rows)

    def release(self):
        self.inner.release()

    def step(self, tokens, positions):
        return self.inner.step(tokens, positions + self.padding)


class PaddedPositionsRollout(HFRollout):
    """Generated tokens' positions come from the padded prompt width: wrong only for a prompt shorter
    than the longest of its call (invisible with one prompt length, since RoPE is shift-invariant)."""

    def initialize(self):
        super().initialize()
        self._decoder = PaddedPositionsDecoder(self._decoder)


def _with_response_layout(output, responses, response_mask, log_probs):
    """``output`` with its response columns replaced, ``input_ids``, masks and positions following."""
    prompt_width = output[INPUT_IDS].shape[-1] - output[RESPONSES].shape[-1]
    output[RESPONSES], output[RESPONSE_MASK], output[ROLLOUT_LOG_PROBS] = responses, response_mask, log_probs
    output[INPUT_IDS] = torch.cat([output[INPUT_IDS][:, :prompt_width], responses], dim=-1)
    output[ATTENTION_MASK] = torch.cat([output[ATTENTION_MASK][:, :prompt_width], response_mask], dim=-1)
    output[POSITION_IDS] = (output[ATTENTION_MASK].cumsum(dim=-1) - 1).clamp(min=0)
    return output


class EosOutsideMaskRollout(HFRollout):
    """Builds the response mask as "not EOS and not padding": a response that stopped at an EOS keeps
    the token but leaves it out of its masks (the policy never learns to stop)."""

    def generate(self, prompts, sampling, seed):
        output = super().generate(prompts, sampling, seed)
        eos = torch.tensor(sampling.eos_token_ids)
        mask = output[RESPONSE_MASK] * ~torch.isin(output[RESPONSES], eos)
        return _with_response_layout(output, output[RESPONSES], mask, output[ROLLOUT_LOG_PROBS])


class LeftPaddedResponsesRollout(HFRollout):
    """Pads responses on the left, like its prompts (its masks and positions agree with that)."""

    def generate(self, prompts, sampling, seed):
        output = super().generate(prompts, sampling, seed)
        responses, mask, log_probs = (
            output[key].clone() for key in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS)
        )
        for row in range(len(responses)):
            shift = int((mask[row] == 0).sum())
            for tensor in (responses, mask, log_probs):
                tensor[row] = tensor[row].roll(shift)
        return _with_response_layout(output, responses, mask, log_probs)


class OneSamplePerPromptRollout(HFRollout):
    """Generates once per distinct prompt and repeats the result for each copy of the prompt (a
    prefix cache shared one step too far): ``n`` identical responses."""

    def generate(self, prompts, sampling, seed):
        distinct = list(dict.fromkeys(tuple(prompt) for prompt in prompts))
        output = super().generate([list(prompt) for prompt in distinct], sampling, seed)
        return output[torch.tensor([distinct.index(tuple(prompt)) for prompt in prompts])]


#: Each broken rollout, and the one check that must fail for it (every other check must pass).
BROKEN_ROLLOUTS = {
    "hf-untempered-log-probs": (UntemperedLogProbsRollout, "log_probs"),
    "hf-ignores-temperature": (IgnoresTemperatureRollout, "sampling"),
    "hf-default-top-k": (DefaultTopKRollout, "sampling"),
    "hf-greedy-samples": (GreedySamplesRollout, "greedy"),
    "hf-global-rng": (GlobalRngRollout, "seed"),
    "hf-stale-weights": (StaleWeightsRollout, "weight_sync"),
    "hf-padded-positions": (PaddedPositionsRollout, "prompt_lengths"),
    "hf-eos-outside-mask": (EosOutsideMaskRollout, "batch_contract"),
    "hf-left-padded-responses": (LeftPaddedResponsesRollout, "batch_contract"),
    "hf-one-sample-per-prompt": (OneSamplePerPromptRollout, "n_samples"),
}


@hookimpl
def verl_rollout_backends() -> list[RolloutBackend]:
    return [
        RolloutBackend(name=name, rollout=rollout, config=HFRolloutConfig, devices=("cpu",))
        for name, (rollout, _) in BROKEN_ROLLOUTS.items()
    ]


# -- the built-in rollout passes ---------------------------------------------------------------------


class TestHFRolloutConformance(RolloutConformance):
    """The kit as a plugin author runs it, on core's built-in rollout with its default options."""

    backend = "hf"
    autoload = False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_rollout_model(tmp_path_factory.mktemp("rollout-kit") / "model")


def run_kit(backend: str, model_dir: str, **kwargs) -> ConformanceReport:
    return run_rollout_conformance(
        backend, plugins=[THIS_PLUGIN], autoload=False, model_dir=model_dir, **kwargs
    )


def test_the_hf_rollout_passes_with_its_own_forward_and_in_chunks(model_dir) -> None:
    # The model's own forward pass (HFDecoder) instead of the lean one, and calls split in chunks.
    report = run_kit("hf", model_dir, options={"lean_decoder": False, "max_batch_size": 5})
    assert report.passed, report.summary()
    assert all(outcome.status == "passed" for outcome in report.outcomes.values()), report.summary()


# -- each broken rollout fails its check, and only that one -------------------------------------------


def failing(report: ConformanceReport, check: str) -> list[str]:
    return [comparison.quantity for comparison in report[check].failures]


@pytest.fixture(scope="module")
def broken_reports(model_dir) -> dict[str, ConformanceReport]:
    return {name: run_kit(name, model_dir) for name in BROKEN_ROLLOUTS}


@pytest.mark.parametrize("backend", list(BROKEN_ROLLOUTS))
def test_a_broken_rollout_fails_exactly_its_check(broken_reports, backend) -> None:
    report = broken_reports[backend]
    _, intended = BROKEN_ROLLOUTS[backend]
    assert report.error is None, report.summary()
    statuses = {name: outcome.status for name, outcome in report.outcomes.items()}
    assert statuses == {name: "failed" if name == intended else "passed" for name in ROLLOUT_CHECKS}, (
        report.summary()
    )


def test_untempered_log_probs_fail_at_temperature_0_7_only(broken_reports) -> None:
    report = broken_reports["hf-untempered-log-probs"]
    assert failing(report, "log_probs") == ["T=0.7: rollout_log_probs"], report.summary()
    assert "values differ from the reference" in report["log_probs"].describe()


def test_sampling_at_temperature_one_is_caught_at_temperature_0_7_only(broken_reports) -> None:
    report = broken_reports["hf-ignores-temperature"]
    assert failing(report, "sampling") == ["T=0.7: sampled tokens follow softmax(logits / T)"], (
        report.summary()
    )
    assert "the tokens are less likely than T makes them" in report["sampling"].describe()


def test_a_filter_that_should_be_off_is_caught_as_too_likely_tokens(broken_reports) -> None:
    report = broken_reports["hf-default-top-k"]
    # z is ~+14 at T = 1.0; at T = 0.7 the cut removes less probability (z ~+7 with the kit's seeds).
    assert "T=1.0: sampled tokens follow softmax(logits / T)" in failing(report, "sampling"), report.summary()
    assert "the tokens are more likely than T makes them" in report["sampling"].describe()


def test_greedy_that_samples_picks_tokens_that_are_not_the_argmax(broken_reports) -> None:
    report = broken_reports["hf-greedy-samples"]
    failed = failing(report, "greedy")
    assert failed[0] == "tokens are the reference's argmax", report.summary()
    assert "another seed gives the same responses" in failed, report.summary()
    assert "are not the argmax of the reference's logits" in report["greedy"].describe()


def test_a_rollout_without_its_seed_is_not_reproducible(broken_reports) -> None:
    report = broken_reports["hf-global-rng"]
    assert "same seed: responses" in failing(report, "seed"), report.summary()


def test_stale_weights_are_named_as_the_weights_before_the_sync(broken_reports) -> None:
    report = broken_reports["hf-stale-weights"]
    assert failing(report, "weight_sync") == [
        "after syncing the trained weights: rollout_log_probs",
        "after syncing the trained weights: not the weights before the sync",
    ], report.summary()
    assert "update_weights does not reach the weights it samples with" in report["weight_sync"].describe()


def test_positions_from_the_padded_width_fail_only_the_padded_prompts(broken_reports) -> None:
    report = broken_reports["hf-padded-positions"]
    assert failing(report, "prompt_lengths") == [
        "rollout_log_probs of the 1- to 7-token prompts (left-padded in the same call)"
    ], report.summary()


def test_an_eos_left_out_of_the_mask_is_named(broken_reports) -> None:
    report = broken_reports["hf-eos-outside-mask"]
    assert failing(report, "batch_contract") == [
        "responses right-padded",
        "EOS ends a response, inside its mask",
    ], report.summary()
    assert (
        "an EOS id follows outside the mask: the EOS was dropped from it"
        in report["batch_contract"].describe()
    )


def test_left_padded_responses_are_named(broken_reports) -> None:
    report = broken_reports["hf-left-padded-responses"]
    assert failing(report, "batch_contract") == ["responses right-padded"], report.summary()
    assert "is not 1s then 0s" in report["batch_contract"].describe()


def test_one_sample_copied_to_every_copy_of_a_prompt_is_named(broken_reports) -> None:
    report = broken_reports["hf-one-sample-per-prompt"]
    assert failing(report, "n_samples") == ["each prompt's 4 responses are samples of their own"], (
        report.summary()
    )
    assert "sampled once per distinct prompt and copied?" in report["n_samples"].describe()


# -- the kit refuses bad requests, and reports a rollout that cannot start --------------------------


def test_unknown_check_names_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown rollout conformance check\(s\) \['logprobs'\].*'log_probs'"
    ):
        run_rollout_conformance("hf", checks=["logprobs"], autoload=False)


def test_unknown_backend_is_the_registry_error() -> None:
    with pytest.raises(UnknownNameError, match="hf-stale-weight\\b") as error:
        run_rollout_conformance("hf-stale-weight", plugins=[THIS_PLUGIN], autoload=False)
    assert "hf-stale-weights" in str(error.value)  # the close match is suggested


def test_unknown_option_is_refused_with_its_path() -> None:
    with pytest.raises(ValueError, match=r"rollout\.options\.max_batch\b"):
        run_rollout_conformance("hf", options={"max_batch": 2}, autoload=False)


def test_a_device_the_backend_does_not_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rollout backend 'hf-global-rng' runs on \['cpu'\], not on 'cuda'"):
        run_rollout_conformance("hf-global-rng", plugins=[THIS_PLUGIN], autoload=False, device="cuda")


def test_a_rollout_that_cannot_initialise_fails_every_check(tmp_path) -> None:
    report = run_rollout_conformance("hf", autoload=False, model_dir=tmp_path / "no-model")
    assert not report.passed and "could not be built and initialised" in report.error
    assert {outcome.status for outcome in report.outcomes.values()} == {"error"}
    assert "rollout backend 'hf'" in report.summary()


def test_the_callers_global_rng_is_left_alone(model_dir) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    run_kit("hf", model_dir, checks=["seed"])
    assert torch.equal(torch.rand(3), expected)
