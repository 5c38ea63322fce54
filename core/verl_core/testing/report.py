"""What the conformance checks found: comparisons, per-check outcomes, and the report of one run.

A ``Comparison`` is one quantity of one check on one rank (``log_probs`` on rank 1, the parameters
after step 1, ...) compared with its expected value within a tolerance; its ``detail`` says what
differed, where and by how much. A check yields its comparisons as it makes them, and each rank
records them as they come (``run_check``), so a check that raises partway still reports what it saw.
``ConformanceReport`` merges the ranks into one ``CheckOutcome`` per check, and a backend's declared
expected failures (``expected_failed_checks``) turn into ``xfailed``, strictly. Everything here is
plain data (picklable, no tensors) so that ranks can hand it to the process that asked.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import attrs
import torch

from verl_core.errors import did_you_mean

#: ``xfailed``: the check failed (or raised) as the backend declared it would, with a reason.
Status = Literal["passed", "failed", "error", "skipped", "xfailed"]


@attrs.frozen
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise; zeros mean bitwise equality."""

    atol: float = 0.0
    rtol: float = 0.0

    @property
    def bitwise(self) -> bool:
        return self.atol == 0.0 and self.rtol == 0.0

    def __str__(self) -> str:
        return "bitwise equality" if self.bitwise else f"atol={self.atol:g}, rtol={self.rtol:g}"


BITWISE = Tolerance()


@attrs.frozen
class Comparison:
    """One quantity of one check on one rank, against what it should be.

    ``max_abs_diff`` is ``None`` where no number applies (missing names, wrong shapes).
    """

    check: str
    quantity: str
    rank: int
    passed: bool
    detail: str
    max_abs_diff: float | None = None

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return f"[rank {self.rank}] {self.quantity}: {verdict}: {self.detail}"


def compare_tensors(
    check: str,
    quantity: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    tolerance: Tolerance,
    rank: int,
    mask: torch.Tensor | None = None,
    against: str = "reference",
    subject: str = "engine",
) -> Comparison:
    """Compare ``actual`` (from the ``subject`` under test: the engine, the rollout) with ``expected``
    where ``mask`` is true.

    A failure names the worst element: its index, both values and the difference.
    """
    if actual is None or expected is None:
        return Comparison(check, quantity, rank, False, f"the {subject} returned nothing for it")
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    if actual.shape != expected.shape:
        return Comparison(
            check, quantity, rank, False, f"shape {list(actual.shape)} but {against} {list(expected.shape)}"
        )
    if mask is None:
        mask = torch.ones_like(expected, dtype=torch.bool)
    mask = mask.to("cpu", torch.bool).expand_as(expected)
    if not bool(mask.any()):
        return Comparison(check, quantity, rank, True, "nothing to compare", 0.0)
    if tolerance.bitwise:
        # NaN == NaN bitwise: an engine that reproduces a NaN exactly is still reproducing.
        same = (actual == expected) | (actual.isnan() & expected.isnan())
    else:
        same = torch.isclose(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol)
    differs = ~same & mask
    difference = (actual - expected).abs()
    # Agreeing values (two NaNs included) differ by 0; a NaN on one side only is infinitely wrong.
    difference = torch.where(same, difference.nan_to_num(nan=0.0), difference.nan_to_num(nan=torch.inf))
    difference = torch.where(mask, difference, torch.zeros_like(difference))
    focus = differs if bool(differs.any()) else mask
    worst = torch.where(focus, difference, -1.0).argmax()
    index = tuple(int(i) for i in torch.unravel_index(worst, expected.shape))
    max_abs_diff = float(difference.max())
    where = f" at {list(index)}" if index else ""
    values = f"{subject} {actual[index].item():.8g}, {against} {expected[index].item():.8g}"
    if bool(differs.any()):
        how_much = f"(|difference| {difference[index].item():.3g}; tolerance {tolerance})"
        if expected.numel() == 1:
            detail = f"{values} {how_much}"
        else:
            count = f"{int(differs.sum())} of {int(mask.sum())} values differ from the {against}"
            detail = f"{count}; worst{where}: {values} {how_much}"
        return Comparison(check, quantity, rank, False, detail, max_abs_diff)
    return Comparison(
        check, quantity, rank, True, f"max |difference| {max_abs_diff:.3g} within {tolerance}", max_abs_diff
    )


def compare_scalars(
    check: str,
    quantity: str,
    actual: float | None,
    expected: float,
    tolerance: Tolerance,
    rank: int,
    against: str = "reference",
) -> Comparison:
    """``compare_tensors`` for one number (a loss, a gradient norm, a learning rate)."""
    if actual is None:
        return Comparison(check, quantity, rank, False, "the engine reported nothing for it")
    actual_tensor, expected_tensor = (torch.tensor(float(v), dtype=torch.float64) for v in (actual, expected))
    return compare_tensors(check, quantity, actual_tensor, expected_tensor, tolerance, rank, against=against)


def compare_state_dicts(
    check: str,
    quantity: str,
    actual: Iterable[tuple[str, torch.Tensor]],
    expected: Mapping[str, torch.Tensor],
    tolerance: Tolerance,
    rank: int,
    against: str = "reference",
) -> list[Comparison]:
    """Compare named tensors with ``expected``: the names, their order, the shapes, and the values.

    Returns one comparison per aspect (``{quantity} names`` ...) so a failure says which went wrong;
    values are compared only for tensors present in both.
    """
    actual = [(name, tensor.detach().to("cpu")) for name, tensor in actual]
    actual_names = [name for name, _ in actual]
    expected_names = list(expected)
    missing = [name for name in expected_names if name not in actual_names]
    unexpected = [name for name in actual_names if name not in expected]
    duplicates = sorted({name for name in actual_names if actual_names.count(name) > 1})
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if duplicates:
        problems.append(f"duplicated {_names(duplicates)}")
    comparisons = [
        Comparison(
            check,
            f"{quantity} names",
            rank,
            not problems,
            "; ".join(problems) + f" (expected the {len(expected_names)} tensors of the {against})"
            if problems
            else f"all {len(expected_names)} names match",
        )
    ]
    common = [name for name in actual_names if name in expected]
    expected_order = [name for name in expected_names if name in set(common)]
    first_out_of_order = next(
        (i for i, (a, b) in enumerate(zip(common, expected_order, strict=True)) if a != b), None
    )
    comparisons.append(
        Comparison(
            check,
            f"{quantity} order",
            rank,
            first_out_of_order is None,
            "same order as the state dict"
            if first_out_of_order is None
            else f"position {first_out_of_order} holds {common[first_out_of_order]!r} but the {against} "
            f"has {expected_order[first_out_of_order]!r} there",
        )
    )
    tensors = dict(actual)
    wrong_shapes = [
        f"{name} {list(tensors[name].shape)} vs {list(expected[name].shape)}"
        for name in common
        if tensors[name].shape != expected[name].shape
    ]
    comparisons.append(
        Comparison(
            check,
            f"{quantity} shapes",
            rank,
            not wrong_shapes,
            "all shapes match" if not wrong_shapes else "; ".join(wrong_shapes[:5]),
        )
    )
    value_comparisons = [
        compare_tensors(check, name, tensors[name], expected[name], tolerance, rank, against=against)
        for name in common
        if tensors[name].shape == expected[name].shape
    ]
    comparisons.append(_worst_of(check, f"{quantity} values", rank, value_comparisons, tolerance))
    return comparisons


def _worst_of(
    check: str, quantity: str, rank: int, comparisons: list[Comparison], tolerance: Tolerance
) -> Comparison:
    """Summarise per-tensor comparisons: how many failed, and the worst one."""
    if not comparisons:
        return Comparison(check, quantity, rank, False, "no tensor could be compared")
    failed = [c for c in comparisons if not c.passed]
    worst = max(comparisons, key=lambda c: -1.0 if c.max_abs_diff is None else c.max_abs_diff)
    max_abs_diff = worst.max_abs_diff
    if failed:
        first = max(failed, key=lambda c: -1.0 if c.max_abs_diff is None else c.max_abs_diff)
        names = ", ".join(c.quantity for c in failed[:3]) + (", ..." if len(failed) > 3 else "")
        detail = f"{len(failed)} of {len(comparisons)} tensors differ ({names}); worst {first.quantity}: {first.detail}"
        return Comparison(check, quantity, rank, False, detail, max_abs_diff)
    detail = f"all {len(comparisons)} tensors within {tolerance} (max |difference| {max_abs_diff:.3g} in {worst.quantity})"
    return Comparison(check, quantity, rank, True, detail, max_abs_diff)


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# -- outcomes ------------------------------------------------------------------------------------


@attrs.frozen
class RankRecord:
    """What one rank recorded for one check: its comparisons, and why it was skipped or raised.

    ``raised`` is set when the check raised on this rank: its status is then ``error``, or
    ``failed`` when a comparison it had made before had already failed (``run_check``).
    """

    check: str
    rank: int
    status: Status
    comparisons: tuple[Comparison, ...] = ()
    reason: str = ""
    raised: bool = False


class CheckSkipped(Exception):
    """The check does not apply to this backend or world size; the message says why."""


def run_check(check: Check, context: Any, rank: int) -> RankRecord:
    """Run ``check`` on this rank and record what it saw.

    Its comparisons are kept as the check yields them, so one that raises partway loses nothing:
    if a comparison had already failed, the record is ``failed`` with those comparisons and the
    traceback (the failure is the finding; the exception may be where it led), otherwise ``error``
    with the traceback. ``CheckSkipped`` makes it ``skipped`` with the reason.
    """
    seen: list[Comparison] = []
    try:
        for comparison in check.run(context):
            seen.append(comparison)
    except CheckSkipped as skip:
        return RankRecord(check.name, rank, "skipped", tuple(seen), reason=str(skip))
    except Exception:
        failed = any(not comparison.passed for comparison in seen)
        reason = traceback.format_exc()
        if failed:
            reason = f"after the failing comparisons below, the check raised:\n{reason}"
        return RankRecord(check.name, rank, "failed" if failed else "error", tuple(seen), reason, raised=True)
    return RankRecord(check.name, rank, "passed", tuple(seen))


@attrs.frozen
class CheckOutcome:
    """One check merged over ranks: ``failed`` if any comparison failed (even on a rank that then
    raised: the reasons carry its traceback), else ``error`` if any rank raised or never finished,
    ``skipped`` if every rank skipped it. ``xfailed`` is a failure or error the backend declared
    (``expect_failure``)."""

    check: str
    status: Status
    comparisons: tuple[Comparison, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.passed]

    def describe(self, limit: int = 8) -> str:
        """A message for a failed assertion: every failing comparison (up to ``limit``), or the error."""
        lines = [f"conformance check '{self.check}' {self.status}:"]
        lines += [f"  {reason}" for reason in self.reasons]
        failures = self.failures
        lines += [f"  {comparison.describe()}" for comparison in failures[:limit]]
        if len(failures) > limit:
            lines.append(f"  ... and {len(failures) - limit} more failing comparisons")
        return "\n".join(lines)

    @classmethod
    def merge(cls, check: str, records: list[RankRecord], world_size: int) -> CheckOutcome:
        comparisons = tuple(c for record in records for c in record.comparisons)
        ranks_by_reason: dict[str, list[int]] = {}
        for record in records:
            if record.reason:
                ranks_by_reason.setdefault(record.reason, []).append(record.rank)
        reasons = tuple(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {reason}"
            for reason, ranks in ranks_by_reason.items()
        )
        finished = {record.rank for record in records}
        unfinished = [rank for rank in range(world_size) if rank not in finished]
        if unfinished:
            reasons += (f"rank(s) {unfinished} did not finish this check (see the run's error)",)
        statuses = {record.status for record in records}
        if any(not c.passed for c in comparisons):
            status: Status = "failed"
        elif statuses & {"error", "failed"} or unfinished:
            status = "error"
        elif statuses == {"skipped"}:
            status = "skipped"
        elif not comparisons:
            status = "error"
            reasons += ("no rank compared anything: the check proved nothing",)
        else:
            status = "passed"
        return cls(check, status, comparisons, reasons)

    def expect_failure(self, reason: str) -> CheckOutcome:
        """This outcome of a check its backend declares it fails, for ``reason``: a failure or an error
        is ``xfailed``; a pass is ``failed``, since the declaration is out of date (strict, as
        scikit-learn's ``expected_failed_checks``); a skip stays a skip."""
        if self.status in ("failed", "error"):
            return attrs.evolve(
                self, status="xfailed", reasons=(f"expected failure: {reason}", *self.reasons)
            )
        if self.status == "passed":
            return attrs.evolve(
                self,
                status="failed",
                reasons=(
                    f"check '{self.check}' passes now: remove it from the expected failures "
                    f"(expected_failed_checks, where it says: {reason})",
                    *self.reasons,
                ),
            )
        return self


def expected_failures(
    declared: Mapping[str, str] | None, known: Iterable[str], where: str = "expected_failed_checks"
) -> dict[str, str]:
    """``declared`` (``{check name: reason}``) checked: every name is a check of the kit, every reason
    a non-empty string; raises ``ValueError`` naming the known checks otherwise."""
    declared = dict(declared or {})
    known = list(known)
    for name, reason in declared.items():
        if name not in known:
            hint = did_you_mean(name, known)
            raise ValueError(f"{where}: {name!r} is not a conformance check{hint}; the checks are {known}")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(
                f"{where}: {name!r} needs a reason, a non-empty string saying why the backend fails it "
                f"(got {reason!r})"
            )
    return declared


@attrs.frozen
class ConformanceReport:
    """The outcome of every requested check of one backend at one world size.

    ``report["first_step"]`` is a ``CheckOutcome``; ``error`` is set when the run itself broke (a
    rank crashed, the run timed out) and then names the rank and carries its traceback. ``kind``
    is what was checked: an ``engine`` backend, or a ``rollout`` backend (one process, so
    ``world_size`` 1).
    """

    backend: str
    world_size: int
    outcomes: dict[str, CheckOutcome]
    error: str | None = None
    kind: Literal["engine", "rollout"] = "engine"

    @property
    def subject(self) -> str:
        """What ran, for messages: ``backend 'ddp' at world_size=2``, ``rollout backend 'hf'``."""
        if self.kind == "rollout":
            return f"rollout backend '{self.backend}'"
        return f"backend '{self.backend}' at world_size={self.world_size}"

    def __getitem__(self, check: str) -> CheckOutcome:
        if check not in self.outcomes:
            raise KeyError(f"no check {check!r} in this report; it has {sorted(self.outcomes)}")
        return self.outcomes[check]

    @property
    def passed(self) -> bool:
        """Every check passed, was skipped or failed as declared (``xfailed``), and the run completed."""
        return self.error is None and all(
            o.status in ("passed", "skipped", "xfailed") for o in self.outcomes.values()
        )

    def summary(self) -> str:
        """One line per check, then the details of every check that did not pass."""
        lines = [f"conformance of {self.subject}:"]
        lines += [f"  {name:<24} {outcome.status}" for name, outcome in self.outcomes.items()]
        if self.error:
            lines.append(f"run error: {self.error}")
        lines += [o.describe() for o in self.outcomes.values() if o.status in ("failed", "error", "xfailed")]
        return "\n".join(lines)

    def expecting(self, declared: Mapping[str, str]) -> ConformanceReport:
        """This report with the backend's expected failures (``{check: reason}``, checked by
        ``expected_failures``) applied to the checks it ran."""
        outcomes = {
            name: outcome.expect_failure(declared[name]) if name in declared else outcome
            for name, outcome in self.outcomes.items()
        }
        return attrs.evolve(self, outcomes=outcomes)


@attrs.frozen
class Check:
    """A named check of a kit, with a one-line statement of what it proves (docs/conformance.md has
    more). ``run(context)`` (a ``RankContext`` for the engine kit, a ``RolloutContext`` for the
    rollout kit) yields its comparisons as it makes them (a list will do, but a check that raises
    then loses those it made)."""

    name: str
    run: Callable[[Any], Iterable[Comparison]]
    proves: str
