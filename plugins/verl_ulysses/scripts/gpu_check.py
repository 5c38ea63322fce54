"""Prove the ulysses engine's CUDA paths on a GPU machine: ``python plugins/verl_ulysses/scripts/gpu_check.py``.

Runs ``tests/test_gpu.py`` (marked ``gpu``, skipped on CPU-only machines): the conformance kit on one
GPU (FSDP2 over NCCL, meta-device init on the GPU, offload between GPU and CPU), and on two GPUs or
more the kit at sp=2 and the 2-rank job (sp=2 against plain PyTorch with the broken variants, meta
init, checkpoints across layouts, HSDP, bf16) with the all-to-alls on NCCL. Exits non-zero when CUDA
or NCCL is missing (nothing would be proved) or when any check fails; says so when only one GPU
leaves the sequence-parallel paths unproved. Needs the editable installs of verl-core and this plugin
(``pip install -e .[test] -e plugins/verl_ulysses``). A few minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_gpu.py"


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run this on a GPU machine", file=sys.stderr)
        return 2
    if not dist.is_nccl_available():
        print("gpu_check: this torch build has no NCCL", file=sys.stderr)
        return 2
    count = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(index) for index in range(count)]
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {names}")
    if count < 2:
        print("gpu_check: one GPU: sp=2 (NCCL all-to-alls) needs two and is skipped; only sp=1 is proved")
    # -s: the sp=2 job prints its measured differences; -p no:cacheprovider: nothing left in the checkout.
    return int(pytest.main([str(TESTS), "-m", "gpu", "-v", "-rs", "-s", "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
