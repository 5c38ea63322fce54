"""Prove the FSDP engine's GPU-only paths on a CUDA machine: ``python verl_fsdp_plugin/scripts/gpu_check.py``.

Runs ``tests/test_fsdp_gpu.py`` (marked ``gpu``, skipped on CPU-only machines): the conformance kit on CUDA
with NCCL, bf16 mixed precision with fp32 reduction, ``cpu_offload`` with a ``cpu:gloo,cuda:nccl``
process group, and parameter/optimiser offload between GPU and CPU. Exits non-zero when CUDA is
missing (nothing would be proved) or when any check fails. Needs the editable installs of verl-core
and this plugin (``pip install -e .[test] -e verl_fsdp_plugin``). Takes about a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_fsdp_gpu.py"


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run this on a GPU machine", file=sys.stderr)
        return 2
    if not dist.is_nccl_available():
        print("gpu_check: this torch build has no NCCL", file=sys.stderr)
        return 2
    names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {names}")
    # -p no:cacheprovider: the check leaves nothing behind in the checkout.
    return int(pytest.main([str(TESTS), "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
