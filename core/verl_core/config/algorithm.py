"""Options of the RL algorithms (verl's key names). Read by ``verl_core.algos``."""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from verl_core.config.names import registered
from verl_core.config.validators import (
    InvalidValue,
    greater_than,
    non_negative,
    one_of,
    positive,
    unit_interval,
    unknown_choice_message,
)
from verl_core.deprecation import declare
from verl_core.hookspecs import Kind

#: How per-token losses become one number; ``verl_core.algos.aggregation`` documents each mode. The
#: one list of their names: the config checks it, the algorithms name each mode from it.
LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = typing.get_args(LossAggMode)

#: The per-token KL estimators ``verl_core.algos.kl`` implements. Listed here, without torch, so that
#: a config is checked when it loads; ``verl_core.algos.kl`` computes exactly these.
KL_ESTIMATORS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: Every name ``algorithm.kl_penalty`` and ``actor.policy_loss.kl_loss_type`` accept: each estimator,
#: and each with a ``+`` suffix (its value with the gradient of ``k2``, straight-through).
KL_PENALTIES: tuple[str, ...] = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
_kl_estimator = one_of(KL_PENALTIES, "KL estimator", "'+' keeps the value with the gradient of k2")


@attrs.define
class KLControlConfig:
    """KL-in-reward coefficient controller: ``fixed``, or ``adaptive`` (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = attrs.field(default=0.001, validator=non_negative)
    #: Adaptive controller only: the KL it steers towards, and its horizon in samples.
    target_kl: float = attrs.field(default=0.1, validator=positive)
    horizon: int = attrs.field(default=10000, validator=positive)


@attrs.define
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop the groups whose responses all scored the same (they carry no
    advantage for group estimators) and generate for more prompts until the batch is full."""

    enable: bool = False
    #: Generation rounds per step at most (the first included) before the step gives up with an error.
    max_num_gen_batches: int = attrs.field(default=10, validator=positive)


@attrs.define
class AlgorithmConfig:
    """The ``algorithm`` section: advantage estimation and KL in the reward."""

    #: Name of a registered advantage estimator (``verl-core plugins --all`` lists them).
    adv_estimator: str = registered(Kind.ADVANTAGE_ESTIMATORS, "gae")
    gamma: float = attrs.field(default=1.0, validator=unit_interval)
    lam: float = attrs.field(default=1.0, validator=unit_interval)
    #: GRPO: divide by the group's std (False gives Dr.GRPO).
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    #: KL estimator of the penalty (``KL_PENALTIES``).
    kl_penalty: str = attrs.field(default="kl", validator=_kl_estimator)
    kl_ctrl: KLControlConfig = attrs.field(factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = attrs.field(factory=FilterGroupsConfig)
    #: Options for plugin-provided estimators, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)


#: ``rollout_correction.rollout_rs``'s rejection criteria (verl's names): a divergence of the trainer's
#: from the rollout's log-probs, per token (``token_``), or per sequence summed, averaged or at its
#: largest over the tokens (``seq_sum_``, ``seq_mean_``, ``seq_max_``). With ``r`` the ratio
#: ``pi_old / pi_rollout`` of a token: ``k1`` is ``log r`` (bounded below and above, as a ratio:
#: ``seq_mean_k1`` bounds the geometric mean of the ratios, ``seq_sum_k1`` their product), ``k2`` is
#: ``(log r)^2 / 2`` and ``k3`` is ``r - 1 - log r`` (both bounded above only).
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@attrs.frozen
class Bounds:
    """A closed interval ``[lower, upper]`` of a correction; ``lower`` ``None``: no lower bound."""

    lower: float | None
    upper: float


def parse_bounds(spec: float | str) -> Bounds:
    """``2.0`` (or ``"2.0"``): ``Bounds(None, 2.0)``; ``"0.5_5.0"``: ``Bounds(0.5, 5.0)`` (verl's
    notation). Raises ``ValueError`` saying what is wrong."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"expected a number or a 'low_high' string, got {spec!r}")
    text = str(spec).strip()
    lower_text, separator, upper_text = text.partition("_")
    try:
        lower = float(lower_text) if separator else None
        upper = float(upper_text if separator else text)
    except ValueError:
        raise ValueError(
            f"expected a number (2.0) or a 'low_high' string ('0.5_5.0'), got {spec!r}"
        ) from None
    if not math.isfinite(upper) or upper <= 0:
        raise ValueError(f"the upper bound must be a finite number > 0, got {spec!r}")
    if lower is not None and not (0 <= lower <= upper):
        raise ValueError(f"the lower bound must be in [0, upper], got {spec!r}")
    return Bounds(lower, upper)


def _bounds_spec(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        try:
            parse_bounds(value)
        except ValueError as error:
            raise InvalidValue(attribute.name, str(error)) from None


def rs_option_names(spec: str) -> list[str]:
    """The options of a ``rollout_rs`` string, in order, each once (``"token_k1, seq_mean_k3"``)."""
    return list(dict.fromkeys(part.strip() for part in spec.split(",") if part.strip()))


def _rs_options(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    options = rs_option_names(value)
    if not options:
        raise InvalidValue(attribute.name, f"names no criterion; use one of {', '.join(ROLLOUT_RS_OPTIONS)}")
    for option in options:
        if option not in ROLLOUT_RS_OPTIONS:
            message = unknown_choice_message("rejection criterion", option, ROLLOUT_RS_OPTIONS)
            raise InvalidValue(attribute.name, message)


@attrs.define
class RolloutCorrectionConfig:
    """``actor.policy_loss.rollout_correction``: what corrects for a rollout that samples from a slightly
    different distribution than the training engine computes (another inference engine, another
    dtype), with verl's keys (its ``algorithm.rollout_correction``). Off by default; the mismatch metrics
    (``rollout_corr/*``) are logged either way. ``verl_core.algos.rollout_correction`` computes it;
    docs/algorithms.md says which correction suits which case.
    """

    #: Importance weights ``pi_old / pi_rollout`` on the policy loss (no gradient): one per ``token``, or
    #: one per ``sequence`` (the product of its tokens' ratios, on all of them); ``None``: none.
    rollout_is: Literal["token", "sequence"] | None = None
    #: A number: the weights are truncated at it (TIS); a string ``"low_high"``: weights outside
    #: ``[low, high]`` are 0 (masking: IcePop per token, TRL's ``sequence_mask`` per sequence).
    rollout_is_threshold: float | str = attrs.field(default=2.0, validator=_bounds_spec)
    #: Rejection: comma-separated criteria of ``ROLLOUT_RS_OPTIONS``; a token (``token_*``) or a whole
    #: sequence (``seq_*``) outside its bounds leaves the loss (its ``response_mask`` becomes 0, as in
    #: verl). ``seq_mean_k1`` is geometric rejection. ``None``: none.
    rollout_rs: str | None = attrs.field(default=None, validator=_rs_options)
    #: Bounds of the criteria: one for all, or one per criterion (comma-separated). ``k1``: a ratio
    #: ``"low_high"``, or a number ``high`` for ``[1/high, high]``; ``k2``, ``k3``: an upper bound.
    rollout_rs_threshold: float | str | None = None
    #: The rollout's log-probs are the old log-probs (no recompute by the engine, whatever the number
    #: of updates per batch); PPO's ratio is then ``pi / pi_rollout``. Excludes the corrections above.
    bypass_mode: bool = False

    @property
    def active(self) -> bool:
        """Whether a correction weighs or rejects tokens (both need the engine's old log-probs)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def is_bounds(self) -> Bounds:
        """``rollout_is_threshold`` parsed: a ``lower`` bound means masking, none truncation."""
        return parse_bounds(self.rollout_is_threshold)

    @property
    def rs_bounds(self) -> dict[str, Bounds]:
        """Each rejection criterion with its bounds (``{}`` when rejection is off). Raises
        ``ValueError`` where ``rollout_rs_threshold`` does not fit ``rollout_rs`` (what ``check`` says)."""
        if self.rollout_rs is None:
            return {}
        bounds, problems = self._rs_bounds()
        if problems:
            raise ValueError("; ".join(f"rollout_correction.{key}: {message}" for key, message in problems))
        return bounds

    def _rs_bounds(self) -> tuple[dict[str, Bounds], list[tuple[str, str]]]:
        """Each criterion of ``rollout_rs`` with its bounds, and the problems of
        ``rollout_rs_threshold`` (a missing one, one too many, a lower bound on ``k2`` or ``k3``)."""
        options = rs_option_names(self.rollout_rs or "")
        key = "rollout_rs_threshold"
        if self.rollout_rs_threshold is None:
            example = "e.g. '0.5_2.0' for a ratio (k1), 0.01 for k2 or k3"
            return {}, [(key, f"required with rollout_rs ({', '.join(options)}): {example}")]
        specs = [part.strip() for part in str(self.rollout_rs_threshold).split(",")]
        if len(specs) not in (1, len(options)):
            return {}, [
                (
                    key,
                    f"gives {len(specs)} bounds for {len(options)} criteria of rollout_rs "
                    f"({', '.join(options)}): give one for all, or one per criterion",
                )
            ]
        bounds, problems = {}, []
        for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs, strict=True):
            try:
                parsed = parse_bounds(spec)
            except ValueError as error:
                problems.append((key, f"{option}: {error}"))
                continue
            if option.endswith("k1"):  # a ratio; one number is symmetric in log space
                bounds[option] = (
                    parsed if parsed.lower is not None else Bounds(1.0 / parsed.upper, parsed.upper)
                )
            elif parsed.lower is not None:
                problems.append(
                    (
                        key,
                        f"{option}: {spec!r} has a lower bound, but {option[-2:]} is never below 0: give its "
                        "upper bound only",
                    )
                )
            else:
                bounds[option] = parsed
        return bounds, problems

    def check(self) -> Iterator[tuple[str, str]]:
        if self.bypass_mode and self.active:
            yield (
                "bypass_mode",
                "cannot be combined with rollout_is or rollout_rs: with the rollout's log-probs as the "
                "old ones, every ratio pi_old / pi_rollout is 1 and there is nothing to weigh or reject "
                "(PPO's own ratio pi / pi_rollout does the correcting); set bypass_mode: false to have "
                "the engine recompute them, or remove rollout_is and rollout_rs",
            )
        if self.rollout_rs is not None:
            yield from self._rs_bounds()[1]

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.rollout_rs is None and self.rollout_rs_threshold is not None:
            yield "rollout_rs_threshold", "ignored: rollout_rs is not set"


#: ``actor.policy_loss.rollout_is_cap``, the first form of token-level truncation, now one case of
#: ``rollout_correction``.
ROLLOUT_IS_CAP_DEPRECATION = declare(
    "config key actor.policy_loss.rollout_is_cap",
    since="0.2.0",
    removed_in="0.4.0",
    replacement="actor.policy_loss.rollout_correction: {rollout_is: token, rollout_is_threshold: <the cap>}",
)


@attrs.define
class PolicyLossConfig:
    """The actor's loss: which policy loss, its clipping, aggregation, entropy and KL terms."""

    #: Name of a registered policy loss; ``vanilla`` is PPO's clipped surrogate.
    loss_mode: str = registered(Kind.POLICY_LOSSES, "vanilla")
    loss_agg_mode: LossAggMode = "token-mean"
    clip_ratio: float = attrs.field(default=0.2, validator=non_negative)
    #: Asymmetric clipping (DAPO's clip-higher); ``None`` falls back to ``clip_ratio``.
    clip_ratio_low: float | None = attrs.field(default=None, validator=non_negative)
    clip_ratio_high: float | None = attrs.field(default=None, validator=non_negative)
    #: Dual-clip lower bound for negative advantages (must be > 1).
    clip_ratio_c: float = attrs.field(default=3.0, validator=greater_than(1))
    entropy_coeff: float = attrs.field(default=0.0, validator=non_negative)
    use_kl_loss: bool = False
    kl_loss_coef: float = attrs.field(default=0.001, validator=non_negative)
    #: KL estimator of the loss term (``KL_PENALTIES``).
    kl_loss_type: str = attrs.field(default="low_var_kl", validator=_kl_estimator)
    #: Deprecated: ``rollout_correction`` with ``rollout_is: token`` and this as ``rollout_is_threshold``
    #: (what ``correction`` gives). ``None``: not set.
    rollout_is_cap: float | None = attrs.field(default=None, validator=positive)
    #: Clip-Cov: fraction of tokens to detach, and the covariance band they are drawn from.
    clip_cov_ratio: float = attrs.field(default=0.0002, validator=unit_interval)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    #: KL-Cov: fraction of highest-covariance tokens that get the |log-ratio| penalty, and its weight.
    kl_cov_ratio: float = attrs.field(default=0.0002, validator=unit_interval)
    ppo_kl_coef: float = attrs.field(default=1.0, validator=non_negative)
    #: SAPO: temperatures of the soft gate for positive and negative advantages.
    tau_pos: float = attrs.field(default=1.0, validator=positive)
    tau_neg: float = attrs.field(default=1.05, validator=positive)
    #: DRO: weight of the quadratic log-ratio penalty.
    dro_beta: float = attrs.field(default=1.0, validator=non_negative)
    #: Options for plugin-provided losses, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)
    #: Corrections for a rollout whose numbers are not the training engine's (``RolloutCorrectionConfig``).
    rollout_correction: RolloutCorrectionConfig = attrs.field(factory=RolloutCorrectionConfig)

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The correction in effect: ``rollout_correction``, with the deprecated ``rollout_is_cap``
        as the token-level truncation it always was."""
        if self.rollout_is_cap is None:
            return self.rollout_correction
        return attrs.evolve(
            self.rollout_correction, rollout_is="token", rollout_is_threshold=self.rollout_is_cap
        )

    def check(self) -> Iterator[tuple[str, str]]:
        correction = self.rollout_correction
        if self.rollout_is_cap is not None and (correction.rollout_is is not None or correction.bypass_mode):
            yield (
                "rollout_is_cap",
                "deprecated, and rollout_correction sets "
                + ("rollout_is" if correction.rollout_is is not None else "bypass_mode")
                + ": remove rollout_is_cap (it means rollout_correction.rollout_is: token, "
                f"rollout_is_threshold: {self.rollout_is_cap})",
            )

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.rollout_is_cap is not None:  # a warning, not "ignored": it still applies
            deprecation = ROLLOUT_IS_CAP_DEPRECATION
            yield (
                "rollout_is_cap",
                f"deprecated since verl-core {deprecation.since}, removed in {deprecation.removed_in}: "
                f"set rollout_correction: {{rollout_is: token, rollout_is_threshold: {self.rollout_is_cap}}} "
                "instead (the same weights)",
            )


@attrs.define
class CriticLossConfig:
    """The critic's clipped value loss."""

    cliprange_value: float = attrs.field(default=0.5, validator=positive)
    loss_agg_mode: LossAggMode = "token-mean"
