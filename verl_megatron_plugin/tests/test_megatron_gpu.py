"""The CUDA paths of the Megatron engine: skipped without CUDA; ``scripts/gpu_check.py`` runs them on a
GPU machine, unpatched (no ``cpu_bridge``), with transformer-engine's layers where it is installed.

The conformance kit on CUDA (NCCL) at one rank exercises what the CPU cannot: ``to("cpu")`` and back
and ``param_offload`` / ``optimizer_offload`` (device memory freed, results bitwise unchanged).
"""

from __future__ import annotations

import pytest
import torch

from verl_core.testing import EngineConformance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class TestMegatronConformanceOnCUDA(EngineConformance):
    backend = "megatron"
    world_sizes = (1,)
    device = "cuda"
    options = {"transformer_impl": "auto"}
