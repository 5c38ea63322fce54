"""The batch helpers a rollout builds its output with, against the contract written out row by row."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.data import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    TEACHER_TOP_K_IDS,
    concat_batches,
    responses_batch,
)

PAD = 0
tokens = st.lists(st.integers(1, 50), max_size=6)


@st.composite
def rollout_rows(draw, min_size: int = 1):
    """Prompts (at least one token), responses (maybe empty), their log-probs and model masks."""
    count = draw(st.integers(min_size, 5))
    prompts = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=6)) for _ in range(count)]
    responses = [draw(tokens) for _ in range(count)]
    log_probs = [[draw(st.floats(-9, 0, width=32)) for _ in response] for response in responses]
    masks = [[draw(st.integers(0, 1)) for _ in response] for response in responses]
    return prompts, responses, log_probs, masks


def expected_row(prompt, response, log_probs, mask, prompt_width, response_width):
    """One row of the contract: the prompt left-padded, the response right-padded, positions counting
    real tokens (padding at 0)."""
    left = prompt_width - len(prompt)
    right = response_width - len(response)
    attention = [0] * left + [1] * (len(prompt) + len(response)) + [0] * right
    positions, seen = [], 0
    for real in attention:
        positions.append(max(seen - 1 + real, 0) if real else max(seen - 1, 0))
        seen += real
    return {
        INPUT_IDS: [PAD] * left + prompt + response + [PAD] * right,
        ATTENTION_MASK: attention,
        POSITION_IDS: positions,
        RESPONSES: response + [PAD] * right,
        RESPONSE_MASK: mask + [0] * right,
        ROLLOUT_LOG_PROBS: log_probs + [0.0] * right,
    }


@settings(max_examples=60, deadline=None)
@given(rollout_rows(), st.booleans())
def test_responses_batch_is_the_contract_row_by_row(rows, multi_turn: bool) -> None:
    prompts, responses, log_probs, masks = rows
    batch = responses_batch(prompts, responses, log_probs, PAD, model_masks=masks if multi_turn else None)
    prompt_width = max(len(prompt) for prompt in prompts)
    response_width = max(1, *(len(response) for response in responses))
    for row in range(len(prompts)):
        mask = masks[row] if multi_turn else [1] * len(responses[row])
        expected = expected_row(
            prompts[row], responses[row], log_probs[row], mask, prompt_width, response_width
        )
        for key, values in expected.items():
            assert batch[key][row].tolist() == values, key
    assert batch[ROLLOUT_LOG_PROBS].dtype == torch.float32
    assert all(batch[key].dtype == torch.int64 for key in (INPUT_IDS, ATTENTION_MASK, RESPONSE_MASK))


@settings(max_examples=40, deadline=None)
@given(rollout_rows(), rollout_rows())
def test_concatenated_batches_equal_one_batch_of_every_row(first, second) -> None:
    """Batches of different widths (replicas' shares) joined equal the batch of all their rows."""
    joined = concat_batches(
        [responses_batch(*first[:3], PAD), responses_batch(*second[:3], PAD)], pad_token_id=PAD
    )
    whole = responses_batch(*(a + b for a, b in zip(first[:3], second[:3], strict=True)), PAD)
    assert set(joined.keys()) == set(whole.keys())
    for key in whole.keys():
        assert torch.equal(joined[key], whole[key]), key


@settings(max_examples=40, deadline=None)
@given(rollout_rows(), rollout_rows(), st.integers(1, 4))
def test_per_token_tensors_of_more_dimensions_pad_their_response_dimension(first, second, k) -> None:
    """``[B, R, k]`` tensors (a teacher's top-k) survive joining batches of different response widths:
    each row's values in place, zeros after its response."""
    parts = [responses_batch(*rows[:3], PAD) for rows in (first, second)]
    for part in parts:
        width = part[RESPONSES].shape[-1]
        part[TEACHER_TOP_K_IDS] = torch.arange(len(part) * width * k).view(len(part), width, k) + 1
    joined = concat_batches(parts, pad_token_id=PAD)
    width = joined[RESPONSES].shape[-1]
    assert joined[TEACHER_TOP_K_IDS].shape == (len(joined), width, k)
    rows = [row for part in parts for row in part[TEACHER_TOP_K_IDS]]
    for row, expected in zip(joined[TEACHER_TOP_K_IDS], rows, strict=True):
        assert torch.equal(row[: expected.shape[0]], expected)
        assert (row[expected.shape[0] :] == 0).all()
