"""Partial rollouts (``async_training.partial_rollout``): responses still generating when newer weights
arrive are aborted and resumed under them. The reference is the model itself: each token's log-prob,
as the rollout reported it, is the log-prob a plain forward pass of the weights of its tagged version
gives; a resume that forgets to load the newer weights fails it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fixtures.demo import run_overrides
from transformers import AutoModelForCausalLM

from verl_core import RolloutBackend, hookimpl
from verl_core.config import load_config
from verl_core.data.batch import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS, ROLLOUT_POLICY_VERSIONS
from verl_core.errors import ConfigError
from verl_core.plugins import Registry
from verl_core.rollout import SamplingParams
from verl_core.rollout.buckets import weight_buckets
from verl_core.trainer.build import build_roles
from verl_core.workers.replicas import RolloutReplicas

torch.set_num_threads(1)

SEPARATE = {"rollout.placement": "separate", "async_training.mode": "one_step_off"}


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


def log_probs_under(
    weights: dict[str, torch.Tensor], model_dir, prompt: list[int], tokens: list[int]
) -> torch.Tensor:
    """The log-prob of each of ``tokens`` after ``prompt`` under ``weights``: a plain forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def serve_with_newer_weights(replicas: RolloutReplicas, prompts, newer_weights, *, forget_to_load=False):
    """Generate ``prompts`` resumably, offering ``newer_weights`` (version 1) once the first
    requests are in flight."""
    offered = []

    def newer():
        if offered:
            return None
        offered.append(True)
        buckets = list(weight_buckets(newer_weights.items(), 1 << 20))
        return 1, buckets

    if forget_to_load:  # a broken resume: tags the new version, generates with the old weights
        replicas.update_weights = lambda published, version: setattr(replicas, "version", version)
    sampling = SamplingParams(max_new_tokens=24, eos_token_ids=(0,), pad_token_id=0, temperature=1.0)
    return asyncio.run(replicas.generate_resumable(prompts, sampling, 7, newer))


def check_every_token_against_its_version(batch, prompts, weights_by_version, model_dir) -> list[set[int]]:
    seen = []
    for row, prompt in enumerate(prompts):
        mask = batch[RESPONSE_MASK][row].bool()
        tokens = batch[RESPONSES][row][mask].tolist()
        versions = batch[ROLLOUT_POLICY_VERSIONS][row][mask]
        reported = batch[ROLLOUT_LOG_PROBS][row][mask]
        assert versions.tolist() == sorted(versions.tolist())  # a response only moves to newer weights
        for version in versions.unique().tolist():
            expected = log_probs_under(weights_by_version[version], model_dir, list(prompt), tokens)
            at = versions == version
            torch.testing.assert_close(reported[at], expected[at].float(), atol=1e-4, rtol=0)
        seen.append(set(versions.tolist()))
    return seen


@pytest.fixture
def replicas(demo, tmp_path):
    config = load_config([], run_overrides(demo, tmp_path, **SEPARATE))
    roles = build_roles(config)
    yield roles.replicas
    roles.shutdown()


def test_requests_in_flight_resume_under_the_newer_weights_token_by_token(demo, replicas) -> None:
    original = AutoModelForCausalLM.from_pretrained(demo.model, dtype=torch.float32)
    newer = perturbed(original, seed=1)
    prompts = [[5 + i, 7, 9, 11] for i in range(4)]
    batch = serve_with_newer_weights(replicas, prompts, newer)
    seen = check_every_token_against_its_version(
        batch, prompts, {0: original.state_dict(), 1: newer}, demo.model
    )
    assert any(1 in versions for versions in seen)  # the move happened while responses were generating
    assert replicas.version == 1


def test_a_resume_that_keeps_the_old_weights_fails_the_reference(demo, replicas) -> None:
    original = AutoModelForCausalLM.from_pretrained(demo.model, dtype=torch.float32)
    newer = perturbed(original, seed=1)
    prompts = [[5 + i, 7, 9, 11] for i in range(4)]
    batch = serve_with_newer_weights(replicas, prompts, newer, forget_to_load=True)
    with pytest.raises(AssertionError):
        check_every_token_against_its_version(
            batch, prompts, {0: original.state_dict(), 1: newer}, demo.model
        )


def test_one_step_off_with_partial_rollouts_trains_and_no_sample_is_staler_than_the_mode(
    demo, tmp_path
) -> None:
    from verl_core.trainer.rl import RLTrainer

    overrides = run_overrides(
        demo,
        tmp_path,
        **SEPARATE | {"async_training.partial_rollout": "true", "trainer.total_training_steps": 3},
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    assert metrics["actor/grad_norm"] > 0 and metrics["async/staleness/max"] <= 1


class NoAbortPlugin:
    @hookimpl
    def verl_rollout_backends(self):
        return [
            RolloutBackend(
                name="no-abort",
                rollout="verl_core.rollout.hf:HFRollout",
                config="verl_core.rollout.config:HFRolloutConfig",
                api_version=2,
            )
        ]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rollout.backend": "no-abort"}, "rollout backend 'no-abort' does not declare abort_resume"),
        ({"rollout.agent.environment": "tools"}, "not available with multi-turn rollouts"),
    ],
)
def test_partial_rollouts_are_refused_where_they_cannot_resume(demo, tmp_path, changes, words) -> None:
    registry = Registry.from_plugins([NoAbortPlugin()])
    overrides = run_overrides(
        demo, tmp_path, **SEPARATE | {"async_training.partial_rollout": "true"} | changes
    )
    with pytest.raises(ConfigError) as error:
        load_config([], overrides, registry=registry)
    assert any(
        key == "async_training.partial_rollout" and words in message for key, message in error.value.errors
    )
