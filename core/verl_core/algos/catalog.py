"""Descriptors of core's built-in algorithms, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import AdvantageEstimator, PolicyLoss

ADVANTAGE_ESTIMATORS: tuple[AdvantageEstimator, ...] = ()
POLICY_LOSSES: tuple[PolicyLoss, ...] = ()
