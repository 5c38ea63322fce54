"""Advantage estimators against straightforward references: Python loops over samples and tokens."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos import advantage, catalog
from verl_core.algos.registry import get_advantage_estimator
from verl_core.config.algorithm import AlgorithmConfig
from verl_core.plugins import Registry

# -- references (plain Python over lists; no code shared with the vectorised estimators) ----------

EPS_STD = 1e-6
EPS_WHITEN = 1e-8


def valid_positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m]


def scores_of(rewards: list[list[float]]) -> list[float]:
    return [sum(row) for row in rewards]


def groups_of(index: list) -> dict:
    members = defaultdict(list)
    for i, label in enumerate(index):
        members[label].append(i)
    return members


def spread(per_sample: list[float], mask: list[list[float]]) -> list[list[float]]:
    return [[per_sample[i] if m else 0.0 for m in row] for i, row in enumerate(mask)]


def whiten(matrix: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    picked = [matrix[i][t] for i, row in enumerate(mask) for t in valid_positions(row)]
    if not picked:
        return [[0.0] * len(row) for row in mask]
    mean = sum(picked) / len(picked)
    var = sum((x - mean) ** 2 for x in picked) / (len(picked) - 1) if len(picked) > 1 else 0.0
    scale = 1.0 / math.sqrt(var + EPS_WHITEN)
    return [
        [(matrix[i][t] - mean) * scale if m else 0.0 for t, m in enumerate(row)] for i, row in enumerate(mask)
    ]


def ref_gae(rewards, values, mask, gamma, lam):
    advantages = [[0.0] * len(row) for row in mask]
    returns = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(valid_positions(row)):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[i][t] = next_advantage
            returns[i][t] = next_advantage + values[i][t]
            next_value = values[i][t]
    return whiten(advantages, mask), returns


def ref_grpo(rewards, mask, index, norm_by_std):
    scores = scores_of(rewards)
    out = [0.0] * len(scores)
    for members in groups_of(index).values():
        group_scores = [scores[i] for i in members]
        mean = statistics.fmean(group_scores) if len(members) > 1 else 0.0
        std = statistics.stdev(group_scores) if len(members) > 1 else 1.0
        for i in members:
            out[i] = (scores[i] - mean) / (std + EPS_STD) if norm_by_std else scores[i] - mean
    return spread(out, mask)


def ref_grpo_passk(rewards, mask, index, norm_by_std):
    scores = scores_of(rewards)
    out = [0.0] * len(scores)
    for members in groups_of(index).values():
        ranked = sorted(members, key=lambda i: scores[i], reverse=True)
        margin = scores[ranked[0]] - scores[ranked[1]]
        if norm_by_std:
            margin /= statistics.stdev([scores[i] for i in members]) + EPS_STD
        out[ranked[0]] = margin
    return spread(out, mask)


def ref_rloo(rewards, mask, index):
    scores = scores_of(rewards)
    out = list(scores)
    for members in groups_of(index).values():
        if len(members) > 1:
            for i in members:
                others = [scores[j] for j in members if j != i]
                out[i] = scores[i] - sum(others) / len(others)
    return spread(out, mask)


def ref_opo(rewards, mask, index):
    scores = scores_of(rewards)
    lengths = [sum(row) for row in mask]
    out = list(scores)
    for members in groups_of(index).values():
        total_length = sum(lengths[i] for i in members)
        if len(members) > 1 and total_length > 0:
            baseline = sum(lengths[i] * scores[i] for i in members) / total_length
            for i in members:
                out[i] = scores[i] - baseline
    return spread(out, mask)


def ref_group_mean(scores, index):
    means = [0.0] * len(scores)
    for members in groups_of(index).values():
        if len(members) > 1:
            for i in members:
                means[i] = statistics.fmean(scores[j] for j in members)
    return means


def ref_gpg(rewards, mask, index):
    scores = scores_of(rewards)
    means = ref_group_mean(scores, index)
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    return spread([alpha * (s - m) for s, m in zip(scores, means, strict=True)], mask)


def ref_reinforce_plus_plus(rewards, mask, gamma):
    returns = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        running = 0.0
        for t in reversed(valid_positions(row)):
            running = rewards[i][t] + gamma * running
            returns[i][t] = running
    return whiten(returns, mask), returns


def ref_reinforce_plus_plus_baseline(rewards, mask, index):
    scores = scores_of(rewards)
    means = ref_group_mean(scores, index)
    return whiten(spread([s - m for s, m in zip(scores, means, strict=True)], mask), mask)


def ref_remax(rewards, mask, baselines):
    advantages = [[0.0] * len(row) for row in mask]
    returns = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        for t in valid_positions(row):
            returns[i][t] = sum(rewards[i][u] for u in range(t, len(row)) if row[u])
            advantages[i][t] = returns[i][t] - baselines[i]
    return advantages, returns


# -- helpers ------------------------------------------------------------------------------------


def as_tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, as_tensor(expected), atol=atol, rtol=1e-7)


def run(fn, rewards, mask, **kwargs):
    return fn(token_level_rewards=as_tensor(rewards), response_mask=as_tensor(mask), **kwargs)


# A hand-made batch: groups of 3 ("p0"), 1 ("p1", singleton) and 2 ("p2"); row 2 is an empty
# response whose reward (-1, placed on the padding) still counts; row 4 has an observation span.
REWARDS = [
    [0.0, 0.0, 1.0, 0.0],
    [0.0, 0.5, 0.0, 0.0],
    [0.0, 0.0, 0.0, -1.0],
    [0.0, 0.0, 2.0, 0.0],
    [0.2, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.0, 0.0],
]
MASK = [
    [1, 1, 1, 0],
    [1, 1, 0, 0],
    [0, 0, 0, 0],
    [1, 1, 1, 1],
    [1, 0, 0, 1],
    [1, 1, 1, 0],
]
INDEX = ["p0", "p0", "p0", "p1", "p2", "p2"]
VALUES = [
    [0.1, 0.2, 0.3, 9.0],
    [0.4, -0.1, 7.0, 7.0],
    [5.0, 5.0, 5.0, 5.0],
    [0.0, 0.5, 1.0, 1.5],
    [0.3, 8.0, 8.0, 0.2],
    [-0.2, 0.1, 0.6, 4.0],
]


# -- hand-made cases ----------------------------------------------------------------------------


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_reference(gamma, lam):
    config = AlgorithmConfig(gamma=gamma, lam=lam)
    advantages, returns = run(
        advantage.compute_gae_advantage_return, REWARDS, MASK, values=as_tensor(VALUES), config=config
    )
    expected_advantages, expected_returns = ref_gae(REWARDS, VALUES, MASK, gamma, lam)
    assert_close(advantages, expected_advantages)
    assert_close(returns, expected_returns)


def test_gae_carries_returns_through_observation_spans():
    # gamma = lam = 1 and zero values: every response token's return is the sum of later rewards,
    # including those after the observation span (positions 1-2); observation tokens get 0.
    _, returns = run(
        advantage.compute_gae_advantage_return,
        [[0.5, 3.0, 3.0, 1.0, 0.0]],
        [[1, 0, 0, 1, 1]],
        values=torch.zeros(1, 5, dtype=torch.float64),
        config=AlgorithmConfig(gamma=1.0, lam=1.0),
    )
    assert returns.tolist() == [[1.5, 0.0, 0.0, 1.0, 0.0]]


def test_gae_ignores_values_and_rewards_at_masked_positions():
    mask = as_tensor(MASK).bool()
    poisoned_values = torch.where(mask, as_tensor(VALUES), float("nan"))
    poisoned_rewards = torch.where(mask, as_tensor(REWARDS), float("inf"))
    config = AlgorithmConfig(gamma=0.9, lam=0.8)
    clean = run(
        advantage.compute_gae_advantage_return, REWARDS, MASK, values=as_tensor(VALUES), config=config
    )
    poisoned = advantage.compute_gae_advantage_return(
        token_level_rewards=poisoned_rewards, response_mask=mask, values=poisoned_values, config=config
    )
    for a, b in zip(clean, poisoned, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std):
    config = AlgorithmConfig(norm_adv_by_std_in_grpo=norm_by_std)
    advantages, returns = run(
        advantage.compute_grpo_outcome_advantage, REWARDS, MASK, index=INDEX, config=config
    )
    expected = ref_grpo(REWARDS, MASK, INDEX, norm_by_std)
    assert_close(advantages, expected)
    assert_close(returns, expected)
    # The singleton group "p1" keeps its raw score (mean 0, std 1), as in verl.
    assert advantages[3, 0].item() == pytest.approx(2.0 / (1 + EPS_STD) if norm_by_std else 2.0)


def test_grpo_group_with_equal_scores_gets_zero_advantage():
    advantages, _ = run(
        advantage.compute_grpo_outcome_advantage,
        [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
        [[1, 1], [1, 1], [1, 0]],
        index=[7, 7, 7],
        config=AlgorithmConfig(),
    )
    assert advantages.abs().max().item() == 0.0


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_reference(norm_by_std):
    index = ["p0", "p0", "p0", "p2", "p2", "p2"]
    config = AlgorithmConfig(norm_adv_by_std_in_grpo=norm_by_std)
    advantages, returns = run(
        advantage.compute_grpo_passk_outcome_advantage, REWARDS, MASK, index=index, config=config
    )
    expected = ref_grpo_passk(REWARDS, MASK, index, norm_by_std)
    assert_close(advantages, expected)
    assert_close(returns, expected)
    assert advantages[0, 0].item() > 0 and advantages[1].abs().sum().item() == 0  # only the best sample


def test_rloo_matches_reference():
    advantages, returns = run(
        advantage.compute_rloo_outcome_advantage, REWARDS, MASK, index=INDEX, config=AlgorithmConfig()
    )
    assert_close(advantages, ref_rloo(REWARDS, MASK, INDEX))
    assert_close(returns, advantages.tolist())


def test_opo_matches_reference():
    advantages, returns = run(
        advantage.compute_opo_outcome_advantage, REWARDS, MASK, index=INDEX, config=AlgorithmConfig()
    )
    assert_close(advantages, ref_opo(REWARDS, MASK, INDEX))
    assert_close(returns, advantages.tolist())


def test_opo_group_of_empty_responses_has_zero_baseline():
    advantages, _ = run(
        advantage.compute_opo_outcome_advantage,
        [[1.0, 0.0], [0.0, 0.0]],
        [[0, 0], [0, 0]],
        index=["a", "a"],
        config=AlgorithmConfig(),
    )
    assert not advantages.isnan().any() and advantages.abs().sum().item() == 0.0


def test_gpg_matches_reference():
    advantages, returns = run(
        advantage.compute_gpg_outcome_advantage, REWARDS, MASK, index=INDEX, config=AlgorithmConfig()
    )
    assert_close(advantages, ref_gpg(REWARDS, MASK, INDEX))
    assert_close(returns, advantages.tolist())


def test_gpg_rescales_by_batch_size_over_rewarded_samples():
    # One rewarded sample out of four: alpha = 4; group "a" has mean 0.5, group "b" mean 0.
    advantages, _ = run(
        advantage.compute_gpg_outcome_advantage,
        [[1.0], [0.0], [0.0], [0.0]],
        [[1], [1], [1], [1]],
        index=["a", "a", "b", "b"],
        config=AlgorithmConfig(),
    )
    assert advantages.flatten().tolist() == [2.0, -2.0, 0.0, 0.0]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(gamma):
    advantages, returns = run(
        advantage.compute_reinforce_plus_plus_outcome_advantage,
        REWARDS,
        MASK,
        config=AlgorithmConfig(gamma=gamma),
    )
    expected_advantages, expected_returns = ref_reinforce_plus_plus(REWARDS, MASK, gamma)
    assert_close(advantages, expected_advantages)
    assert_close(returns, expected_returns)


def test_reinforce_plus_plus_baseline_matches_reference():
    advantages, returns = run(
        advantage.compute_reinforce_plus_plus_baseline_outcome_advantage,
        REWARDS,
        MASK,
        index=INDEX,
        config=AlgorithmConfig(),
    )
    assert_close(advantages, ref_reinforce_plus_plus_baseline(REWARDS, MASK, INDEX))
    assert_close(returns, advantages.tolist())


def test_remax_matches_reference():
    baselines = [0.5, 0.0, -1.0, 1.0, 0.3, 0.1]
    advantages, returns = run(
        advantage.compute_remax_outcome_advantage,
        REWARDS,
        MASK,
        reward_baselines=as_tensor(baselines),
        config=AlgorithmConfig(),
    )
    expected_advantages, expected_returns = ref_remax(REWARDS, MASK, baselines)
    assert_close(advantages, expected_advantages)
    assert_close(returns, expected_returns)


def test_all_masked_batch_gives_zeros_without_nan():
    rewards, mask = [[1.0, 2.0], [0.0, 3.0]], [[0, 0], [0, 0]]
    config = AlgorithmConfig()
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        advantages, returns = run(
            descriptor.load(),
            rewards,
            mask,
            index=["a", "a"],
            values=torch.ones(2, 2, dtype=torch.float64),
            reward_baselines=torch.ones(2, dtype=torch.float64),
            config=config,
        )
        assert advantages.abs().sum().item() == 0.0 and returns.abs().sum().item() == 0.0, descriptor.name


def test_float32_inputs_match_float64():
    config = AlgorithmConfig(gamma=0.9, lam=0.9)
    kwargs = dict(index=INDEX, values=as_tensor(VALUES), reward_baselines=torch.ones(6, dtype=torch.float64))
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        if descriptor.name == "grpo_passk":
            continue  # needs groups of at least two
        fn = descriptor.load()
        exact, _ = run(fn, REWARDS, MASK, config=config, **kwargs)
        kwargs32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        single, _ = fn(
            token_level_rewards=as_tensor(REWARDS).float(),
            response_mask=torch.tensor(MASK),
            config=config,
            **kwargs32,
        )
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), exact, atol=1e-5, rtol=1e-5)


def test_group_ids_as_strings_ints_numpy_and_tensor_agree():
    config = AlgorithmConfig()
    labels = [["a", "a", "a", "b", "c", "c"], [3, 3, 3, -1, 10, 10], np.array(INDEX, dtype=object)]
    tensors = [torch.tensor([3, 3, 3, -1, 10, 10]), torch.tensor([2, 2, 2, 0, 1, 1], dtype=torch.int32)]
    expected, _ = run(advantage.compute_grpo_outcome_advantage, REWARDS, MASK, index=INDEX, config=config)
    for index in labels + tensors:
        got, _ = run(advantage.compute_grpo_outcome_advantage, REWARDS, MASK, index=index, config=config)
        torch.testing.assert_close(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_estimators_on_cuda_match_cpu():
    index = torch.tensor([0, 0, 0, 2, 2, 2])
    config = AlgorithmConfig(gamma=0.9, lam=0.9)
    inputs = dict(
        token_level_rewards=as_tensor(REWARDS),
        response_mask=torch.tensor(MASK),
        values=as_tensor(VALUES),
        reward_baselines=torch.ones(6, dtype=torch.float64),
    )
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        fn = descriptor.load()
        on_cpu = fn(index=index, config=config, **inputs)
        on_cuda = fn(index=index.cuda(), config=config, **{k: v.cuda() for k, v in inputs.items()})
        for expected, actual in zip(on_cpu, on_cuda, strict=True):
            assert actual.device.type == "cuda", descriptor.name
            torch.testing.assert_close(actual.cpu(), expected, msg=descriptor.name)


# -- errors -------------------------------------------------------------------------------------


def test_group_estimator_without_index_names_uid_and_fix():
    with pytest.raises(ValueError, match=r"index=.*'uid'.*rollout\.n"):
        run(advantage.compute_grpo_outcome_advantage, REWARDS, MASK, config=AlgorithmConfig())


def test_index_of_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"index has 2 group ids but the batch has 6 samples"):
        run(
            advantage.compute_rloo_outcome_advantage,
            REWARDS,
            MASK,
            index=["a", "b"],
            config=AlgorithmConfig(),
        )


def test_float_index_tensor_is_refused():
    with pytest.raises(ValueError, match=r"index: expected a 1-d integer tensor"):
        run(
            advantage.compute_rloo_outcome_advantage,
            REWARDS,
            MASK,
            index=torch.zeros(6),
            config=AlgorithmConfig(),
        )


def test_gae_without_values_names_the_key():
    with pytest.raises(ValueError, match=r"'gae' needs the critic's values: pass values= .*'values'"):
        run(advantage.compute_gae_advantage_return, REWARDS, MASK, config=AlgorithmConfig())


def test_remax_without_baselines_names_the_key():
    with pytest.raises(ValueError, match=r"'remax' needs reward_baselines="):
        run(advantage.compute_remax_outcome_advantage, REWARDS, MASK, config=AlgorithmConfig())


def test_grpo_passk_refuses_singleton_groups_with_the_fix():
    with pytest.raises(ValueError, match=r"'grpo_passk' needs at least 2 samples per group.*rollout\.n >= 2"):
        run(
            advantage.compute_grpo_passk_outcome_advantage,
            REWARDS,
            MASK,
            index=INDEX,
            config=AlgorithmConfig(),
        )


# -- catalog ------------------------------------------------------------------------------------


def test_catalog_registers_verls_names_with_the_uniform_signature():
    names = [d.name for d in catalog.ADVANTAGE_ESTIMATORS]
    assert names == [
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
        "grpo_passk",
    ]
    index = ["p0", "p0", "p0", "p2", "p2", "p2"]
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        assert descriptor.description
        # Every input, plus one no estimator knows: each takes what it needs and ignores the rest.
        advantages, returns = run(
            descriptor.load(),
            REWARDS,
            MASK,
            index=index,
            values=as_tensor(VALUES),
            reward_baselines=torch.zeros(6, dtype=torch.float64),
            some_future_input=object(),
            config=AlgorithmConfig(),
        )
        assert advantages.shape == returns.shape == (6, 4)
        assert (advantages[as_tensor(MASK) == 0] == 0).all(), descriptor.name


def test_builtins_are_found_by_name_through_the_plugin_registry():
    registry = Registry.from_plugins(autoload=False)
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        assert get_advantage_estimator(descriptor.name, registry) is descriptor.load()


# -- properties ---------------------------------------------------------------------------------


@st.composite
def batches(draw, min_group_size: int = 1):
    """A batch of groups with random sizes, rewards (on every position) and masks with gaps."""
    sizes = draw(st.lists(st.integers(min_group_size, 4), min_size=1, max_size=4))
    length = draw(st.integers(1, 5))
    index = [g for g, size in enumerate(sizes) for _ in range(size)]
    order = draw(st.permutations(range(len(index))))  # groups interleaved, not contiguous
    index = [index[i] for i in order]
    reward = st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 3))
    rewards = [draw(st.lists(reward, min_size=length, max_size=length)) for _ in index]
    mask = [draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length)) for _ in index]
    values = [draw(st.lists(reward, min_size=length, max_size=length)) for _ in index]
    return rewards, mask, index, values


@settings(max_examples=60, deadline=None)
@given(batches(), st.booleans())
def test_grpo_is_zero_mean_per_group_with_unit_std_when_normalised(batch, norm_by_std):
    rewards, mask, index, _ = batch
    full_mask = [[1] * len(row) for row in rewards]  # one value per sample: read it at position 0
    advantages, _ = run(
        advantage.compute_grpo_outcome_advantage,
        rewards,
        full_mask,
        index=index,
        config=AlgorithmConfig(norm_adv_by_std_in_grpo=norm_by_std),
    )
    per_sample = advantages[:, 0].tolist()
    scores = scores_of(rewards)
    for members in groups_of(index).values():
        if len(members) < 2:
            continue
        group = [per_sample[i] for i in members]
        assert abs(statistics.fmean(group)) < 1e-9
        score_std = statistics.stdev(scores[i] for i in members)
        if norm_by_std and score_std > 1e-3:
            assert statistics.stdev(group) == pytest.approx(1.0, abs=1e-3)
        if not norm_by_std:
            assert statistics.stdev(group) == pytest.approx(score_std, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(batches(min_group_size=2))
def test_rloo_is_reward_minus_leave_one_out_mean(batch):
    rewards, mask, index, _ = batch
    advantages, _ = run(
        advantage.compute_rloo_outcome_advantage, rewards, mask, index=index, config=AlgorithmConfig()
    )
    scores = scores_of(rewards)
    for i, label in enumerate(index):
        others = [scores[j] for j, other in enumerate(index) if other == label and j != i]
        expected = scores[i] - sum(others) / len(others)
        for t, m in enumerate(mask[i]):
            assert advantages[i, t].item() == pytest.approx(expected if m else 0.0, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from([1.0, 0.95]), st.sampled_from([1.0, 0.9]))
def test_every_estimator_matches_its_reference_on_random_batches(batch, gamma, lam):
    rewards, mask, index, values = batch
    config = AlgorithmConfig(gamma=gamma, lam=lam)
    baselines = [round(0.1 * i, 3) for i in range(len(index))]
    tensors = dict(
        values=as_tensor(values), reward_baselines=as_tensor(baselines), index=index, config=config
    )
    expected = {
        "gae": ref_gae(rewards, values, mask, gamma, lam),
        "grpo": (ref_grpo(rewards, mask, index, True),) * 2,
        "rloo": (ref_rloo(rewards, mask, index),) * 2,
        "reinforce_plus_plus": ref_reinforce_plus_plus(rewards, mask, gamma),
        "reinforce_plus_plus_baseline": (ref_reinforce_plus_plus_baseline(rewards, mask, index),) * 2,
        "remax": ref_remax(rewards, mask, baselines),
        "opo": (ref_opo(rewards, mask, index),) * 2,
        "gpg": (ref_gpg(rewards, mask, index),) * 2,
    }
    if min(len(members) for members in groups_of(index).values()) >= 2:
        expected["grpo_passk"] = (ref_grpo_passk(rewards, mask, index, True),) * 2
    for descriptor in catalog.ADVANTAGE_ESTIMATORS:
        if descriptor.name not in expected:
            continue
        got = run(descriptor.load(), rewards, mask, **tensors)
        for actual, reference in zip(got, expected[descriptor.name], strict=True):
            # Whitening and std division amplify rounding on near-constant inputs: compare relatively.
            torch.testing.assert_close(
                actual, as_tensor(reference), atol=1e-6, rtol=1e-6, msg=descriptor.name
            )
