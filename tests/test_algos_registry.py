"""Algorithms by name: a test plugin's estimator and loss are used from config exactly like built-ins;
duplicate and unknown names give errors that name the providers and the known names."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch

from verl_core import AdvantageEstimator, PolicyLoss, hookimpl
from verl_core.algos import catalog, compute_actor_loss, compute_policy_loss_vanilla
from verl_core.algos.aggregation import agg_loss
from verl_core.algos.registry import get_advantage_estimator, get_policy_loss
from verl_core.config.algorithm import AlgorithmConfig, PolicyLossConfig
from verl_core.data.batch import GlobalCounts
from verl_core.errors import DuplicateNameError, UnknownNameError
from verl_core.plugins import Registry

# -- what a third-party plugin ships --------------------------------------------------------------


def scaled_outcome_advantage(*, token_level_rewards, response_mask, config, index=None, values=None, **_):
    """Advantage = the sample's summed reward times ``algorithm.extra['scale']``, on its response."""
    scores = token_level_rewards.sum(-1, keepdim=True) * config.extra["scale"]
    advantages = torch.where(response_mask.bool(), scores, 0.0)
    return advantages, advantages


def linear_policy_loss(
    *, old_log_prob, log_prob, advantages, response_mask, config, counts, rollout_log_probs=None
):
    """``-scale * A * log pi``, aggregated like every loss (global counts, the configured mode)."""
    loss_mat = -config.extra["scale"] * advantages * log_prob
    return agg_loss(loss_mat, response_mask, config.loss_agg_mode, counts), {
        "plugin/scale": config.extra["scale"]
    }


def make_plugin(name: str, **hooks: Callable[[], list]) -> types.ModuleType:
    """A plugin module, as an entry point would name one."""
    module = types.ModuleType(name)
    for hook_name, implementation in hooks.items():
        setattr(module, hook_name, hookimpl(implementation))
    return module


ALGOS_PLUGIN = make_plugin(
    "acme_algos",
    verl_advantage_estimators=lambda: [
        AdvantageEstimator(name="scaled_outcome", function=scaled_outcome_advantage)
    ],
    # By import string, like a real plugin: imported only when the loss is looked up.
    verl_policy_losses=lambda: [PolicyLoss(name="acme_linear", function=f"{__name__}:linear_policy_loss")],
)


# -- tests ----------------------------------------------------------------------------------------


def test_a_plugins_estimator_and_loss_are_used_by_name_from_config() -> None:
    registry = Registry.from_plugins([ALGOS_PLUGIN], autoload=False)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    algorithm = AlgorithmConfig(adv_estimator="scaled_outcome", extra={"scale": 0.5})
    estimator = get_advantage_estimator(algorithm.adv_estimator, registry)
    advantages, _ = estimator(token_level_rewards=rewards, response_mask=mask, config=algorithm)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]))

    log_prob = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    actor = PolicyLossConfig(loss_mode="acme_linear", extra={"scale": 3.0})
    loss, metrics = compute_actor_loss(
        log_prob=log_prob,
        old_log_prob=log_prob.detach(),
        advantages=advantages,
        response_mask=mask,
        config=actor,
        counts=GlobalCounts(num_tokens=5, num_seqs=2, dp_size=1, max_response_len=3),
        registry=registry,
    )
    expected = 0.0
    for i in range(2):
        for t in range(3):
            if mask[i, t]:
                expected += -3.0 * advantages[i, t].item() * log_prob[i, t].item() / 5
    assert loss.item() == pytest.approx(expected)
    assert metrics == {"plugin/scale": 3.0}


def test_builtins_come_through_the_same_hooks() -> None:
    registry = Registry.from_plugins([ALGOS_PLUGIN], autoload=False)
    losses = {entry.name: entry.plugin for entry in registry.entries("policy_losses")}
    assert losses == {
        **{loss.name: "verl_core" for loss in catalog.POLICY_LOSSES},
        "acme_linear": "acme_algos",
    }
    assert get_policy_loss("vanilla", registry) is compute_policy_loss_vanilla
    for estimator in catalog.ADVANTAGE_ESTIMATORS:
        assert callable(get_advantage_estimator(estimator.name, registry))
    for loss in catalog.POLICY_LOSSES:
        assert callable(get_policy_loss(loss.name, registry))


def test_two_plugins_claiming_one_name_is_an_error_naming_both() -> None:
    rival = make_plugin(
        "rival_algos",
        verl_policy_losses=lambda: [PolicyLoss(name="acme_linear", function=linear_policy_loss)],
    )
    registry = Registry.from_plugins([ALGOS_PLUGIN, rival], autoload=False)
    with pytest.raises(DuplicateNameError) as error:
        get_policy_loss("acme_linear", registry)
    message = str(error.value)
    assert "'acme_algos'" in message and "'rival_algos'" in message and "override=True" in message


def test_replacing_a_builtin_must_be_explicit() -> None:
    def vanilla_clone(**kwargs):
        return compute_policy_loss_vanilla(**kwargs)

    silent = make_plugin(
        "silent", verl_policy_losses=lambda: [PolicyLoss(name="vanilla", function=vanilla_clone)]
    )
    with pytest.raises(DuplicateNameError, match="'silent'.*'verl_core'|'verl_core'.*'silent'"):
        get_policy_loss("vanilla", Registry.from_plugins([silent], autoload=False))

    explicit = make_plugin(
        "explicit",
        verl_policy_losses=lambda: [PolicyLoss(name="vanilla", function=vanilla_clone, override=True)],
    )
    assert get_policy_loss("vanilla", Registry.from_plugins([explicit], autoload=False)) is vanilla_clone


def test_unknown_names_list_the_known_ones_and_the_config_key() -> None:
    registry = Registry.from_plugins([ALGOS_PLUGIN], autoload=False)
    with pytest.raises(UnknownNameError) as error:
        get_policy_loss("vanila", registry)
    message = str(error.value)
    assert "actor.policy_loss.loss_mode" in message and "(did you mean 'vanilla'?)" in message
    for name in ("vanilla", "gspo", "cispo", "acme_linear"):
        assert name in message

    with pytest.raises(UnknownNameError) as error:
        get_advantage_estimator("grpo_typo", registry)
    message = str(error.value)
    assert "algorithm.adv_estimator" in message and "scaled_outcome" in message and "grpo" in message
