"""Algorithms by name: advantage estimators and policy losses, from every plugin, built-ins included.

Core's built-ins (``verl_core.algos.catalog``) are registered through the same hooks as a third
party's, so ``get_policy_loss("vanilla")`` and ``get_policy_loss("my_plugin_loss")`` take one path:
``verl_core.plugins`` finds the descriptor (an unknown name lists the known ones, a name two plugins
claim names both), and its import string is imported only now, when the algorithm is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_core.hookspecs import Kind
from verl_core.plugins.registry import Registry, registry_or_installed


def _load(kind: Kind, name: str, registry: Registry | None, where: str) -> Callable[..., Any]:
    return registry_or_installed(registry).entry(kind, name, where=where).load("function")


def get_advantage_estimator(name: str, registry: Registry | None = None) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (``algorithm.adv_estimator``).

    Called as documented on ``verl_core.AdvantageEstimator``. ``registry`` defaults to the
    process-wide one. Raises ``UnknownNameError`` listing the installed estimators, or
    ``DuplicateNameError`` naming both providers.
    """
    return _load(Kind.ADVANTAGE_ESTIMATORS, name, registry, where="algorithm.adv_estimator")


def get_policy_loss(name: str, registry: Registry | None = None) -> Callable[..., Any]:
    """The policy loss registered as ``name`` (``actor.policy_loss.loss_mode``).

    Called as documented on ``verl_core.PolicyLoss`` (``verl_core.algos.policy_loss.PolicyLossFn``).
    ``registry`` defaults to the process-wide one. Raises ``UnknownNameError`` listing the installed
    losses, or ``DuplicateNameError`` naming both providers.
    """
    return _load(Kind.POLICY_LOSSES, name, registry, where="actor.policy_loss.loss_mode")
