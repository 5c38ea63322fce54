"""AdamW, the LR schedule (against its formula written out), clipping and moving optimiser state."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.config.engine import EngineConfig, ModelConfig, OptimConfig
from verl_core.errors import ConfigError
from verl_core.toolkit import (
    TorchOptimizerSteps,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_and_step,
    lr_multiplier,
    move_optimizer_state,
)


def expected_lr(step: int, lr: float, warmup: int, schedule: str, total: int, min_ratio: float) -> float:
    """The schedule as documented: linear warmup to lr over ``warmup`` steps, then decay to min_ratio * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup) / (total - warmup))
    floor = min_ratio * lr
    if schedule == "linear":
        return floor + (lr - floor) * (1 - progress)
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@settings(max_examples=50, deadline=None)
@given(
    warmup=st.integers(min_value=0, max_value=6),
    decay=st.integers(min_value=1, max_value=12),
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
    min_ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    lr=st.sampled_from([1e-3, 0.5]),
)
def test_scheduler_follows_the_formula(warmup, decay, schedule, min_ratio, lr) -> None:
    config = OptimConfig(
        lr=lr,
        lr_warmup_steps=warmup,
        lr_scheduler=schedule,
        total_steps=warmup + decay,
        min_lr_ratio=min_ratio,
    )
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], config)
    scheduler = build_lr_scheduler(optimizer, config)
    for step in range(warmup + decay + 3):  # past total_steps the rate stays at its floor
        expected = expected_lr(step, lr, warmup, schedule, warmup + decay, min_ratio)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert lr_multiplier(step, config) * lr == pytest.approx(expected, rel=1e-12, abs=1e-15)
        optimizer.step()
        scheduler.step()
    if schedule != "constant":
        assert optimizer.param_groups[0]["lr"] == pytest.approx(min_ratio * lr)


def test_warmup_starts_learning_at_the_first_step() -> None:
    config = OptimConfig(lr=1.0, lr_warmup_steps=4)
    assert [lr_multiplier(step, config) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_adamw_takes_its_options_from_the_config() -> None:
    config = OptimConfig(lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2)
    group = build_optimizer([torch.nn.Parameter(torch.ones(3))], config).param_groups[0]
    assert isinstance(build_optimizer([torch.nn.Parameter(torch.ones(1))], config), torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.1, (0.8, 0.95), 1e-6, 0.2)


def test_a_decay_without_total_steps_names_the_key() -> None:
    with pytest.raises(
        ConfigError,
        match=r"optim\.total_steps: 0: lr_scheduler 'cosine' decays after the warmup until total_steps, which "
        r"must exceed lr_warmup_steps \(2\) \(0: the trainer sets it from the run's length",
    ):
        build_lr_scheduler(
            build_optimizer([torch.nn.Parameter(torch.ones(1))], OptimConfig()),
            OptimConfig(lr_scheduler="cosine", lr_warmup_steps=2, total_steps=0),
        )


def test_scheduler_state_loads_with_weights_only(tmp_path) -> None:
    config = OptimConfig(lr=1.0, lr_scheduler="linear", total_steps=10)
    optimizer = build_optimizer([torch.nn.Parameter(torch.ones(1))], config)
    scheduler = build_lr_scheduler(optimizer, config)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    fresh_optimizer = build_optimizer([torch.nn.Parameter(torch.ones(1))], config)
    fresh = build_lr_scheduler(fresh_optimizer, config)
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert fresh.get_last_lr() == scheduler.get_last_lr() == [pytest.approx(0.7)]


@pytest.mark.parametrize("clip_grad", [0.0, 0.5, 100.0])
def test_clip_reports_the_norm_before_clipping(clip_grad: float) -> None:
    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    first.grad = torch.tensor([1.0, -2.0, 2.0])
    second.grad = torch.tensor([[4.0, 0.0], [0.0, 0.0]])
    expected_norm = math.sqrt(1 + 4 + 4 + 16)  # 5
    gradients = [first.grad.clone(), second.grad.clone()]
    optimizer = torch.optim.SGD([first, second], lr=1.0)
    norm = clip_grad_norm_and_step(optimizer, [first, second], clip_grad)
    assert norm == pytest.approx(expected_norm)
    scale = min(1.0, clip_grad / expected_norm) if clip_grad > 0 else 1.0
    # SGD with lr 1: the parameters moved by exactly the (clipped) gradient.
    torch.testing.assert_close(first.detach(), -gradients[0] * scale, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second.detach(), -gradients[1] * scale, rtol=1e-5, atol=1e-6)


def test_non_finite_gradients_skip_the_step() -> None:
    parameter = torch.nn.Parameter(torch.ones(2))
    parameter.grad = torch.tensor([float("nan"), 1.0])
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    assert math.isnan(clip_grad_norm_and_step(optimizer, [parameter], clip_grad=1.0))
    torch.testing.assert_close(parameter.detach(), torch.ones(2))


def test_move_optimizer_state_keeps_step_counters() -> None:
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = build_optimizer([parameter], OptimConfig(lr=0.1))
    parameter.grad = torch.ones(2)
    optimizer.step()
    state = optimizer.state[parameter]
    before = {key: value.clone() for key, value in state.items()}
    move_optimizer_state(optimizer, "meta")  # a device that differs from cpu, available everywhere
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == "cpu" and torch.equal(state["step"], before["step"])


class _OptimizerOnly(TorchOptimizerSteps):
    def __init__(self, config: EngineConfig, parameters: list[torch.nn.Parameter] | None):
        self.config = config
        self.optimizer = build_optimizer(parameters, config.optim) if parameters else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim) if parameters else None


def test_torch_optimizer_steps_clip_step_and_schedule_like_plain_torch():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    reference = torch.nn.Parameter(weight.detach().clone())
    optim = OptimConfig(lr=0.1, clip_grad=0.5, lr_warmup_steps=2, weight_decay=0.0)
    engine = _OptimizerOnly(EngineConfig(backend="x", model=ModelConfig(path="m"), optim=optim), [weight])
    reference_optimizer = torch.optim.AdamW([reference], lr=0.1, weight_decay=0.0)
    for parameter in (weight, reference):
        (parameter**2).sum().backward()

    assert engine.get_lr() == pytest.approx(0.1 / 2)  # warmup step 1 of 2
    grad_norm = engine.optimizer_step()
    for group in reference_optimizer.param_groups:
        group["lr"] = 0.1 / 2
    expected_norm = torch.nn.utils.clip_grad_norm_([reference], 0.5)
    reference_optimizer.step()

    assert grad_norm == pytest.approx(float(expected_norm))
    assert torch.equal(weight.detach(), reference.detach())
    assert engine.lr_scheduler_step() == pytest.approx(0.1)
    engine.optimizer_zero_grad()
    assert weight.grad is None


def test_torch_optimizer_steps_before_initialize_say_what_to_call():
    engine = _OptimizerOnly(EngineConfig(backend="x", model=ModelConfig(path="m")), None)
    with pytest.raises(RuntimeError, match="_OptimizerOnly is not initialised: call initialize"):
        engine.optimizer_step()
