"""The ``ulysses`` backend against verl-core's engine conformance kit (docs/conformance.md), at the
issue's three layouts:

- (dp 1, sp 2) on 2 ranks: every check through the sequence-parallel path (one model replica whose
  two ranks split each micro-batch's tokens), ``dp_invariance`` skipped by the kit (one DP rank);
- (dp 2, sp 1) on 2 ranks: FSDP2 over two DP ranks with the model built on meta and filled from
  rank 0: the checks where this layout differs from the first (HF's own forward, a DP group that is
  the world);
- (dp 2, sp 2) on 4 ranks: DP groups {0, 2} and {1, 3} that exclude the SP ranks, outputs on ranks 0
  and 2: the checks that depend on that (DP invariance with unequal tokens per DP rank, the step and
  outputs, checkpoints and exports written once per job).

A spawn costs most of a run (imports on every rank: 70-80% of the 4-rank run), so the two cheaper
layouts skip the checks whose code path the first layout already covers; each skip says where.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from verl_core.testing import CHECKS, EngineConformance, assert_check, run_conformance


class SelectedConformance(EngineConformance):
    """``EngineConformance`` running only ``checks`` (None: all); the others are reported skipped with
    ``skip_reason``, never silently absent (a check added to the kit shows up as a skip to review)."""

    checks: ClassVar[tuple[str, ...] | None] = None
    skip_reason: ClassVar[str] = ""

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_report(cls, conformance_world_size: int) -> Any:
        unknown = sorted(set(cls.checks or ()) - set(CHECKS))
        if unknown:
            pytest.fail(f"{cls.__name__}.checks names no kit check: {unknown}")
        return run_conformance(
            cls.backend,
            conformance_world_size,
            options=cls.options,
            plugins=cls.plugins,
            autoload=cls.autoload,
            checks=cls.checks,
            device=cls.device,
            timeout_s=cls.timeout_s,
            expected_failed_checks=cls.expected_failed_checks,
        )

    def test_conformance(self, conformance_report: Any, conformance_check: str) -> None:
        if self.checks is not None and conformance_check not in self.checks:
            pytest.skip(self.skip_reason)
        assert_check(conformance_report, conformance_check)


class TestSequenceParallelConformance(EngineConformance):
    """(dp 1, sp 2): the whole kit."""

    backend = "ulysses"
    world_sizes = (2,)
    options = {"sp_size": 2}


class TestDataParallelConformance(SelectedConformance):
    """(dp 2, sp 1)."""

    backend = "ulysses"
    world_sizes = (2,)
    options = {"sp_size": 1}
    checks = (
        "log_probs",
        "values",
        "first_step",
        "packing",
        "dp_invariance",
        "checkpoint",
        "weight_export",
        "hf_export",
        "offload",
    )
    skip_reason = (
        "not run at (dp 2, sp 1): micro-batch splitting, chunked logits, top-k log-probs and the LR schedule are core's "
        "(run_micro_batches, forward_micro_batch) and the layout's FSDP units are those of the (dp 1, sp 2) "
        "and (dp 2, sp 2) runs, which check them"
    )


class TestDataAndSequenceParallelConformance(SelectedConformance):
    """(dp 2, sp 2) on 4 ranks."""

    backend = "ulysses"
    world_sizes = (4,)
    options = {"sp_size": 2}
    checks = (
        "log_probs",
        "first_step",
        "dp_invariance",
        "checkpoint",
        "weight_export",
        "hf_export",
        "offload",
    )
    skip_reason = (
        "not run at (dp 2, sp 2): the sequence-parallel forward with micro-batching, packing, chunked "
        "logits, top-k log-probs, the value role and the LR schedule run the same code on one SP group as at (dp 1, sp 2), "
        "which checks them"
    )
