"""The CUDA path of the DDP engine: skipped without CUDA, run on a GPU machine when one is lent.

``python -m pytest plugins/verl_ddp/tests/test_gpu.py -m gpu`` proves, on one GPU: the conformance
checks with the model on CUDA (NCCL at one rank), and offload moving parameters, gradients and AdamW
state between CUDA and CPU around ``train_mode()`` while training still matches an engine that never
offloads.
"""

from __future__ import annotations

import pytest
import torch
from verl_core.config import EngineConfig, ModelConfig, OptimConfig
from verl_core.data import COMPUTE_ENTROPY
from verl_core.engine import build_engine
from verl_core.testing import EngineConformance
from verl_core.testing.losses import policy_loss_fn
from verl_core.testing.tiny import collate, make_samples, save_tiny_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class TestDDPConformanceOnCUDA(EngineConformance):
    backend = "ddp"
    world_sizes = (1,)
    device = "cuda"


def test_offload_round_trip_on_cuda(tmp_path) -> None:
    model_dir = save_tiny_models(tmp_path).lm
    batch = collate(make_samples(0))
    batch.set_non_tensor(COMPUTE_ENTROPY, True)  # the kit's policy loss has an entropy bonus

    def engine(offload: bool):
        config = EngineConfig(
            backend="ddp",
            model=ModelConfig(path=model_dir),
            optim=OptimConfig(lr=1e-3),
            device="cuda",
            param_offload=offload,
            optimizer_offload=offload,
        )
        built = build_engine(config)
        built.initialize()
        return built

    offloaded, resident = engine(offload=True), engine(offload=False)
    assert {p.device.type for p in offloaded.module.parameters()} == {"cpu"}
    for _ in range(2):  # the second step uses AdamW state that went to the CPU and back
        with offloaded.train_mode():
            assert {p.device.type for p in offloaded.module.parameters()} == {"cuda"}
            offloaded.train_batch(batch, policy_loss_fn)
        with resident.train_mode():
            resident.train_batch(batch, policy_loss_fn)
    state = next(iter(offloaded.optimizer.state.values()))
    assert state["exp_avg"].device.type == "cpu"
    assert {p.device.type for p in offloaded.module.parameters()} == {"cpu"}
    for (name, moved), (_, kept) in zip(
        offloaded.get_per_tensor_param(), resident.get_per_tensor_param(), strict=True
    ):
        torch.testing.assert_close(moved.cpu(), kept.cpu(), rtol=1e-5, atol=1e-6, msg=name)
