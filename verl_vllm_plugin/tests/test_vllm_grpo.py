"""GRPO with ``rollout.backend=vllm``: two steps of the demo's run in one process (the ddp engine, the
vLLM engine beside it), the config checked by ``verl-core``'s own checks first. The rollout's
log-probs of the sampled tokens must be the training engine's, recomputed on the same weights, within
the tolerance the backend declares, at every step: after the first weight sync too. Then a run whose
engine dies at its third step: it stops naming the rank, and resumes from its last checkpoint.
"""

from __future__ import annotations

import gc
import importlib.util

import pytest
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer
from verl_core.trainer.run_files import METRICS_FILE, read_records
from verl_vllm.plugin import INSTALL

if importlib.util.find_spec("vllm") is None:  # found without importing it: vLLM's import changes torch
    pytest.skip(f"vLLM is not installed: {INSTALL}", allow_module_level=True)

#: The demo's run with the vllm rollout: a small engine (the demo's sequences fill few 32-token blocks).
VLLM = {"rollout.backend": "vllm", "rollout.vllm.kv_cache_megabytes": 64, "rollout.vllm.block_size": 32}


def test_grpo_samples_with_vllm_what_the_engine_scores(wide_demo, tmp_path) -> None:
    import torch.distributed as dist

    from verl_core.plugins import get_registry
    from verl_vllm import rollout as vllm_rollout

    # The engine's log-probs beside the rollout's.
    fit(run_overrides(wide_demo, tmp_path, **VLLM, **{"trainer.recompute_old_log_probs": "true"}))
    steps = read_records(tmp_path / "run" / METRICS_FILE)
    declared = get_registry().get("rollout_backends", "vllm").capabilities.log_prob_tolerance
    measured = [step["rollout/log_prob_diff_max"] for step in steps]
    print(f"\nrollout vs engine log-probs, max |difference| per step: {measured} (declared {declared:g})")
    assert len(measured) == 2 and max(measured) <= declared, measured
    assert all(step["reward/mean"] >= 0 for step in steps)
    # The trainer let the rollout go: its engine is shut down, with the process group vLLM made.
    assert not [r for r in vllm_rollout._ENGINES if r._shutdown.alive] and not dist.is_initialized()


def test_an_engine_that_dies_mid_run_stops_it_and_the_last_checkpoint_resumes(wide_demo, tmp_path) -> None:
    """The model's forward fails once step 3 generates (a device error, say): the run stops with the
    rollout's RolloutError naming the rank, step 2's checkpoint complete; the same run started again in
    this process (the error's traceback still holding the dead rollout) resumes from it and finishes."""
    from verl_core.errors import RolloutError
    from verl_core.trainer.checkpoints import complete_checkpoints

    overrides = run_overrides(
        wide_demo, tmp_path, **VLLM, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1}
    )

    with pytest.raises(RolloutError, match=r"the vLLM engine on rank 0 died while generating") as caught:
        fit(overrides, wrap_step=dying_at_step_3)
    assert "RuntimeError: injected: the device is gone" in str(caught.value)
    assert [step for step, _ in complete_checkpoints(tmp_path / "checkpoints")] == [1, 2]
    fit(overrides)
    assert [step for step, _ in complete_checkpoints(tmp_path / "checkpoints")] == [1, 2, 3]
    assert read_records(tmp_path / "run" / METRICS_FILE)[-1]["step"] == 3


def fit(overrides: list[str], wrap_step=None) -> None:
    """A trainer from ``overrides`` fitted, then shut down and collected (its vLLM engine with it, unless a
    traceback holds it); ``wrap_step(train_step, rollout)`` replaces its ``train_step`` first."""
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    if wrap_step is not None:
        trainer.train_step = wrap_step(trainer.train_step, trainer.actor.group.worker.rollout)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        del trainer
        gc.collect()


def dying_at_step_3(train_step, rollout):
    """``train_step`` that, at step 3, first makes the rollout's model fail every forward."""

    def break_forward(worker) -> None:
        def failing(*args, **kwargs):
            raise RuntimeError("injected: the device is gone")

        worker.model_runner.model.forward = failing

    def step(number: int):
        if number == 3:
            rollout.engine.collective_rpc(break_forward)
        return train_step(number)

    return step
