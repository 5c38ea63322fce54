"""GRPO with ``rollout.backend=vllm``: two steps of the demo's run in one process (the ddp engine, the
vLLM engine beside it), the config checked by ``verl-core``'s own checks first. The rollout's
log-probs of the sampled tokens must be the training engine's, recomputed on the same weights, within
the tolerance the backend declares, at every step: after the first weight sync too.
"""

from __future__ import annotations

import gc
import importlib.util
import json

import pytest
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer
from verl_vllm.plugin import INSTALL

if importlib.util.find_spec("vllm") is None:  # found without importing it: vLLM's import changes torch
    pytest.skip(f"vLLM is not installed: {INSTALL}", allow_module_level=True)


def test_grpo_samples_with_vllm_what_the_engine_scores(wide_demo, tmp_path) -> None:
    import torch.distributed as dist

    from verl_core.plugins import get_registry
    from verl_vllm import rollout as vllm_rollout

    overrides = run_overrides(
        wide_demo,
        tmp_path,
        **{
            "rollout.backend": "vllm",
            "rollout.vllm.kv_cache_megabytes": 64,
            "rollout.vllm.block_size": 32,
            "trainer.recompute_old_log_probs": "true",  # the engine's log-probs beside the rollout's
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
        del trainer
        gc.collect()
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    declared = get_registry().get("rollout_backends", "vllm").capabilities.log_prob_tolerance
    measured = [step["rollout/log_prob_diff_max"] for step in steps]
    print(f"\nrollout vs engine log-probs, max |difference| per step: {measured} (declared {declared:g})")
    assert len(measured) == 2 and max(measured) <= declared, measured
    assert all(step["reward/mean"] >= 0 for step in steps)
    # The trainer let the rollout go: its engine is shut down, with the process group vLLM made.
    assert not [r for r in vllm_rollout._ENGINES if r._shutdown.alive] and not dist.is_initialized()
