"""Padding-free micro-batches: the packed forward gives the padded forward's outputs and gradients on
variable-length sequences, and attention never crosses from one packed sequence into another."""

from __future__ import annotations

import pytest
import torch

from verl_core.config.engine import ModelConfig
from verl_core.engine import COMPUTE_ENTROPY, TEMPERATURE
from verl_core.engine.hf import forward_micro_batch, load_hf_model, pack_sequences
from verl_core.testing import collate, make_samples, response_token_mask, save_tiny_models

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


def batch_of(seed: int):
    batch = collate(make_samples(seed))
    batch.set_non_tensor(TEMPERATURE, 0.7)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


@pytest.mark.parametrize("role", ["lm", "value"])
def test_packed_outputs_and_gradients_equal_the_padded_ones(dirs, role) -> None:
    batch = batch_of(3)
    mask = response_token_mask(batch)
    results = {}
    for packing in (False, True):
        model = load_hf_model(ModelConfig(path=dirs.for_role(role)), role)
        outputs = forward_micro_batch(model, batch, role, packing=packing)
        loss = sum((value * mask).sum() for value in outputs.values())
        loss.backward()
        results[packing] = (outputs, {name: p.grad.clone() for name, p in model.named_parameters()})
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    assert set(packed) == set(padded)
    for name in padded:
        torch.testing.assert_close(packed[name] * mask, padded[name] * mask, atol=1e-5, rtol=1e-5, msg=name)
        assert (packed[name][~mask] == 0).all()  # padding gives 0, not garbage
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_packed_sequences_do_not_attend_to_each_other(dirs) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), "lm").eval()
    batch = batch_of(4)
    changed = batch.clone()
    # Another first sequence: with attention crossing sequences, the later ones' outputs would move.
    first_real = changed["attention_mask"][0].bool()
    changed["input_ids"][0, first_real] = (changed["input_ids"][0, first_real] % 100) + 1
    with torch.no_grad():
        before = forward_micro_batch(model, batch, "lm", packing=True)["log_probs"]
        after = forward_micro_batch(model, changed, "lm", packing=True)["log_probs"]
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=0)
    assert not torch.allclose(after[0], before[0])


def test_pack_sequences_finds_every_response_token() -> None:
    # Row 0: 2 prompt + 3 response tokens; row 1: 1 prompt + 1 response (left/right padding).
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    packed = pack_sequences(attention_mask, response_length=3)
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # Response token t of row i is predicted at its start + prompt length + t - 1.
    assert packed.predicting.tolist()[0] == [1, 2, 3] and packed.predicting.tolist()[1][0] == 5
    assert packed.response_present.tolist() == [[1, 1, 1], [1, 0, 0]]
