"""Rollout correction (``verl_core.algos.rollout_correction``): the mismatch metrics and every
correction against references written out token by token in plain Python, hypothesis for the edge
cases (rows without tokens, one token, ratios far beyond the clamp, weights exactly at their bounds),
verl 0.9's and TRL's formulas where they overlap, and a deliberately broken variant of each
correction that fails its property. Then the config's keys, the deprecated ``rollout_is_cap``, and
where the old log-probs come from."""

from __future__ import annotations

import math
import re
import warnings

import attrs
import pytest
import torch
from hypothesis import Phase, assume, example, given, settings
from hypothesis import strategies as st

from verl_core import RolloutBackend, RolloutCapabilities, hookimpl
from verl_core.algos import catalog
from verl_core.algos.registry import get_policy_loss
from verl_core.algos.rollout_correction import (
    MAX_LOG_RATIO,
    compute_rollout_correction,
    rollout_importance_weights,
    rollout_mismatch_metrics,
    rollout_rejection_mask,
)
from verl_core.config import load_config, structure
from verl_core.config.algorithm import (
    ROLLOUT_IS_CAP_DEPRECATION,
    ROLLOUT_RS_OPTIONS,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from verl_core.config.run import OldLogProbsSource
from verl_core.data.batch import GlobalCounts
from verl_core.deprecation import DEPRECATIONS
from verl_core.errors import ConfigError, ConfigWarning
from verl_core.plugins import Registry
from verl_core.rollout.catalog import ROLLOUT_BACKENDS

F64 = torch.float64
SETTINGS = settings(max_examples=60, deadline=None, database=None)
#: For a broken variant, which must fail: the first failure is enough (no shrinking it).
UNSHRUNK = settings(SETTINGS, phases=[Phase.explicit, Phase.generate])


def clamp(log_ratio: float) -> float:
    return max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, log_ratio))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@st.composite
def batches(draw: st.DrawFn, low: float = -30.0, every_row: bool = False, max_length: int = 6):
    """Engine and rollout log-probs of a padded batch and its mask (rows of no token, of one, ...);
    masked positions hold anything. ``low`` -30 makes log-ratios beyond the clamp of 20."""
    rows, length = draw(st.integers(1, 4)), draw(st.integers(1, max_length))
    log_probs = st.lists(
        st.lists(st.floats(low, 0), min_size=length, max_size=length), min_size=rows, max_size=rows
    )
    bits = st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length)
    if every_row:  # verl and TRL average over every row: give each a token
        bits = bits.filter(any)
    mask = draw(st.lists(bits, min_size=rows, max_size=rows))
    return draw(log_probs), draw(log_probs), mask


def tensors(old, rollout, mask) -> dict[str, torch.Tensor]:
    return {
        "old_log_prob": torch.tensor(old, dtype=F64),
        "rollout_log_probs": torch.tensor(rollout, dtype=F64),
        "response_mask": torch.tensor(mask),
    }


def token_positions(mask) -> list[list[int]]:
    return [[t for t, bit in enumerate(row) if bit] for row in mask]


def correction(**options) -> PolicyLossConfig:
    return PolicyLossConfig(rollout_correction=RolloutCorrectionConfig(**options))


def spec(lower: float | None, upper: float) -> float | str:
    """``rollout_is_threshold`` / ``rollout_rs_threshold`` for the bounds (verl's notation)."""
    return upper if lower is None else f"{lower!r}_{upper!r}"


# -- the mismatch metrics --------------------------------------------------------------------------


def ess(weights: list[float]) -> float:
    return sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))


def reference_mismatch(old, rollout, mask) -> dict[str, float]:
    """Every ``rollout_corr/`` mismatch metric, written out over the set tokens."""
    rows = [(i, ts) for i, ts in enumerate(token_positions(mask)) if ts]
    if not rows:
        ones = ("training_ppl", "rollout_ppl", "ppl_ratio", "ess_token", "ess_seq")
        names = ones + ("kl", "k3_kl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff")
        names += ("log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "chi2_token", "chi2_seq")
        return {f"rollout_corr/{name}": 1.0 if name in ones else 0.0 for name in names}
    log_ratios = [old[i][t] - rollout[i][t] for i, ts in rows for t in ts]
    old_means = [mean([old[i][t] for t in ts]) for i, ts in rows]
    rollout_means = [mean([rollout[i][t] for t in ts]) for i, ts in rows]
    diffs = [r - o for o, r in zip(old_means, rollout_means, strict=True)]
    seq_log_ratios = [clamp(sum(old[i][t] - rollout[i][t] for t in ts)) for i, ts in rows]
    metrics = {
        "kl": mean([-x for x in log_ratios]),
        "k3_kl": mean([math.exp(clamp(x)) - 1 - clamp(x) for x in log_ratios]),
        "training_ppl": mean([math.exp(-m) for m in old_means]),
        "training_log_ppl": mean([-m for m in old_means]),
        "rollout_ppl": mean([math.exp(-m) for m in rollout_means]),
        "rollout_log_ppl": mean([-m for m in rollout_means]),
        "log_ppl_diff": mean(diffs),
        "log_ppl_abs_diff": mean([abs(d) for d in diffs]),
        "log_ppl_diff_max": max(diffs),
        "log_ppl_diff_min": min(diffs),
        "ppl_ratio": mean([math.exp(d) for d in diffs]),
        "chi2_token": mean([math.exp(clamp(x)) ** 2 for x in log_ratios]) - 1,
        "chi2_seq": mean([math.exp(s) ** 2 for s in seq_log_ratios]) - 1,
        "ess_token": ess([math.exp(clamp(x)) for x in log_ratios]),
        "ess_seq": ess([math.exp(s) for s in seq_log_ratios]),
    }
    return {f"rollout_corr/{name}": value for name, value in metrics.items()}


def mismatch_property(metrics_of, low: float = -30.0, broken: bool = False):
    """What ``metrics_of`` (``rollout_mismatch_metrics``' signature) must return: the reference."""

    @(UNSHRUNK if broken else SETTINGS)
    @given(batch=batches(low=low))
    def check(batch) -> None:
        metrics = metrics_of(**tensors(*batch))
        expected = reference_mismatch(*batch)
        assert metrics.keys() == expected.keys()
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name

    return check


test_the_mismatch_metrics_are_their_formulas_over_the_response_tokens = mismatch_property(
    rollout_mismatch_metrics
)
# Log-ratios up to 200 (ratios of e^200, far beyond the clamp): every metric finite, still the formula.
test_far_off_policy_tokens_keep_every_metric_finite = mismatch_property(rollout_mismatch_metrics, low=-200.0)


def test_metrics_averaged_over_the_padding_too_fail_the_formula() -> None:
    # The broken variant: the mask applied after averaging (every padded position counted).
    def over_every_position(**batch):
        return rollout_mismatch_metrics(**batch | {"response_mask": torch.ones_like(batch["response_mask"])})

    with pytest.raises(AssertionError):
        mismatch_property(over_every_position, broken=True)()


def test_one_token_and_no_token() -> None:
    one = rollout_mismatch_metrics(
        old_log_prob=torch.tensor([[-1.0, -9.0]], dtype=F64),
        rollout_log_probs=torch.tensor([[-1.5, 0.0]], dtype=F64),
        response_mask=torch.tensor([[1, 0]]),
    )
    assert one["rollout_corr/kl"] == pytest.approx(-0.5)
    assert one["rollout_corr/k3_kl"] == pytest.approx(math.exp(0.5) - 1.5)
    assert one["rollout_corr/chi2_token"] == pytest.approx(math.exp(1.0) - 1)
    assert one["rollout_corr/ess_token"] == one["rollout_corr/ess_seq"] == 1.0  # one weight: all of it
    empty = rollout_mismatch_metrics(
        old_log_prob=torch.zeros(2, 3),
        rollout_log_probs=torch.full((2, 3), -5.0),
        response_mask=torch.zeros(2, 3),
    )
    assert empty == reference_mismatch([[0] * 3] * 2, [[-5] * 3] * 2, [[0] * 3] * 2)


def test_float32_and_bfloat16_log_probs_give_the_metrics_of_their_values() -> None:
    old = -torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) * 4
    rollout = (old + 0.01 * torch.randn(3, 5, generator=torch.Generator().manual_seed(2))).bfloat16()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    metrics = rollout_mismatch_metrics(old_log_prob=old, rollout_log_probs=rollout, response_mask=mask)
    expected = reference_mismatch(old.tolist(), rollout.double().tolist(), mask.tolist())
    assert metrics == pytest.approx(expected, rel=1e-6, abs=1e-9)


# -- importance weights ----------------------------------------------------------------------------


def reference_weights(old, rollout, mask, level: str, lower: float | None, upper: float) -> list[list[float]]:
    """Per token ``r = exp(l)``, or per sequence ``R = exp(sum l)`` on each of its tokens; truncated at
    ``upper``, or 0 outside ``[lower, upper]``; 0 off the mask."""

    def bounded(ratio: float) -> float:
        if lower is None:
            return min(ratio, upper)
        return ratio if lower <= ratio <= upper else 0.0

    weights = []
    for i, row in enumerate(mask):
        sequence = math.exp(clamp(sum(old[i][t] - rollout[i][t] for t, bit in enumerate(row) if bit)))
        weights.append(
            [
                bounded(math.exp(clamp(old[i][t] - rollout[i][t])) if level == "token" else sequence)
                if bit
                else 0.0
                for t, bit in enumerate(row)
            ]
        )
    return weights


def weights_of(config: PolicyLossConfig, old, rollout, mask) -> torch.Tensor:
    weights, _ = rollout_importance_weights(**tensors(old, rollout, mask), config=config)
    return weights


upper_bounds = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 10.0, 1e3])
lower_bounds = st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])


def weights_property(weigh, level: str, masking: bool, broken: bool = False):
    """``weigh(config, old, rollout, mask)`` must give the reference weights of ``level``: truncated,
    or ``masking``."""

    @(UNSHRUNK if broken else SETTINGS)
    @given(batch=batches(), upper=upper_bounds, lower=lower_bounds)
    def check(batch, upper, lower) -> None:
        lower = min(lower, upper) if masking else None
        config = correction(rollout_is=level, rollout_is_threshold=spec(lower, upper))
        weights = weigh(config, *batch)
        expected = reference_weights(*batch, level, lower, upper)
        assert weights.tolist() == [pytest.approx(row, rel=1e-12) for row in expected]

    return check


# Token-level truncation (TIS), IcePop, sequence-level truncation, TRL's sequence_mask.
CORRECTIONS = {
    "token truncation": ("token", False),
    "token masking (IcePop)": ("token", True),
    "sequence truncation": ("sequence", False),
    "sequence masking": ("sequence", True),
}


@pytest.mark.parametrize("name", CORRECTIONS)
def test_importance_weights_are_their_formula(name) -> None:
    weights_property(weights_of, *CORRECTIONS[name])()


def _untruncated(config, old, rollout, mask):  # the ratio itself, bounds ignored
    return weights_of(correction(rollout_is="token", rollout_is_threshold=1e9), old, rollout, mask)


def _truncating(config, old, rollout, mask):  # IcePop's tokens out of bounds truncated, not dropped
    upper = config.rollout_correction.is_bounds.upper
    return weights_of(correction(rollout_is="token", rollout_is_threshold=upper), old, rollout, mask)


def _per_token(config, old, rollout, mask):  # a sequence's weight computed per token
    threshold = config.rollout_correction.rollout_is_threshold
    return weights_of(correction(rollout_is="token", rollout_is_threshold=threshold), old, rollout, mask)


BROKEN = {
    "token truncation": _untruncated,
    "token masking (IcePop)": _truncating,
    "sequence truncation": _per_token,
    "sequence masking": _per_token,
}


@pytest.mark.parametrize("name", CORRECTIONS)
def test_a_broken_variant_of_each_correction_fails_its_formula(name) -> None:
    with pytest.raises(AssertionError):
        weights_property(BROKEN[name], *CORRECTIONS[name], broken=True)()


@SETTINGS
@given(log_ratio=st.floats(-25, 25), level=st.sampled_from(["token", "sequence"]))
def test_a_weight_exactly_at_its_bound_is_kept(log_ratio, level) -> None:
    old = torch.tensor([[log_ratio - 3.0]], dtype=F64)
    rollout = torch.tensor([[-3.0]], dtype=F64)
    ratio = float((old - rollout).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp())
    batch = {"old_log_prob": old, "rollout_log_probs": rollout, "response_mask": torch.ones(1, 1)}
    for threshold in (ratio, f"{ratio!r}_{ratio!r}", f"0_{ratio!r}", f"{ratio!r}_{max(ratio, 1e3)!r}"):
        weights, metrics = rollout_importance_weights(
            **batch, config=correction(rollout_is=level, rollout_is_threshold=threshold)
        )
        assert weights.item() == ratio, threshold
        assert metrics["actor/rollout_is_clipfrac"] == 0.0


def test_every_policy_loss_applies_sequence_weights_and_drops_masked_sequences() -> None:
    # Each row's log-ratios add up to log(w) (padding holds 9s that would dominate if they leaked), so
    # every sequence weighs w: a loss with the weights is w times the loss without.
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    old = -3 * torch.rand(4, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    log_prob = (
        old + 0.1 * torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    ).requires_grad_()
    advantages = torch.tensor([[1.0] * 4, [-0.8] * 4, [0.5] * 4, [-1.3] * 4], dtype=F64)
    counts = GlobalCounts(int(mask.sum()), 4, 1, 4)
    registry = Registry.from_plugins(autoload=False)
    for weight, threshold, factor in ((1.5, "0.5_2.0", 1.5), (3.0, "0.5_2.0", 0.0), (3.0, 2.0, 2.0)):
        share = torch.where(mask.bool(), math.log(weight) / mask.sum(-1, keepdim=True).clamp(min=1), 9.0)
        config = correction(rollout_is="sequence", rollout_is_threshold=threshold)
        for loss in catalog.POLICY_LOSSES:
            loss_fn = get_policy_loss(loss.name, registry)
            batch = {
                "old_log_prob": old,
                "log_prob": log_prob,
                "advantages": advantages,
                "response_mask": mask,
            }
            torch.manual_seed(0)  # Clip-Cov draws the same tokens in both calls
            plain, _ = loss_fn(**batch, config=PolicyLossConfig(), counts=counts)
            torch.manual_seed(0)
            weighted, metrics = loss_fn(**batch, config=config, counts=counts, rollout_log_probs=old - share)
            torch.testing.assert_close(weighted, factor * plain, msg=f"{loss.name}, weight {weight}")
            assert metrics["actor/rollout_is_weight_mean"] == pytest.approx(factor)


def test_weights_without_the_rollouts_log_probs_name_the_key() -> None:
    batch = tensors([[-1.0]], [[-1.0]], [[1]])
    del batch["rollout_log_probs"]
    with pytest.raises(
        ValueError, match=r"rollout_correction\.rollout_is=sequence .*'rollout_log_probs'.*null"
    ):
        rollout_importance_weights(**batch, rollout_log_probs=None, config=correction(rollout_is="sequence"))
    with pytest.raises(ValueError, match=r"rollout_correction\.rollout_rs=seq_mean_k1 .*'rollout_log_probs'"):
        compute_rollout_correction(
            **batch,
            rollout_log_probs=None,
            config=correction(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.01),
        )


# -- rejection -------------------------------------------------------------------------------------


def reference_keep(old, rollout, mask, option: str, lower: float | None, upper: float) -> list[list[int]]:
    """The mask left by criterion ``option``: a token's statistic, or its sequence's sum, mean or max,
    within the bounds (a ``k1`` one, the log of a ratio, within ``[log lower, log upper]``)."""
    level, _, divergence = option.rpartition("_")

    def statistic(x: float) -> float:
        x = clamp(x)
        return {"k1": x, "k2": x * x / 2, "k3": math.exp(x) - 1 - x}[divergence]

    def kept(value: float) -> bool:
        if divergence == "k1":
            return (lower == 0 or value >= math.log(lower)) and value <= math.log(upper)
        return value <= upper

    result = []
    for i, row in enumerate(mask):
        values = [statistic(old[i][t] - rollout[i][t]) for t, bit in enumerate(row) if bit]
        if level == "token":
            keeps = iter([kept(v) for v in values])
            result.append([int(next(keeps)) if bit else 0 for bit in row])
            continue
        if not values:
            result.append(list(row))
            continue
        aggregate = {"seq_sum": sum, "seq_mean": mean, "seq_max": max}[level](values)
        result.append([bit if kept(aggregate) else 0 for bit in row])
    return result


def rejection_property(reject, option: str, broken: bool = False):
    """``reject(config, old, rollout, mask)`` must leave the reference mask of ``option``."""
    ratio = option.endswith("k1")

    @(UNSHRUNK if broken else SETTINGS)
    # Batches where the criteria of the broken variants part, always tried (a random search of 60 once
    # missed them): three tokens each off by 0.2 (geometric mean 1.22 within [1/1.5, 1.5], product 1.82
    # beyond it), and a sequence with one token far off (its k3 beyond 0.1, the other's 0).
    @example(batch=([[-1.0, -1.0, -1.0]], [[-1.2, -1.2, -1.2]], [[1, 1, 1]]), upper=1.5, lower=None)
    @example(batch=([[-1.0, -1.0]], [[-1.0, -3.0]], [[1, 1]]), upper=0.1, lower=None)
    @given(
        batch=batches(low=-3.0),
        upper=st.sampled_from([1.0, 1.001, 1.1, 1.5, 3.0])
        if ratio
        else st.sampled_from([1e-3, 0.01, 0.1, 1.0]),
        lower=st.sampled_from([None, 0.0, 0.5, 0.9, 1.0]) if ratio else st.none(),
    )
    def check(batch, upper, lower) -> None:
        bounds = (1 / upper if ratio and lower is None else lower), upper  # one number: [1/upper, upper]
        assume(bounds[0] is None or bounds[0] <= upper)
        config = correction(rollout_rs=option, rollout_rs_threshold=spec(lower, upper))
        assert reject(config, *batch).tolist() == reference_keep(*batch, option, *bounds)

    return check


def rejected_mask(config, old, rollout, mask) -> torch.Tensor:
    kept, _ = rollout_rejection_mask(**tensors(old, rollout, mask), config=config)
    return kept


@pytest.mark.parametrize("option", ROLLOUT_RS_OPTIONS)
def test_each_rejection_criterion_is_its_formula(option) -> None:
    rejection_property(rejected_mask, option)()


# Broken variants: another criterion, with the same bounds, in place of the right one.
@pytest.mark.parametrize(
    ("option", "instead"),
    [
        # Geometric rejection bounding the product of the ratios, not their geometric mean: it rejects
        # long sequences for a per-token drift a short one is kept with (the length trap).
        ("seq_mean_k1", "seq_sum_k1"),
        # A sequence's rejection applied to its offending tokens only.
        ("seq_max_k3", "token_k3"),
    ],
)
def test_a_broken_rejection_fails_its_formula(option, instead) -> None:
    def broken(config, old, rollout, mask):
        threshold = config.rollout_correction.rollout_rs_threshold
        return rejected_mask(
            correction(rollout_rs=instead, rollout_rs_threshold=threshold), old, rollout, mask
        )

    with pytest.raises(AssertionError):
        rejection_property(broken, option, broken=True)()


def test_a_statistic_exactly_at_its_bound_is_kept() -> None:
    old, rollout, mask = [[-1.0, -2.0, -3.0]], [[-1.25, -2.0, -2.5]], [[1, 1, 1]]
    kept, metrics = rollout_rejection_mask(
        **tensors(old, rollout, mask),
        config=correction(rollout_rs="seq_mean_k1", rollout_rs_threshold="1.0_1.0"),
    )
    # Log-ratios 0.25, 0, -0.5: geometric mean exp(-0.25/3) below 1, rejected; the same at 1 is kept.
    assert kept.tolist() == [[0, 0, 0]] and metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    kept, _ = rollout_rejection_mask(
        **tensors(old, [[-1.25, -2.0, -2.75]], mask),
        config=correction(rollout_rs="seq_mean_k1", rollout_rs_threshold="1.0_1.0"),
    )
    assert kept.tolist() == [[1, 1, 1]]
    k3 = math.exp(0.25) - 1 - 0.25
    for threshold, expected in ((k3, [[1, 1, 1]]), (math.nextafter(k3, 0), [[0, 1, 1]])):
        kept, _ = rollout_rejection_mask(
            **tensors(old, [[-1.25, -2.0, -3.0]], mask),
            config=correction(rollout_rs="token_k3", rollout_rs_threshold=threshold),
        )
        assert kept.tolist() == expected


def test_several_criteria_each_must_keep_a_token() -> None:
    old, rollout = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[-0.3, 0.0, 0.0], [-0.05, -0.05, -0.05]]
    mask = [[1, 1, 1], [1, 1, 1]]
    config = correction(rollout_rs="token_k1, seq_mean_k1", rollout_rs_threshold="0.5_1.2,1.04")
    kept, metrics = rollout_rejection_mask(**tensors(old, rollout, mask), config=config)
    # Row 0: token 0's ratio exp(0.3) = 1.35 > 1.2, its geometric mean exp(0.1) = 1.105 > 1.04.
    # Row 1: every ratio exp(0.05) = 1.051: kept per token, its geometric mean 1.051 > 1.04.
    assert kept.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 6)
    assert metrics["rollout_corr/rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert metrics["rollout_corr/rollout_rs_seq_mean_k1_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0


# -- the whole correction of a batch ---------------------------------------------------------------


def test_the_batchs_correction_rejects_then_weighs_the_kept_tokens_and_counts_both() -> None:
    old = [[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4]
    # Per-token log-ratios: row 0 drifts too far on average (rejected), row 1 has one token above the
    # cap (truncated), row 2 is one token, row 3 has no token.
    rollout = [[-0.5, -0.5, -0.5, -0.5], [-1.0, 0.0, 0.1, 0.0], [-0.1, 9, 9, 9], [9, 9, 9, 9]]
    mask = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    config = correction(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold=1.3
    )
    result = compute_rollout_correction(**tensors(old, rollout, mask), config=config)
    assert result.response_mask.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    expected = [[0.0] * 4, [2.0, 1.0, math.exp(-0.1), 1.0], [math.exp(0.1), 0, 0, 0], [0.0] * 4]
    assert result.weights.tolist() == [pytest.approx(row) for row in expected]
    metrics = result.metrics
    assert metrics["rollout_corr/token_masked_fraction"] == pytest.approx(4 / 9)
    assert metrics["rollout_corr/seq_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/token_truncated_fraction"] == pytest.approx(1 / 9)
    assert metrics["rollout_corr/seq_truncated_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(
        mean([w for row in expected[1:3] for w in row if w])
    )
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    # The mismatch metrics are the whole batch's, rejected rows included.
    assert metrics["rollout_corr/kl"] == pytest.approx(
        reference_mismatch(old, rollout, mask)["rollout_corr/kl"]
    )
    # Without a correction: the metrics only, the mask as it was.
    plain = compute_rollout_correction(**tensors(old, rollout, mask), config=PolicyLossConfig())
    assert plain.weights is None and plain.response_mask.tolist() == mask
    assert plain.metrics == pytest.approx(reference_mismatch(old, rollout, mask))


def test_masking_counts_the_zero_weights_as_tokens_out_of_the_loss() -> None:
    old, rollout, mask = [[0.0, 0.0, 0.0]], [[-0.1, -2.0, 0.0]], [[1, 1, 1]]
    result = compute_rollout_correction(
        **tensors(old, rollout, mask), config=correction(rollout_is="token", rollout_is_threshold="0.5_5.0")
    )
    assert result.response_mask.tolist() == mask  # masking weighs 0, it does not reject
    assert result.weights[0].tolist() == pytest.approx([math.exp(0.1), 0.0, 1.0])
    assert result.metrics["rollout_corr/token_masked_fraction"] == pytest.approx(1 / 3)
    assert result.metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 3)
    assert result.metrics["rollout_corr/seq_masked_fraction"] == 1.0
    assert result.metrics["rollout_corr/token_truncated_fraction"] == 0.0


# -- verl 0.9 and TRL, where they overlap -----------------------------------------------------------
#
# verl: verl/trainer/ppo/rollout_corr_helper.py, functions compute_offpolicy_metrics,
# compute_rollout_correction_weights, compute_is_metrics and compute_rollout_rejection_mask, read at
# verl-project/verl tag v0.9.0 (unchanged on release/v0.9.0 and on main up to 2026-08-22); its
# masked_mean divides by count + 1e-8 (verl/utils/torch_functional.py). verl is not a dependency, and
# that module imports verl.protocol (Ray, its DataProto), so its formulas are written out here as
# reference. verl averages sequence statistics over every row, clamps k3_kl's log-ratio nowhere and
# bounds -log r with its k1 criteria: the overlap is rows with tokens, log-ratios within the clamp, and
# k1 bounds [1/u, u] (asymmetric ones differ: the test after these).


def verl_mean(values, mask, dim=None):
    mask = mask.to(values.dtype)
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def verl_offpolicy_metrics(old, rollout, mask) -> dict[str, float]:
    log_ratio = old - rollout
    old_seq, rollout_seq = verl_mean(old, mask, -1), verl_mean(rollout, mask, -1)
    diff = rollout_seq - old_seq
    safe = log_ratio.clamp(-20, 20)
    seq_sum = (torch.where(mask.bool(), log_ratio, 0.0)).sum(-1).clamp(-20, 20)
    return {
        "kl": verl_mean(rollout - old, mask),
        "k3_kl": verl_mean(log_ratio.exp() - log_ratio - 1, mask),
        "training_ppl": (-old_seq).exp().mean(),
        "training_log_ppl": (-old_seq).mean(),
        "rollout_ppl": (-rollout_seq).exp().mean(),
        "rollout_log_ppl": (-rollout_seq).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": diff.exp().mean(),
        "chi2_token": verl_mean(safe.exp().square(), mask) - 1,
        "chi2_seq": (2 * seq_sum).exp().mean() - 1,
    }


def verl_weights(log_ratio, mask, level: str, lower: float | None, upper: float):
    """The weights and verl's rollout_is_* metrics of them."""
    maskf = mask.to(log_ratio.dtype)
    if level == "token":
        log_for_metrics = log_ratio
        raw = log_ratio.clamp(-20, 20).exp()
    else:
        log_for_metrics = (torch.where(mask.bool(), log_ratio, 0.0)).sum(-1, keepdim=True)
        raw = log_for_metrics.clamp(-20, 20).exp().expand_as(log_ratio)
    raw = raw * maskf
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    low = 1 / upper if lower is None else lower
    if level == "token":
        high_fraction, low_fraction = (
            verl_mean((raw > upper).double(), mask),
            verl_mean((raw < low).double(), mask),
        )
    else:
        high_fraction = (log_for_metrics > math.log(upper)).double().mean()
        low_fraction = (log_for_metrics < math.log(low)).double().mean()
    clamped = weights.clamp(0, upper)
    normalised = clamped / (verl_mean(clamped, mask) + 1e-8)
    metrics = {
        "rollout_is_mean": verl_mean(weights, mask),
        "rollout_is_ratio_fraction_high": high_fraction,
        "rollout_is_ratio_fraction_low": low_fraction,
        "rollout_is_eff_sample_size": 1 / verl_mean(normalised.square(), mask),
    }
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = verl_mean(((raw < lower) | (raw > upper)).double(), mask)
    return weights, metrics


def verl_rejection(log_ratio, mask, option: str, lower: float | None, upper: float):
    """The mask verl's criterion leaves, and its masked fractions."""
    level, _, divergence = option.rpartition("_")
    safe = log_ratio.clamp(-20, 20)
    statistic = {"k1": -safe, "k2": 0.5 * safe**2, "k3": safe.exp() - 1 - safe}[divergence]
    if level == "seq_sum":
        statistic = (torch.where(mask.bool(), statistic, 0.0)).sum(-1, keepdim=True)
    elif level == "seq_mean":
        statistic = verl_mean(statistic, mask, -1).unsqueeze(-1)
    elif level == "seq_max":
        largest = statistic.masked_fill(~mask.bool(), -math.inf).max(-1).values
        statistic = torch.where(largest == -math.inf, 0.0, largest).unsqueeze(-1)
    if divergence == "k1":
        keep = (statistic >= math.log(lower)) & (statistic <= math.log(upper))
    else:
        keep = statistic <= upper
    keep = keep.expand_as(mask).to(log_ratio.dtype)
    final = mask * keep
    seq_masked = ((keep < 0.5) & mask.bool()).any(-1).double().mean()
    return final, {
        "rollout_rs_masked_fraction": verl_mean(1 - keep, mask),
        "rollout_rs_seq_masked_fraction": seq_masked,
    }


def floats(metrics) -> dict[str, float]:
    return {f"rollout_corr/{name}": float(value) for name, value in metrics.items()}


@SETTINGS
@given(batch=batches(low=-4.0, every_row=True))
def test_the_mismatch_metrics_match_verls(batch) -> None:
    ours = rollout_mismatch_metrics(**tensors(*batch))
    theirs = floats(verl_offpolicy_metrics(*tensors(*batch).values()))
    # verl's means divide by count + 1e-8: chi2 of equal log-probs is -1e-8 there.
    assert {name: ours[name] for name in theirs} == pytest.approx(theirs, rel=1e-6, abs=1e-7)


@SETTINGS
@given(
    batch=batches(low=-3.0, every_row=True),
    level=st.sampled_from(["token", "sequence"]),
    upper=upper_bounds,
    lower=st.none() | st.sampled_from([0.1, 0.5, 0.9]),
)
def test_the_weights_and_their_metrics_match_verls(batch, level, upper, lower) -> None:
    assume(lower is None or lower <= upper)
    config = correction(rollout_is=level, rollout_is_threshold=spec(lower, upper))
    result = compute_rollout_correction(**tensors(*batch), config=config)
    old, rollout, mask = tensors(*batch).values()
    weights, metrics = verl_weights(old - rollout, mask, level, lower, upper)
    assert result.weights.tolist() == [pytest.approx(row, rel=1e-12) for row in weights.tolist()]
    # verl's ESS divides by mean + 1e-8 (and is 1/0 when every weight is 0, which it does not guard).
    assume(float(verl_mean(weights, mask)) > 1e-2)
    assert {name: result.metrics[name] for name in floats(metrics)} == pytest.approx(
        floats(metrics), rel=1e-5
    )


@SETTINGS
@given(
    batch=batches(low=-3.0, every_row=True),
    option=st.sampled_from(ROLLOUT_RS_OPTIONS),
    upper_k1=st.sampled_from([1.25, 2.0, 4.0]),  # powers of 2 over 1.25 and 1/u exact: [1/u, u] = verl's
    upper=st.sampled_from([1e-3, 0.01, 0.1, 1.0]),
)
def test_rejection_matches_verls_with_reciprocal_ratio_bounds(batch, option, upper_k1, upper) -> None:
    ratio = option.endswith("k1")
    upper = upper_k1 if ratio else upper
    config = correction(rollout_rs=option, rollout_rs_threshold=upper)
    kept, metrics = rollout_rejection_mask(**tensors(*batch), config=config)
    old, rollout, mask = tensors(*batch).values()
    theirs, their_metrics = verl_rejection(old - rollout, mask, option, 1 / upper if ratio else None, upper)
    assert kept.tolist() == theirs.long().tolist()
    ours = {name: metrics[name] for name in floats(their_metrics)}
    assert ours == pytest.approx(floats(their_metrics), rel=1e-6, abs=1e-9)


def test_asymmetric_ratio_bounds_bound_the_ratio_where_verl_bounds_its_inverse() -> None:
    # A sequence whose tokens all have ratio 3: within "0.5_4.0" as a ratio (kept here), while verl's
    # seq_mean_k1 bounds -log r, i.e. 1/3, which is below 0.5 (rejected there). Symmetric bounds agree.
    old, rollout, mask = tensors([[0.0, 0.0]], [[-math.log(3)] * 2], [[1, 1]]).values()
    kept, _ = rollout_rejection_mask(
        old_log_prob=old,
        rollout_log_probs=rollout,
        response_mask=mask,
        config=correction(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_4.0"),
    )
    theirs, _ = verl_rejection(old - rollout, mask, "seq_mean_k1", 0.5, 4.0)
    assert kept.tolist() == [[1, 1]] and theirs.tolist() == [[0, 0]]


# TRL: trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions (huggingface/trl, main of
# 2026-07-24): vllm_importance_sampling_mode, default "sequence_mask" with clip_max 3.0 and no clip_min.
# TRL does not clamp the log-ratio: the overlap is sums within the clamp.


def trl_ratio(old, rollout, mask, mode: str, clip_min: float | None, clip_max: float | None):
    diff = (old - rollout) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@SETTINGS
@given(
    batch=batches(low=-3.0),
    mode=st.sampled_from(["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
    clip_max=st.sampled_from([0.8, 2.0, 3.0]),
    clip_min=st.none() | st.sampled_from([0.2, 0.5]),
)
def test_trls_importance_sampling_modes_are_these_corrections(batch, mode, clip_max, clip_min) -> None:
    level, _, kind = mode.partition("_")
    if kind == "truncate":
        clip_min = None  # TRL's truncation from below has no counterpart here (nor in verl)
    threshold = clip_max if kind == "truncate" else f"{clip_min or 0.0}_{clip_max}"
    config = correction(rollout_is=level, rollout_is_threshold=threshold)
    weights, _ = rollout_importance_weights(**tensors(*batch), config=config)
    old, rollout, mask = tensors(*batch).values()
    theirs = trl_ratio(old, rollout, mask, mode, clip_min, clip_max).expand_as(old)
    on_mask = mask.bool()
    torch.testing.assert_close(weights[on_mask], theirs[on_mask])


# -- the config ------------------------------------------------------------------------------------


def errors_of(data: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        structure(data, PolicyLossConfig, "actor.policy_loss")
    return caught.value.errors


def test_thresholds_take_a_number_or_verls_low_high_string() -> None:
    config = structure(
        {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}}, PolicyLossConfig
    )
    assert config.correction.is_bounds.lower == 0.5 and config.correction.is_bounds.upper == 5.0
    config = structure(
        {
            "rollout_correction": {
                "rollout_rs": "seq_mean_k1, seq_max_k3",
                "rollout_rs_threshold": "1.25,0.01",
            }
        },
        PolicyLossConfig,
    )
    assert [(name, b.lower, b.upper) for name, b in config.correction.rs_bounds.items()] == [
        ("seq_mean_k1", 0.8, 1.25),
        ("seq_max_k3", None, 0.01),
    ]


@pytest.mark.parametrize(
    ("options", "key", "message"),
    [
        ({"rollout_is": "tokens"}, "rollout_is", "did you mean 'token'"),
        ({"rollout_is_threshold": "half"}, "rollout_is_threshold", "'low_high' string"),
        ({"rollout_is_threshold": "5_0.5"}, "rollout_is_threshold", r"lower bound must be in \[0, upper\]"),
        ({"rollout_is_threshold": -1.0}, "rollout_is_threshold", "upper bound must be a finite number > 0"),
        ({"rollout_is_threshold": True}, "rollout_is_threshold", "expected float or str"),
        ({"rollout_rs": "seq_mean_k2,geo"}, "rollout_rs", "unknown rejection criterion 'geo'"),
        ({"rollout_rs": "seq_mean_k1"}, "rollout_rs_threshold", "required with rollout_rs"),
        (
            {"rollout_rs": "token_k1", "rollout_rs_threshold": "1,2,3"},
            "rollout_rs_threshold",
            "3 bounds for 1",
        ),
        (
            {"rollout_rs": "token_k3", "rollout_rs_threshold": "0.1_1"},
            "rollout_rs_threshold",
            "upper bound only",
        ),
        (
            {"rollout_is": "token", "bypass_mode": True},
            "bypass_mode",
            "cannot be combined with rollout_is or rollout_rs",
        ),
    ],
)
def test_a_bad_correction_is_refused_at_its_key(options, key, message) -> None:
    errors = errors_of({"rollout_correction": options})
    assert [path for path, _ in errors] == [f"actor.policy_loss.rollout_correction.{key}"], errors
    assert any(re.search(message, text) for _, text in errors), errors


def test_rollout_is_cap_is_token_truncation_deprecated() -> None:
    config = structure({"rollout_is_cap": 2.5}, PolicyLossConfig)
    assert config.correction == RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.5)
    assert (
        ROLLOUT_IS_CAP_DEPRECATION.what in DEPRECATIONS and ROLLOUT_IS_CAP_DEPRECATION.removed_in == "0.4.0"
    )
    # The same weights as the section it now stands for.
    old, rollout, mask = [[0.0, 0.0]], [[-2.0, -0.1]], [[1, 1]]
    assert torch.equal(
        weights_of(config, old, rollout, mask),
        weights_of(correction(rollout_is="token", rollout_is_threshold=2.5), old, rollout, mask),
    )
    errors = errors_of({"rollout_is_cap": 2.0, "rollout_correction": {"rollout_is": "sequence"}})
    assert [path for path, _ in errors] == ["actor.policy_loss.rollout_is_cap"]
    assert "rollout_correction sets rollout_is: remove rollout_is_cap" in errors[0][1]


def test_loading_rollout_is_cap_warns_that_it_is_deprecated(demo, tmp_path) -> None:
    from fixtures.demo import run_overrides

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config([], run_overrides(demo, tmp_path, **{"actor.policy_loss.rollout_is_cap": 2.0}))
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any(
        m.startswith("actor.policy_loss.rollout_is_cap: deprecated since verl-core 0.2.0, removed in 0.4.0")
        and "rollout_is: token, rollout_is_threshold: 2.0" in m
        for m in messages
    ), messages


@pytest.mark.parametrize(
    ("changes", "source"),
    [
        ({}, OldLogProbsSource.ROLLOUT),
        ({"actor.policy_loss.rollout_correction.rollout_is": "token"}, OldLogProbsSource.ENGINE),
        (
            {
                "actor.policy_loss.rollout_correction.rollout_rs": "seq_mean_k1",
                "actor.policy_loss.rollout_correction.rollout_rs_threshold": 1.01,
            },
            OldLogProbsSource.ENGINE,
        ),
        ({"actor.policy_loss.rollout_is_cap": 2.0}, OldLogProbsSource.ENGINE),
        # Bypass: the rollout's, even with several mini-batches, epochs, and another dtype.
        (
            {
                "actor.policy_loss.rollout_correction.bypass_mode": "true",
                "actor.ppo_mini_batch_size": 2,
                "actor.ppo_epochs": 2,
                "rollout.dtype": "bfloat16",
            },
            OldLogProbsSource.ROLLOUT,
        ),
        ({"actor.ppo_mini_batch_size": 2}, OldLogProbsSource.ENGINE),
    ],
)
def test_where_the_old_log_probs_come_from(demo, tmp_path, changes, source) -> None:
    from fixtures.demo import run_overrides

    config = load_config([], run_overrides(demo, tmp_path, **changes))
    num_mini_batches = config.data.train_batch_size // config.actor.ppo_mini_batch_size
    assert config.old_log_probs_source(num_mini_batches) is source


def test_bypass_and_a_forced_recompute_contradict_each_other(demo, tmp_path) -> None:
    from fixtures.demo import run_overrides

    changes = {
        "actor.policy_loss.rollout_correction.bypass_mode": "true",
        "trainer.recompute_old_log_probs": "true",
    }
    with pytest.raises(ConfigError, match=r"trainer\.recompute_old_log_probs: contradicts .*bypass_mode"):
        load_config([], run_overrides(demo, tmp_path, **changes))


class InferenceEnginePlugin:
    """Backends whose log-probs are not the training engine's: the contract's distribution within a
    looser bound (an inference engine's kernels), and the filtered distribution (vLLM's
    ``processed_logprobs``), beside one that declares the built-in decoder's bound."""

    @hookimpl
    def verl_rollout_backends(self):
        (hf,) = ROLLOUT_BACKENDS

        def backend(name: str, **capabilities) -> RolloutBackend:
            return attrs.evolve(hf, name=name, capabilities=RolloutCapabilities(**capabilities))

        return [
            backend("served", log_prob_tolerance=1e-4),
            backend("filtered", log_prob_semantics="filtered"),
            backend("exact", log_prob_tolerance=1e-5),
        ]


@pytest.mark.parametrize(
    ("backend", "changes", "source"),
    [
        ("exact", {}, OldLogProbsSource.ROLLOUT),
        ("served", {}, OldLogProbsSource.UPDATE),
        ("filtered", {}, OldLogProbsSource.UPDATE),
        # A KL penalty in the reward reads the old log-probs before the update.
        ("served", {"algorithm.use_kl_in_reward": "true"}, OldLogProbsSource.ENGINE),
        ("exact", {"algorithm.use_kl_in_reward": "true"}, OldLogProbsSource.ROLLOUT),
        ("served", {"actor.policy_loss.rollout_correction.bypass_mode": "true"}, OldLogProbsSource.ROLLOUT),
    ],
)
def test_an_inference_engine_rollout_is_not_taken_for_the_engine(demo, tmp_path, backend, changes, source):
    """A rollout in the engine's dtype is still not the engine when its backend declares a looser
    log-prob bound or other semantics: on-policy, the update's own forward pass gives the old log-probs."""
    from fixtures.demo import run_overrides

    registry = Registry.from_plugins([InferenceEnginePlugin()], autoload=True)
    overrides = [*run_overrides(demo, tmp_path, **changes), f"rollout.backend={backend}"]
    config = load_config([], overrides, registry=registry)
    num_mini_batches = config.data.train_batch_size // config.actor.ppo_mini_batch_size
    assert config.old_log_probs_source(num_mini_batches, registry) is source


def test_a_rollout_backend_the_registry_does_not_know_cannot_vouch_for_its_log_probs(demo, tmp_path):
    from fixtures.demo import run_overrides

    registry = Registry.from_plugins([InferenceEnginePlugin()], autoload=True)
    config = load_config([], [*run_overrides(demo, tmp_path), "rollout.backend=exact"], registry=registry)
    num_mini_batches = config.data.train_batch_size // config.actor.ppo_mini_batch_size
    assert config.old_log_probs_source(num_mini_batches, registry) is OldLogProbsSource.ROLLOUT
    without = Registry.from_plugins([], autoload=False)
    assert config.old_log_probs_source(num_mini_batches, without) is OldLogProbsSource.UPDATE
