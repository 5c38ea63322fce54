"""Policy losses against references written out with loops over sequences and tokens (their loss and
their gradient), clipping properties with hypothesis, rollout importance weights and the rollout's
log-prob mismatch, the actor's total loss, and the uniform signature every built-in follows."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl_core.algos import PolicyLossFn, catalog, compute_actor_loss, rollout_log_prob_mismatch
from verl_core.algos.registry import get_policy_loss
from verl_core.config.algorithm import PolicyLossConfig
from verl_core.data.batch import GlobalCounts
from verl_core.plugins import Registry

F64 = torch.float64
REGISTRY = Registry.from_plugins(autoload=False)  # core's built-ins only

# A hand-made micro-batch. Rows: full; right-padded; empty (all masked); an observation span inside.
# Masked positions hold values that would dominate any result if they leaked (log-ratio 9).
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]
# Log-ratios that fall inside, above and below the clip range [0.8, 1.2], and above dual-clip's 3.
LOG_RATIO = [[0.0, 0.1, -0.4, 0.5, 1.3], [-0.1, 0.25, -0.3, 9, 9], [9] * 5, [0.05, 9, 1.2, -0.25, 9]]
TOKEN_ADV = [[1.0, -0.5, 1.2, -1.5, -2.0], [0.7, -0.3, 0.4, 5, 5], [3] * 5, [-1.1, 7, 0.8, 0.9, 7]]
SEQ_ADV = [[1.0] * 5, [-0.8] * 5, [0.5] * 5, [-1.3] * 5]


def make_batch(advantages: list[list[float]]) -> dict[str, torch.Tensor]:
    old_log_prob = -3 * torch.rand(4, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    return {
        "old_log_prob": old_log_prob,
        "log_prob": (old_log_prob + torch.tensor(LOG_RATIO, dtype=F64)).requires_grad_(),
        "advantages": torch.tensor(advantages, dtype=F64),
        "response_mask": torch.tensor(MASK),
    }


def counts_of(mask: torch.Tensor, dp_size: int = 1) -> GlobalCounts:
    return GlobalCounts(int(mask.sum()), mask.shape[0], dp_size, mask.shape[1])


def valid_tokens(mask: list[list[int]]) -> list[tuple[int, int]]:
    return [(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m]


def aggregate(token_losses: dict[tuple[int, int], torch.Tensor], mode: str) -> torch.Tensor:
    """Full-batch aggregation written out (the modes the references below use)."""
    num_seqs, num_tokens = len(MASK), len(valid_tokens(MASK))
    total = torch.zeros((), dtype=F64)
    for (i, _), loss in token_losses.items():
        if mode == "token-mean":
            total = total + loss / num_tokens
        elif mode == "seq-mean-token-mean":
            total = total + loss / (num_seqs * sum(MASK[i]))
        else:
            assert mode == "seq-mean-token-sum-norm"
            total = total + loss / (num_seqs * len(MASK[0]))
    return total


# -- references, one token (or sequence) at a time, in the papers' case-by-case form ----------------


def ppo_token_loss(
    log_ratio: torch.Tensor, a: float, low: float, high: float, c: float | None
) -> torch.Tensor:
    ratio = torch.exp(log_ratio)
    if a >= 0:  # clipping removes the incentive to push the ratio above 1 + high
        return -a * torch.clamp(ratio, max=1 + high)
    loss = -a * torch.clamp(ratio, min=1 - low)  # ... or below 1 - low
    return loss if c is None else torch.clamp(loss, max=-a * c)  # dual-clip


def ref_vanilla(lp, olp, adv, cfg):
    low, high = cfg.clip_ratio_low or cfg.clip_ratio, cfg.clip_ratio_high or cfg.clip_ratio
    losses = {
        (i, t): ppo_token_loss(lp[i, t] - olp[i][t], adv[i][t], low, high, cfg.clip_ratio_c)
        for i, t in valid_tokens(MASK)
    }
    return aggregate(losses, cfg.loss_agg_mode)


def ref_gspo(lp, olp, adv, cfg):
    """The paper's sequence objective: s_i = (pi / pi_old)^(1/|y_i|), clipped, averaged over sequences."""
    total = torch.zeros((), dtype=F64)
    for i, row in enumerate(MASK):
        tokens = [t for t, m in enumerate(row) if m]
        if not tokens:
            continue
        s = torch.exp(sum(lp[i, t] - olp[i][t] for t in tokens) / len(tokens))
        a = adv[i][tokens[0]]
        loss = (
            -a * torch.clamp(s, max=1 + cfg.clip_ratio)
            if a >= 0
            else -a * torch.clamp(s, min=1 - cfg.clip_ratio)
        )
        total = total + loss / len(MASK)
    return total


def ref_gpg(lp, olp, adv, cfg):
    return aggregate({(i, t): -adv[i][t] * lp[i, t] for i, t in valid_tokens(MASK)}, cfg.loss_agg_mode)


def covariances(lp, adv) -> dict[tuple[int, int], float]:
    tokens = valid_tokens(MASK)
    mean_adv = sum(adv[i][t] for i, t in tokens) / len(tokens)
    mean_lp = sum(lp[i, t].item() for i, t in tokens) / len(tokens)
    return {(i, t): (adv[i][t] - mean_adv) * (lp[i, t].item() - mean_lp) for i, t in tokens}


def ref_clip_cov(lp, olp, adv, cfg):
    losses, candidates = {}, []
    for (i, t), cov in covariances(lp, adv).items():
        ratio = math.exp(lp[i, t].item() - olp[i][t])
        clipped_by_ppo = (
            -adv[i][t] * min(max(ratio, 1 - cfg.clip_ratio), 1 + cfg.clip_ratio) > -adv[i][t] * ratio
        )
        if not clipped_by_ppo and cfg.clip_cov_lb < cov < cfg.clip_cov_ub:
            candidates.append((i, t))
        losses[i, t] = ppo_token_loss(lp[i, t] - olp[i][t], adv[i][t], cfg.clip_ratio, cfg.clip_ratio, None)
    # The case is built so that every candidate is detached (the draw among candidates is random).
    assert 0 < len(candidates) <= max(int(cfg.clip_cov_ratio * len(losses)), 1)
    for token in candidates:
        losses[token] = torch.zeros((), dtype=F64)
    return aggregate(losses, cfg.loss_agg_mode)


def ref_kl_cov(lp, olp, adv, cfg):
    cov = covariances(lp, adv)
    num_penalised = max(int(cfg.kl_cov_ratio * len(cov)), 1)
    penalised = sorted(cov, key=cov.get, reverse=True)[:num_penalised]
    losses = {}
    for i, t in cov:
        log_ratio = lp[i, t] - olp[i][t]
        losses[i, t] = -adv[i][t] * torch.exp(log_ratio)
        if (i, t) in penalised:
            losses[i, t] = losses[i, t] + cfg.ppo_kl_coef * torch.abs(log_ratio)
    return aggregate(losses, cfg.loss_agg_mode)


def ref_geo_mean(lp, olp, adv, cfg):
    total = torch.zeros((), dtype=F64)
    for i, row in enumerate(MASK):
        tokens = [t for t, m in enumerate(row) if m]
        if not tokens:
            continue
        clipped = []
        for t in tokens:
            log_ratio = lp[i, t] - olp[i][t]
            if adv[i][t] > 0:
                clipped.append(torch.clamp(log_ratio, max=cfg.clip_ratio))
            elif adv[i][t] < 0:
                clipped.append(torch.clamp(log_ratio, min=-cfg.clip_ratio))
            else:
                clipped.append(0 * log_ratio)
        ratio = torch.exp(sum(clipped) / len(tokens))
        a = sum(adv[i][t] for t in tokens) / len(tokens)
        total = total - a * ratio / len(MASK)
    return total


def ref_cispo(lp, olp, adv, cfg):
    losses = {}
    for i, t in valid_tokens(MASK):
        weight = min(max(math.exp(lp[i, t].item() - olp[i][t]), 1 - cfg.clip_ratio), 1 + cfg.clip_ratio)
        losses[i, t] = -adv[i][t] * weight * lp[i, t]  # the weight is a constant: no gradient through it
    return aggregate(losses, cfg.loss_agg_mode)


def ref_dro(lp, olp, adv, cfg):
    losses = {
        (i, t): -(adv[i][t] * lp[i, t] - cfg.dro_beta / 2 * (lp[i, t] - olp[i][t]) ** 2)
        for i, t in valid_tokens(MASK)
    }
    return aggregate(losses, cfg.loss_agg_mode)


def ref_sapo(lp, olp, adv, cfg):
    losses = {}
    for i, t in valid_tokens(MASK):
        tau = cfg.tau_pos if adv[i][t] > 0 else cfg.tau_neg
        gate = 4 / tau * torch.sigmoid(tau * (torch.exp(lp[i, t] - olp[i][t]) - 1))
        losses[i, t] = -adv[i][t] * gate
    return aggregate(losses, "seq-mean-token-mean")  # whatever loss_agg_mode says, as in verl


CASES = [
    ("vanilla", ref_vanilla, TOKEN_ADV, {}),
    (
        "vanilla",
        ref_vanilla,
        TOKEN_ADV,
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.5},
    ),
    ("vanilla", ref_vanilla, SEQ_ADV, {"loss_agg_mode": "seq-mean-token-mean"}),
    ("gspo", ref_gspo, SEQ_ADV, {}),
    ("gpg", ref_gpg, TOKEN_ADV, {"loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("clip_cov", ref_clip_cov, TOKEN_ADV, {"clip_cov_ratio": 0.2}),  # room for 2 of the 1 candidate
    ("kl_cov", ref_kl_cov, TOKEN_ADV, {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.7}),
    ("geo_mean", ref_geo_mean, SEQ_ADV, {}),
    ("geo_mean", ref_geo_mean, TOKEN_ADV, {}),
    ("cispo", ref_cispo, TOKEN_ADV, {}),
    ("dro", ref_dro, TOKEN_ADV, {"dro_beta": 0.5}),
    ("sapo", ref_sapo, TOKEN_ADV, {"tau_pos": 1.0, "tau_neg": 1.5}),
    ("sapo", ref_sapo, TOKEN_ADV, {"tau_pos": 1.0, "tau_neg": 1.5, "loss_agg_mode": "token-sum"}),
]


@pytest.mark.parametrize(("name", "reference", "advantages", "options"), CASES)
def test_loss_and_gradient_match_the_reference(name, reference, advantages, options) -> None:
    config = PolicyLossConfig(loss_mode=name, **options)
    batch = make_batch(advantages)
    loss, metrics = get_policy_loss(name, REGISTRY)(
        **batch, config=config, counts=counts_of(batch["response_mask"])
    )
    (grad,) = torch.autograd.grad(loss, batch["log_prob"])

    log_prob = batch["log_prob"].detach().clone().requires_grad_()
    expected = reference(log_prob, batch["old_log_prob"].tolist(), advantages, config)
    (expected_grad,) = torch.autograd.grad(expected, log_prob, allow_unused=True)

    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert (grad[batch["response_mask"] == 0] == 0).all()
    assert all(isinstance(value, float) and math.isfinite(value) for value in metrics.values())


@pytest.mark.parametrize(
    "agg_mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_sapo_always_averages_over_sequences_whatever_loss_agg_mode_says(agg_mode) -> None:
    """verl's SAPO aggregates ``seq-mean-token-mean`` unconditionally. With one short response that
    the policy should reinforce and one long response it should discourage, a token mean and a
    sequence mean of the same per-token losses differ even in sign."""
    mask = [[1, 0, 0, 0], [1, 1, 1, 1]]
    log_ratio = [[0.1, 9.0, 9.0, 9.0], [0.0, -0.05, 0.2, 0.15]]  # 9: padding that must not leak
    adv = [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5]]
    tau_pos, tau_neg = 1.0, 1.05
    token_losses: list[list[float]] = []
    for i, row in enumerate(mask):
        token_losses.append([])
        for t, valid in enumerate(row):
            if valid:
                tau = tau_pos if adv[i][t] > 0 else tau_neg
                gate = 4 / tau / (1 + math.exp(-tau * (math.exp(log_ratio[i][t]) - 1)))
                token_losses[i].append(-adv[i][t] * gate)
    seq_mean_token_mean = sum(sum(row) / len(row) for row in token_losses) / len(token_losses)
    token_mean = sum(sum(row) for row in token_losses) / sum(len(row) for row in token_losses)
    assert seq_mean_token_mean < 0 < token_mean  # the case tells the two apart

    old_log_prob = torch.full((2, 4), -1.5, dtype=F64)
    response_mask = torch.tensor(mask)
    loss, _ = get_policy_loss("sapo", REGISTRY)(
        old_log_prob=old_log_prob,
        log_prob=old_log_prob + torch.tensor(log_ratio, dtype=F64),
        advantages=torch.tensor(adv, dtype=F64),
        response_mask=response_mask,
        config=PolicyLossConfig(loss_mode="sapo", loss_agg_mode=agg_mode, tau_pos=tau_pos, tau_neg=tau_neg),
        counts=counts_of(response_mask),
    )
    assert loss.item() == pytest.approx(seq_mean_token_mean, rel=1e-12)


def test_vanilla_metrics_are_the_clip_fractions_and_k1_kl_of_the_micro_batch() -> None:
    batch = make_batch(TOKEN_ADV)
    _, metrics = get_policy_loss("vanilla", REGISTRY)(
        **batch, config=PolicyLossConfig(), counts=counts_of(batch["response_mask"])
    )
    tokens = valid_tokens(MASK)
    clipped = lower = kl = 0.0
    for i, t in tokens:
        a, log_ratio = TOKEN_ADV[i][t], LOG_RATIO[i][t]
        ratio = math.exp(log_ratio)
        clipped += (a > 0 and ratio > 1.2) or (a < 0 and ratio < 0.8)
        lower += a < 0 and ratio > 3.0
        kl += -log_ratio
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipped / len(tokens))
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(lower / len(tokens))
    assert metrics["actor/ppo_kl"] == pytest.approx(kl / len(tokens))


def test_clip_cov_detaches_exactly_its_share_of_candidates() -> None:
    # Every token is a candidate (nothing is PPO-clipped, the covariance band is everything).
    torch.manual_seed(0)
    log_prob = torch.randn(8, 16, dtype=F64, requires_grad=True)
    config = PolicyLossConfig(
        loss_mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-1e9, clip_cov_ub=1e9, clip_ratio=1e6
    )
    mask = torch.ones(8, 16, dtype=torch.int64)
    mask[0, 10:] = 0
    loss, metrics = get_policy_loss("clip_cov", REGISTRY)(
        old_log_prob=log_prob.detach(),
        log_prob=log_prob,
        advantages=torch.randn(8, 16, dtype=F64),
        response_mask=mask,
        config=config,
        counts=counts_of(mask),
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    num_tokens = int(mask.sum())  # 122: int(0.1 * 122) = 12 tokens are detached
    assert int(((grad == 0) & (mask == 1)).sum()) == 12
    assert metrics["actor/pg_clipfrac"] == pytest.approx(12 / num_tokens)


def test_cov_losses_select_nothing_when_their_ratio_is_zero() -> None:
    batch = make_batch(TOKEN_ADV)
    counts = counts_of(batch["response_mask"])
    vanilla_no_dual = PolicyLossConfig(clip_ratio_c=1e9)
    expected, _ = get_policy_loss("vanilla", REGISTRY)(**batch, config=vanilla_no_dual, counts=counts)
    loss, _ = get_policy_loss("clip_cov", REGISTRY)(
        **batch, config=PolicyLossConfig(clip_cov_ratio=0), counts=counts
    )
    torch.testing.assert_close(loss, expected)
    surrogate = aggregate(
        {(i, t): -TOKEN_ADV[i][t] * math.exp(LOG_RATIO[i][t]) for i, t in valid_tokens(MASK)}, "token-mean"
    )
    loss, _ = get_policy_loss("kl_cov", REGISTRY)(
        **batch, config=PolicyLossConfig(kl_cov_ratio=0), counts=counts
    )
    torch.testing.assert_close(loss, surrogate)


# -- clipping properties --------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    a=st.floats(-3, 3),
    log_ratio=st.floats(-2.5, 2.5),
    low=st.floats(0, 0.9),
    high=st.floats(0, 2),
    c=st.floats(1.01, 10),
)
def test_ppo_clipping_is_pessimistic_and_only_where_it_should_be(a, log_ratio, low, high, c) -> None:
    ratio = math.exp(log_ratio)
    assume(min(abs(ratio - (1 - low)), abs(ratio - (1 + high)), abs(ratio - c)) > 1e-6)
    config = PolicyLossConfig(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    log_prob = torch.tensor([[log_ratio]], dtype=F64, requires_grad=True)
    loss, _ = get_policy_loss("vanilla", REGISTRY)(
        old_log_prob=torch.zeros(1, 1, dtype=F64),
        log_prob=log_prob,
        advantages=torch.tensor([[a]], dtype=F64),
        response_mask=torch.ones(1, 1),
        config=config,
        counts=GlobalCounts(1, 1, 1, 1),
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    unclipped = -a * ratio
    if a < 0 and ratio > c:  # dual-clip: bounded below the surrogate, no gradient
        assert loss.item() == pytest.approx(-a * c)
        assert grad.item() == 0
    elif (a > 0 and ratio > 1 + high) or (a < 0 and ratio < 1 - low):  # pessimistic clip
        assert loss.item() >= unclipped - 1e-12
        assert grad.item() == 0
    else:  # inside the trust region, or moving the ratio further would lower the objective
        assert loss.item() == pytest.approx(unclipped)
        assert grad.item() == pytest.approx(-a * ratio)


@st.composite
def grpo_batches(draw: st.DrawFn) -> dict:
    num_seqs, response_len = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    cells = num_seqs * response_len
    scale = draw(st.sampled_from([0.05, 0.5, 2.0]))  # mostly inside the trust region, or far outside
    log_ratio = torch.tensor(draw(st.lists(st.floats(-1, 1), min_size=cells, max_size=cells)), dtype=F64)
    mask = torch.tensor(draw(st.lists(st.integers(0, 1), min_size=cells, max_size=cells)))
    seq_adv = torch.tensor(draw(st.lists(st.floats(-2, 2), min_size=num_seqs, max_size=num_seqs)), dtype=F64)
    return {
        "old_log_prob": torch.zeros(num_seqs, response_len, dtype=F64),
        "log_prob": scale * log_ratio.view(num_seqs, response_len),
        "advantages": seq_adv.unsqueeze(-1).expand(num_seqs, response_len),
        "response_mask": mask.view(num_seqs, response_len),
    }


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean"])
@settings(max_examples=60, deadline=None)
@given(batch=grpo_batches(), clip=st.floats(0.01, 0.5))
def test_clipping_never_lowers_the_loss_below_the_unclipped_surrogate(name, batch, clip) -> None:
    """Without dual-clip, clipping is pessimistic: the loss is at least the unclipped surrogate, and
    equal to it when no ratio leaves the trust region."""
    loss_fn, counts = get_policy_loss(name, REGISTRY), counts_of(batch["response_mask"])
    clipped, metrics = loss_fn(
        **batch, config=PolicyLossConfig(clip_ratio=clip, clip_ratio_c=1e9), counts=counts
    )
    unclipped_config = PolicyLossConfig(clip_ratio=1e6, clip_ratio_c=1e9)
    unclipped, _ = loss_fn(**batch, config=unclipped_config, counts=counts)
    assert clipped.item() >= unclipped.item() - 1e-12
    log_ratio, mask = batch["log_prob"], batch["response_mask"].bool()
    if name == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        inside = bool((seq_log_ratio.exp() - 1).abs().max() <= clip) if mask.any() else True
    elif name == "geo_mean":
        inside = bool(log_ratio[mask].abs().max() <= clip) if mask.any() else True
    else:
        inside = bool((log_ratio[mask].exp() - 1).abs().max() <= clip) if mask.any() else True
    if inside:
        torch.testing.assert_close(clipped, unclipped)
        assert metrics["actor/pg_clipfrac"] == 0


# -- split invariance, rollout importance weights -------------------------------------------------

DETERMINISTIC_LOSSES = ["vanilla", "gspo", "gpg", "geo_mean", "cispo", "dro", "sapo"]


@pytest.mark.parametrize("name", DETERMINISTIC_LOSSES)
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_losses_do_not_depend_on_the_split_into_ranks_and_micro_batches(name, agg_mode) -> None:
    batch = make_batch(SEQ_ADV)
    config = PolicyLossConfig(loss_mode=name, loss_agg_mode=agg_mode)
    loss_fn = get_policy_loss(name, REGISTRY)
    full, _ = loss_fn(**batch, config=config, counts=counts_of(batch["response_mask"]))
    (full_grad,) = torch.autograd.grad(full, batch["log_prob"])

    counts = counts_of(batch["response_mask"], dp_size=2)
    ranks = [[[2], [0]], [[3, 1]]]  # rank 0 has two micro-batches, rank 1 one
    total, grad = torch.zeros((), dtype=F64), torch.zeros_like(full_grad)
    for micro_batches in ranks:
        for rows in micro_batches:
            part = {key: value[rows] for key, value in batch.items()}
            loss, _ = loss_fn(**part, config=config, counts=counts)
            (part_grad,) = torch.autograd.grad(loss, batch["log_prob"])
            total, grad = total + loss.detach(), grad + part_grad / 2  # DDP averages over the 2 ranks
    torch.testing.assert_close(total / 2, full.detach())
    torch.testing.assert_close(grad, full_grad)


@pytest.mark.parametrize("name", [loss.name for loss in catalog.POLICY_LOSSES])
@pytest.mark.parametrize(
    ("log_weight", "cap", "factor"), [(math.log(1.5), 2.0, 1.5), (math.log(3.0), 2.0, 2.0)]
)
def test_rollout_importance_weights_scale_every_loss(name, log_weight, cap, factor) -> None:
    batch = make_batch(SEQ_ADV)
    counts = counts_of(batch["response_mask"])
    loss_fn = get_policy_loss(name, REGISTRY)
    torch.manual_seed(0)  # Clip-Cov draws the same tokens in both calls
    plain, _ = loss_fn(**batch, config=PolicyLossConfig(), counts=counts)
    torch.manual_seed(0)
    weighted, metrics = loss_fn(
        **batch,
        config=PolicyLossConfig(rollout_is_cap=cap),
        counts=counts,
        rollout_log_probs=batch["old_log_prob"] - log_weight,
    )
    torch.testing.assert_close(weighted, factor * plain)
    assert metrics["actor/rollout_is_weight_mean"] == pytest.approx(factor)
    assert metrics["actor/rollout_is_clipfrac"] == (1.0 if factor == cap else 0.0)


def test_rollout_importance_weights_are_truncated_per_token() -> None:
    batch = make_batch(TOKEN_ADV)
    rollout_log_probs = batch["old_log_prob"] + torch.linspace(-1.5, 1.5, 20, dtype=F64).view(4, 5)
    config = PolicyLossConfig(rollout_is_cap=2.0)
    loss, _ = get_policy_loss("vanilla", REGISTRY)(
        **batch, config=config, counts=counts_of(batch["response_mask"]), rollout_log_probs=rollout_log_probs
    )
    log_prob, old = batch["log_prob"].detach(), batch["old_log_prob"]
    losses = {}
    for i, t in valid_tokens(MASK):
        weight = min(math.exp(old[i, t].item() - rollout_log_probs[i, t].item()), 2.0)
        losses[i, t] = weight * ppo_token_loss(log_prob[i, t] - old[i, t], TOKEN_ADV[i][t], 0.2, 0.2, 3.0)
    torch.testing.assert_close(loss, aggregate(losses, "token-mean"))


def test_rollout_importance_weights_need_rollout_log_probs() -> None:
    batch = make_batch(TOKEN_ADV)
    with pytest.raises(ValueError, match="rollout_is_cap=2.0.*'rollout_log_probs'.*null"):
        get_policy_loss("vanilla", REGISTRY)(
            **batch, config=PolicyLossConfig(rollout_is_cap=2.0), counts=counts_of(batch["response_mask"])
        )


@st.composite
def log_prob_pairs(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
    """Engine and rollout log-probs of a padded batch and its mask; masked positions hold anything."""
    rows, length = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    log_probs = st.lists(
        st.lists(st.floats(-30, 0), min_size=length, max_size=length), min_size=rows, max_size=rows
    )
    mask = draw(
        st.lists(
            st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length), min_size=rows, max_size=rows
        )
    )
    return draw(log_probs), draw(log_probs), mask


def mismatch_property(mismatch):
    """The property ``mismatch`` must hold: each metric is its formula, written out over the set tokens."""

    @settings(max_examples=100, deadline=None, database=None)
    @given(pair=log_prob_pairs())
    def check(pair) -> None:
        old, rollout, mask = pair
        tokens = [(i, t) for i, row in enumerate(mask) for t, bit in enumerate(row) if bit]
        diffs = [abs(old[i][t] - rollout[i][t]) for i, t in tokens]
        prob_diffs = [abs(math.exp(old[i][t]) - math.exp(rollout[i][t])) for i, t in tokens]
        metrics = mismatch(
            old_log_prob=torch.tensor(old, dtype=F64),
            rollout_log_probs=torch.tensor(rollout, dtype=F64),
            response_mask=torch.tensor(mask),
        )
        assert metrics == {
            "rollout/log_prob_diff_mean": pytest.approx(sum(diffs) / len(tokens) if tokens else 0.0),
            "rollout/log_prob_diff_max": pytest.approx(max(diffs, default=0.0)),
            "rollout/prob_diff_mean": pytest.approx(sum(prob_diffs) / len(tokens) if tokens else 0.0),
        }

    return check


test_rollout_log_prob_mismatch_is_its_formula_over_the_response_tokens = mismatch_property(
    rollout_log_prob_mismatch
)


def test_a_mismatch_that_also_averages_over_padding_fails_the_formula() -> None:
    def over_every_token(*, old_log_prob, rollout_log_probs, response_mask):
        return rollout_log_prob_mismatch(
            old_log_prob=old_log_prob,
            rollout_log_probs=rollout_log_probs,
            response_mask=torch.ones_like(response_mask),
        )

    with pytest.raises(AssertionError):
        mismatch_property(over_every_token)()


def test_a_bad_aggregation_mode_is_refused_even_by_losses_that_fix_their_own() -> None:
    batch = make_batch(SEQ_ADV)
    config = PolicyLossConfig(loss_agg_mode="seq_mean")
    with pytest.raises(ValueError, match="actor.policy_loss.loss_agg_mode='seq_mean'.*token-mean"):
        get_policy_loss("gspo", REGISTRY)(**batch, config=config, counts=counts_of(batch["response_mask"]))


# -- the actor's total loss -----------------------------------------------------------------------


def test_actor_loss_adds_entropy_bonus_and_kl_loss() -> None:
    batch = make_batch(TOKEN_ADV)
    entropy = torch.rand(4, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref_log_prob = batch["log_prob"].detach() + 0.3 * torch.randn(
        4, 5, dtype=F64, generator=torch.Generator().manual_seed(2)
    )
    config = PolicyLossConfig(
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"
    )
    loss, metrics = compute_actor_loss(
        **batch,
        config=config,
        counts=counts_of(batch["response_mask"]),
        entropy=entropy,
        ref_log_prob=ref_log_prob,
        registry=REGISTRY,
    )
    (grad,) = torch.autograd.grad(loss, batch["log_prob"])

    log_prob = batch["log_prob"].detach().clone().requires_grad_()
    expected = ref_vanilla(log_prob, batch["old_log_prob"].tolist(), TOKEN_ADV, config)
    entropy_terms, kl_terms = {}, {}
    for i, t in valid_tokens(MASK):
        entropy_terms[i, t] = entropy[i, t]
        d = ref_log_prob[i, t] - log_prob[i, t]
        kl_terms[i, t] = torch.exp(d) - d - 1  # k3 (low_var_kl), small enough not to be clamped
    expected = (
        expected - 0.01 * aggregate(entropy_terms, "token-mean") + 0.1 * aggregate(kl_terms, "token-mean")
    )
    (expected_grad,) = torch.autograd.grad(expected, log_prob)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    num_tokens = len(valid_tokens(MASK))
    assert metrics["actor/entropy"] == pytest.approx(sum(entropy_terms.values()).item() / num_tokens)
    assert metrics["actor/kl_loss"] == pytest.approx(sum(kl_terms.values()).item() / num_tokens)
    assert "actor/pg_clipfrac" in metrics


def test_actor_loss_names_the_missing_inputs() -> None:
    batch = make_batch(TOKEN_ADV)
    counts = counts_of(batch["response_mask"])
    with pytest.raises(ValueError, match="entropy_coeff=0.01.*compute_entropy=True"):
        compute_actor_loss(
            **batch, config=PolicyLossConfig(entropy_coeff=0.01), counts=counts, registry=REGISTRY
        )
    with pytest.raises(ValueError, match="use_kl_loss=True.*'ref_log_prob'"):
        compute_actor_loss(
            **batch, config=PolicyLossConfig(use_kl_loss=True), counts=counts, registry=REGISTRY
        )


# -- the uniform signature ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [loss.name for loss in catalog.POLICY_LOSSES])
def test_every_builtin_has_the_uniform_keyword_only_signature(name) -> None:
    expected = inspect.signature(PolicyLossFn.__call__).parameters
    parameters = inspect.signature(get_policy_loss(name, REGISTRY)).parameters
    assert list(parameters) == [p for p in expected if p != "self"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    assert parameters["rollout_log_probs"].default is None
