"""The CUDA paths of the ulysses engine: skipped without CUDA; ``scripts/gpu_check.py`` runs them on a
GPU machine.

On one GPU: the whole conformance kit with the model on CUDA (FSDP2 over a one-rank NCCL group, the
model built on meta and filled on the GPU, offload between GPU and CPU exercised). On two GPUs or more
(NCCL runs one rank per GPU, so sp=2 needs two): the kit at (dp 1, sp 2) with the all-to-alls and
gathers on NCCL, and the 2-rank job of ``test_ulysses.py`` on CUDA (sp=2 against plain PyTorch and the
broken variants, meta-device init, the checkpoint across layouts, HSDP, bf16, the head layouts).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from verl_core.testing import EngineConformance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="sp=2 needs two GPUs: NCCL runs one rank per GPU"
)


class TestUlyssesConformanceOnCUDA(EngineConformance):
    backend = "ulysses"
    world_sizes = (1,)
    device = "cuda"


@two_gpus
class TestSequenceParallelConformanceOnCUDA(EngineConformance):
    backend = "ulysses"
    world_sizes = (2,)
    options = {"sp_size": 2}
    device = "cuda"


@pytest.fixture(scope="module")
def cuda_job(ulysses_jobs, tmp_path_factory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("ulysses_cuda")
    ulysses_jobs.prepare(workdir)
    try:
        return ulysses_jobs.run("sp2", 2, workdir, device="cuda")
    except ulysses_jobs.JobFailed as error:
        pytest.fail(str(error), pytrace=False)


@two_gpus
@pytest.mark.parametrize(
    "prop", ["equivalence", "meta_init", "checkpoint_across_layouts", "other_layouts", "head_layouts"]
)
def test_sp2_job_on_cuda(cuda_job, prop) -> None:
    failures = "\n".join(
        f"rank {rank}: {r[prop]['error']}" for rank, r in enumerate(cuda_job) if r[prop]["error"] is not None
    )
    assert not failures, failures
    print(prop, cuda_job[0][prop]["figures"])  # the measured differences, for the record (-s)
