"""Names resolve once, in the registry of the run: the config's rules read what an estimator declares
(``needs_values``, ``needs_groups``) instead of knowing estimators by name, and the actor's worker uses
the policy loss of its own registry (an in-process run's custom one), resolved once, not the process
-wide registry's at every micro-batch."""

from __future__ import annotations

import pytest
import torch
from fixtures.demo import build_small_demo, run_overrides

from verl_core import AdvantageEstimator, PolicyLoss, hookimpl
from verl_core.algos import compute_policy_loss_vanilla, compute_rloo_outcome_advantage
from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.plugins import Registry

torch.set_num_threads(1)
CALLS: list[str] = []


def counted_vanilla(**kwargs):
    CALLS.append("mine")
    return compute_policy_loss_vanilla(**kwargs)


class Plugin:
    @staticmethod
    @hookimpl
    def verl_advantage_estimators() -> list[AdvantageEstimator]:
        return [
            AdvantageEstimator("mine_grouped", compute_rloo_outcome_advantage, needs_groups=True),
            AdvantageEstimator("mine_valued", compute_rloo_outcome_advantage, needs_values=True),
            AdvantageEstimator("mine_plain", compute_rloo_outcome_advantage),
        ]

    @staticmethod
    @hookimpl
    def verl_policy_losses() -> list[PolicyLoss]:
        return [PolicyLoss("mine", counted_vanilla)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugins([Plugin], autoload=True)  # the installed ddp backend, and this plugin


@pytest.mark.parametrize(
    ("estimator", "key"),
    [("mine_grouped", "rollout.n"), ("mine_valued", "critic.enable"), ("mine_plain", None)],
)
def test_the_rules_read_what_an_estimator_declares(demo, tmp_path, registry, estimator, key) -> None:
    overrides = run_overrides(demo, tmp_path, **{"algorithm.adv_estimator": estimator, "rollout.n": 1})
    if key is None:
        load_config([], overrides, registry=registry)
        return
    with pytest.raises(ConfigError) as caught:
        load_config([], overrides, registry=registry)
    assert [path for path, _ in caught.value.errors] == [key]
    assert f"adv_estimator '{estimator}'" in caught.value.errors[0][1]


def test_the_worker_uses_the_policy_loss_of_its_own_registry_resolved_once(demo, tmp_path, registry) -> None:
    from verl_core.trainer.rl import RLTrainer

    overrides = run_overrides(demo, tmp_path, **{"actor.policy_loss.loss_mode": "mine"})
    trainer = RLTrainer.from_config(
        load_config([], overrides, registry=registry), registry, show_progress=False
    )
    try:
        worker = trainer.actor.group.worker
        assert worker.policy_loss is counted_vanilla
        CALLS.clear()
        trainer.train_step(1)
        assert CALLS and set(CALLS) == {"mine"}  # once per micro-batch, the run's own loss
    finally:
        trainer.shutdown()
