"""The CUDA paths of the FSDP engine: skipped without CUDA; ``scripts/gpu_check.py`` runs them on a GPU
machine.

On one GPU or more: the conformance checks with the model on CUDA (NCCL), and a job on
``min(2, GPUs)`` ranks with ``backend="cpu:gloo,cuda:nccl"`` proving bf16 compute with fp32
reduction, ``cpu_offload`` (shards and AdamW state on the CPU, compute on the GPU, trains like the
resident layout) and ``param_offload``/``optimizer_offload`` through ``train_mode()`` with exports
gathered from offloaded shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_core.testing import EngineConformance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class TestFSDPConformanceOnCUDA(EngineConformance):
    backend = "fsdp"
    world_sizes = (1,)
    device = "cuda"


@pytest.fixture(scope="module")
def cuda_job(fsdp_jobs, tiny_models) -> list[dict[str, str | None]]:
    world_size = min(2, torch.cuda.device_count())
    try:
        return fsdp_jobs.spawn("cuda", world_size, Path(tiny_models.lm).parents[1])
    except fsdp_jobs.JobFailed as error:
        pytest.fail(str(error), pytrace=False)


@pytest.mark.parametrize("prop", ["bf16_on_cuda", "cpu_offload_on_cuda", "param_offload_on_cuda"])
def test_cuda_property(fsdp_jobs, cuda_job, prop) -> None:
    failures = fsdp_jobs.failures(cuda_job, prop)
    assert not failures, failures
