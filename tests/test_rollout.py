"""The built-in ``hf`` rollout: its tokens against ``model.generate``, its log-probs against a
teacher-forced forward pass (what the engine computes), seeding, EOS handling, filters, chunking, and
weight updates that check names and shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from verl_core.config.engine import ModelConfig
from verl_core.data import ROLLOUT_LOG_PROBS
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES
from verl_core.errors import RolloutError
from verl_core.plugins import Registry
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.config import HFRolloutConfig
from verl_core.rollout.hf import HFRollout
from verl_core.rollout.sampling import filter_logits
from verl_core.testing.tiny import save_tiny_models

torch.set_num_threads(1)

EOS = 5
PAD = 0
PROMPTS = [[3, 9, 17], [44], [8, 8, 8, 8, 8, 2], [100, 101]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_models(tmp_path_factory.mktemp("tiny")).lm


@pytest.fixture(scope="module")
def rollout(model_dir) -> HFRollout:
    rollout = HFRollout(ModelConfig(path=model_dir))
    rollout.initialize()
    return rollout


def params(**changes) -> SamplingParams:
    fields = {"max_new_tokens": 8, "eos_token_ids": (EOS,), "pad_token_id": PAD, "temperature": 0.8}
    return SamplingParams(**(fields | changes))


def teacher_forced_log_probs(
    model, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """The engine's view: log_softmax(logits / T) at each response token, the sample run alone."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.double() / scale, dim=-1).gather(-1, torch.tensor(response)[:, None])[
        :, 0
    ]


def unpadded(output, row: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt, response, response log-probs) of one row, padding removed."""
    response_width = output[RESPONSES].shape[-1]
    prompt_part = output[INPUT_IDS][row, :-response_width]
    prompt_mask = output[ATTENTION_MASK][row, :-response_width].bool()
    mask = output[RESPONSE_MASK][row].bool()
    return (
        prompt_part[prompt_mask].tolist(),
        output[RESPONSES][row][mask].tolist(),
        output[ROLLOUT_LOG_PROBS][row][mask],
    )


def test_the_rollout_is_registered_as_a_builtin_backend() -> None:
    entry = Registry.from_plugins().entry("rollout_backends", "hf")
    assert entry.plugin == "verl_core" and entry.status == "ok"
    assert entry.load("rollout") is HFRollout and entry.load("config") is HFRolloutConfig


def test_greedy_tokens_equal_model_generate(rollout, model_dir) -> None:
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    output = rollout.generate(PROMPTS, params(temperature=0.0), seed=0)
    for row, prompt in enumerate(PROMPTS):
        expected = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[0, len(prompt) :].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        got_prompt, got, _ = unpadded(output, row)
        assert got_prompt == prompt and got == expected, (row, got, expected)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
def test_log_probs_are_what_the_engine_computes_for_the_sampled_tokens(
    rollout, model_dir, temperature
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    output = rollout.generate(PROMPTS * 2, params(temperature=temperature, top_k=20, top_p=0.9), seed=3)
    for row, prompt in enumerate(PROMPTS * 2):
        _, response, log_probs = unpadded(output, row)
        expected = teacher_forced_log_probs(reference, prompt, response, temperature)
        torch.testing.assert_close(log_probs.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_prompt_sampled_n_times_is_prefilled_once_with_the_same_samples(rollout) -> None:
    # GRPO's layout, each prompt n times in a row, and a repeat further on.
    prompts = [prompt for prompt in PROMPTS for _ in range(3)] + [PROMPTS[0]]
    prefill_rows = []
    hook = rollout.model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: prefill_rows.append(args[0].shape)
    )
    try:
        output = rollout.generate(prompts, params(temperature=0.0), seed=0)
    finally:
        hook.remove()
    assert prefill_rows[0][0] == len(PROMPTS)  # one prefill row per distinct prompt
    alone = rollout.generate(PROMPTS, params(temperature=0.0), seed=0)
    for row, prompt in enumerate(prompts):
        assert unpadded(output, row)[:2] == unpadded(alone, PROMPTS.index(prompt))[:2], row


def test_batch_layout_is_the_batch_contract(rollout) -> None:
    output = rollout.generate(PROMPTS, params(), seed=1)
    mask = output[ATTENTION_MASK]
    assert torch.equal(output[POSITION_IDS], (mask.cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(output[INPUT_IDS][:, -output[RESPONSES].shape[-1] :], output[RESPONSES])
    assert torch.equal(mask[:, -output[RESPONSES].shape[-1] :], output[RESPONSE_MASK])
    # Responses are right-padded: once a row's mask drops to 0 it stays 0, with pad tokens and 0 log-probs.
    for row in range(len(PROMPTS)):
        response_mask = output[RESPONSE_MASK][row]
        length = int(response_mask.sum())
        assert response_mask[:length].all() and not response_mask[length:].any()
        assert (output[RESPONSES][row, length:] == PAD).all() and (
            output[ROLLOUT_LOG_PROBS][row, length:] == 0
        ).all()
        response = output[RESPONSES][row, :length].tolist()
        assert EOS not in response[:-1]  # generation stops at the first EOS, which it keeps
        assert length == 8 or response[-1] == EOS


def assert_a_training_step_can_save_them_for_backward(output) -> None:
    """The engine embeds the input ids and weighs log-probs (saved for backward): tensors made in
    inference mode cannot be saved."""
    assert not any(tensor.is_inference() for tensor in output.values()), output
    embedding = torch.nn.Embedding(int(output[INPUT_IDS].max()) + 1, 2)
    weighted = (
        embedding(output[INPUT_IDS]).sum(-1)[:, -output[RESPONSES].shape[-1] :] * output[ROLLOUT_LOG_PROBS]
    )
    weighted.sum().backward()
    assert embedding.weight.grad is not None


def test_the_outputs_are_ordinary_tensors_though_decoding_runs_in_inference_mode(rollout) -> None:
    assert_a_training_step_can_save_them_for_backward(rollout.generate(PROMPTS, params(), seed=1))
    with torch.inference_mode():  # a rollout whose outputs leak out of inference mode: caught
        leaked = rollout.generate(PROMPTS, params(), seed=1)
    with pytest.raises(AssertionError):
        assert_a_training_step_can_save_them_for_backward(leaked)


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(rollout) -> None:
    first = rollout.generate(PROMPTS, params(temperature=1.0), seed=11)
    again = rollout.generate(PROMPTS, params(temperature=1.0), seed=11)
    other = rollout.generate(PROMPTS, params(temperature=1.0), seed=12)
    assert torch.equal(first[RESPONSES], again[RESPONSES])
    assert torch.equal(first[ROLLOUT_LOG_PROBS], again[ROLLOUT_LOG_PROBS])
    assert not torch.equal(first[RESPONSES], other[RESPONSES])


def test_chunks_of_max_batch_size_give_one_batch_in_prompt_order(model_dir, rollout) -> None:
    chunked = HFRollout(ModelConfig(path=model_dir), HFRolloutConfig(max_batch_size=3))
    chunked.initialize()
    output = chunked.generate(PROMPTS * 2, params(temperature=0.0), seed=0)
    whole = rollout.generate(PROMPTS * 2, params(temperature=0.0), seed=0)
    assert output.batch_size == whole.batch_size
    for row in range(len(PROMPTS) * 2):
        (p1, r1, l1), (p2, r2, l2) = unpadded(output, row), unpadded(whole, row)
        assert (p1, r1) == (p2, r2)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)


def test_top_k_one_is_greedy(rollout) -> None:
    greedy = rollout.generate(PROMPTS, params(temperature=0.0), seed=0)
    top1 = rollout.generate(PROMPTS, params(temperature=1.0, top_k=1), seed=5)
    assert torch.equal(greedy[RESPONSES], top1[RESPONSES])


@settings(max_examples=50, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=12),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
)
def test_filters_keep_exactly_the_top_k_and_the_nucleus(logits, top_k, top_p) -> None:
    values = torch.tensor([logits], dtype=torch.float64)
    kept = torch.isfinite(filter_logits(values, top_k, top_p))[0].tolist()
    # Written out: rank the tokens; keep the first k; of those, keep until the probability mass of the
    # tokens before one reaches top_p (by the unfiltered-after-top-k distribution).
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    allowed = order[:top_k] if 0 < top_k < len(logits) else order
    # Ties at the k-th value are all kept (masking compares values).
    if 0 < top_k < len(logits):
        kth = logits[order[top_k - 1]]
        allowed = [i for i in order if logits[i] >= kth]
    weights = {i: torch.tensor(logits[i], dtype=torch.float64).exp().item() for i in allowed}
    total = sum(weights.values())
    expected, mass = set(), 0.0
    for i in sorted(allowed, key=lambda i: -logits[i]):
        if mass >= top_p and top_p < 1.0:
            break
        expected.add(i)
        mass += weights[i] / total
    assert {i for i, keep in enumerate(kept) if keep} >= {order[0]}
    if len(set(logits)) == len(logits):  # without ties the cut is unambiguous
        assert {i for i, keep in enumerate(kept) if keep} == expected


def test_weight_updates_replace_the_weights_and_check_names_and_shapes(model_dir) -> None:
    rollout = HFRollout(ModelConfig(path=model_dir))
    rollout.initialize()
    before = rollout.generate(PROMPTS, params(temperature=0.0), seed=0)
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    rollout.update_weights(trained.state_dict().items())
    after = rollout.generate(PROMPTS, params(temperature=0.0), seed=0)
    assert not torch.equal(before[RESPONSES], after[RESPONSES])
    for name, tensor in rollout.model.state_dict().items():
        assert torch.equal(tensor, trained.state_dict()[name]), name

    state = list(trained.state_dict().items())
    with pytest.raises(
        RolloutError, match=r"'module\.model\.embed_tokens\.weight' is not a weight .*did you mean"
    ):
        rollout.update_weights([(f"module.{state[0][0]}", state[0][1])])
    with pytest.raises(RolloutError, match="failed half-way"):
        rollout.generate(PROMPTS, params(), seed=0)  # refused after a failed update
    name, tensor = state[0]
    with pytest.raises(RolloutError, match=r"has shape \[64, 32\] but the rollout's model has \[128, 32\]"):
        rollout.update_weights([(name, tensor[:64])])
    with pytest.raises(RolloutError, match=r"weight\(s\) never arrived"):
        rollout.update_weights(state[:-1])
    rollout.update_weights(state)  # a complete update makes it usable again
    assert torch.equal(
        rollout.generate(PROMPTS, params(temperature=0.0), seed=0)[RESPONSES], after[RESPONSES]
    )


def test_use_before_initialize_and_bad_options_are_refused(model_dir) -> None:
    with pytest.raises(RolloutError, match="not initialised"):
        HFRollout(ModelConfig(path=model_dir)).generate(PROMPTS, params(), seed=0)
    with pytest.raises(
        RolloutError, match=r"expected options of type verl_core\.rollout\.config\.HFRolloutConfig"
    ):
        HFRollout(ModelConfig(path=model_dir), {"max_batch_size": 2})
