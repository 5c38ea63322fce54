"""Device selection and in-place offload of a module's parameters and gradients."""

from __future__ import annotations

import pytest
import torch

from verl_core.engine import resolve_device
from verl_core.engine.device import device_type
from verl_core.errors import ConfigError
from verl_core.toolkit import move_module


def test_auto_picks_cuda_only_when_available() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device_type("auto") == resolve_device("auto").type == expected
    assert device_type("cuda:1") == "cuda" and resolve_device("cpu") == torch.device("cpu")


def test_bad_device_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"engine\.device: 'gpu0' is not a device .*use auto, cpu or cuda"):
        device_type("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"engine\.device: 'cuda' needs CUDA, which is not available here"):
        resolve_device("cuda")


needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize(("parameters", "gradients"), [(True, True), (True, False), (False, True)])
def test_move_module_keeps_parameter_objects(target: str, parameters: bool, gradients: bool) -> None:
    module = torch.nn.Linear(3, 2)
    module.register_buffer("scale", torch.full((2,), 3.0))
    module(torch.ones(1, 3)).sum().backward()
    identities = [id(p) for p in module.parameters()]
    values = [p.detach().clone() for p in module.parameters()]
    gradients_before = [p.grad.clone() for p in module.parameters()]
    move_module(module, target, parameters=parameters, gradients=gradients)
    assert [id(p) for p in module.parameters()] == identities  # the optimiser's references stay valid
    assert {p.device.type for p in module.parameters()} == {target if parameters else "cpu"}
    assert module.scale.device.type == (target if parameters else "cpu")
    assert {p.grad.device.type for p in module.parameters()} == {target if gradients else "cpu"}
    for parameter, value, gradient in zip(module.parameters(), values, gradients_before, strict=True):
        assert torch.equal(parameter.detach().cpu(), value) and torch.equal(parameter.grad.cpu(), gradient)
    move_module(module, "cpu")
    assert (
        {p.device.type for p in module.parameters()}
        == {p.grad.device.type for p in module.parameters()}
        == {"cpu"}
    )
