"""``trainer.reuse_freed_memory``: worker processes keep freed memory for the next allocation.

Observed, not assumed: a child process allocates and frees a 64 MiB tensor again and again, and the
minor page faults each allocation costs are counted (``getrusage``): glibc's default gives such a
block back to the OS on ``free``, so every allocation faults its pages anew; kept, the next one reuses
them. A variant that only raises the trim threshold (large blocks still ``mmap``'d) must fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.toolkit import allocator
from verl_core.trainer import build

pytestmark = pytest.mark.skipif(
    allocator._glibc() is None,
    reason="the allocator's settings are glibc's: this process's C library is not glibc",
)

BLOCK_PAGES = 64 * 1024 * 1024 // 4096

#: What each process runs first: nothing (glibc's default), the setting, or the broken variant.
SETUPS = {
    "default": "",
    "kept": "from verl_core.toolkit.allocator import keep_freed_memory; assert keep_freed_memory()",
    "trim threshold only": (
        "import ctypes; from verl_core.toolkit import allocator; "
        "assert ctypes.CDLL(None).mallopt(allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD_BYTES)"
    ),
}


def faults_per_allocation(setup: str) -> float:
    """Minor page faults per allocation of a 64 MiB tensor that is written and freed, in a new process."""
    script = textwrap.dedent(
        f"""
        import resource, torch
        {setup}
        def allocate():
            block = torch.empty(16 * 1024 * 1024)  # 64 MiB of float32
            block.fill_(1.0)  # touch every page
            del block
        allocate()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(8):
            allocate()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


def keeps_freed_memory(faults: float) -> bool:
    """Most of the block's pages reused (here an eighth still faults: 2,048 of 16,385)."""
    return faults < 0.25 * BLOCK_PAGES


def test_kept_memory_is_reused_without_page_faults_and_the_default_faults_every_time() -> None:
    faults = {name: faults_per_allocation(setup) for name, setup in SETUPS.items()}
    assert faults["default"] > 0.9 * BLOCK_PAGES, faults  # the default gives the block back each time
    assert keeps_freed_memory(faults["kept"]), faults
    assert not keeps_freed_memory(faults["trim threshold only"]), faults  # the broken variant is caught


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", "cpu", True), ("auto", "cuda", False), (True, "cuda", True), (False, "cpu", False)],
)
def test_auto_keeps_freed_memory_where_the_actor_runs_on_the_cpu(demo, tmp_path, setting, device, expected):
    config = load_config([], run_overrides(demo, tmp_path, **{"trainer.reuse_freed_memory": setting}))
    assert config.trainer.reuses_freed_memory(device) is expected


@pytest.mark.parametrize(("setting", "calls"), [("true", 1), ("false", 0)])
def test_each_worker_process_applies_the_setting_before_its_worker_starts(
    demo, tmp_path, monkeypatch, setting, calls
) -> None:
    applied = []
    monkeypatch.setattr(build, "keep_freed_memory", lambda: applied.append(True))
    config = load_config([], run_overrides(demo, tmp_path, **{"trainer.reuse_freed_memory": setting}))
    made = build.WorkerMaker(lambda config, registry: (config, registry, len(applied)), config, None)()
    assert len(applied) == calls and made[2] == calls  # before the worker was made
