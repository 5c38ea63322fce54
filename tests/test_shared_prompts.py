"""Shared prompts as an engine capability: ``micro_batch.share_prompts`` follows the backend's
``EngineBackend(shared_prompts=...)``, and what cannot share is refused at the key before anything
starts. (The computation itself: tests/test_engine_packing.py; the kit's check and its broken engines:
tests/test_conformance_kit.py.)"""

from __future__ import annotations

import pytest
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig
from verl_core.engine.factory import build_engine
from verl_core.errors import ConfigError
from verl_core.trainer.preflight import check_run


def engine_config(path: str, backend: str = "ddp", **micro_batch) -> EngineConfig:
    return EngineConfig(
        backend=backend,
        model=ModelConfig(path=path),
        micro_batch=MicroBatchConfig(micro_batch_size=4, **micro_batch),
        device="cpu",
    )


@pytest.mark.parametrize(("asked", "resolved"), [(None, True), (True, True), (False, False)])
def test_a_backend_that_declares_it_shares_prompts_unless_told_not_to(demo, asked, resolved) -> None:
    config = engine_config(str(demo.model), share_prompts=asked)
    engine = build_engine(config, "lm", config_path="actor.engine")
    assert engine.config.micro_batch.share_prompts is resolved
    assert config.micro_batch.share_prompts is asked  # the caller's config is left as it was


def test_sharing_asked_of_a_backend_that_cannot_is_refused_at_the_key(demo, tmp_path) -> None:
    with pytest.raises(ConfigError) as error:  # when the engine is built, before any model loads
        build_engine(
            engine_config(str(demo.model), "megatron", share_prompts=True), config_path="actor.engine"
        )
    ((path, message),) = error.value.errors
    assert path == "actor.engine.micro_batch.share_prompts"
    assert "does not declare EngineBackend(shared_prompts=True)" in message
    assert "'ddp'" in message and "'fsdp'" in message  # the backends that share, to pick from
    changes = {"actor.engine.backend": "megatron", "actor.engine.micro_batch.share_prompts": "true"}
    problems = dict(check_run(load_config([], run_overrides(demo, tmp_path, **changes)), "rl"))
    assert "does not declare" in problems["actor.engine.micro_batch.share_prompts"]  # and before the run
    # Left to the backend, megatron simply packs nothing: no refusal.
    changes.pop("actor.engine.micro_batch.share_prompts")
    problems = dict(check_run(load_config([], run_overrides(demo, tmp_path, **changes)), "rl"))
    assert "actor.engine.micro_batch.share_prompts" not in problems


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        (
            {"actor.engine.micro_batch.packing": "false"},
            "actor.engine.micro_batch.share_prompts",
            "true needs packing: true",
        ),
        (
            {"actor.engine.model.attn_implementation": "flash_attention_2"},
            "actor.engine.micro_batch.share_prompts",
            "needs model.attn_implementation: sdpa, not 'flash_attention_2'",
        ),
    ],
)
def test_sharing_asked_where_the_layout_cannot_share_is_refused_at_the_key(
    demo, tmp_path, changes, key, words
):
    overrides = run_overrides(demo, tmp_path, **changes | {"actor.engine.micro_batch.share_prompts": "true"})
    with pytest.raises(ConfigError) as error:
        load_config([], overrides)
    assert any(path == key and words in message for path, message in error.value.errors), error.value.errors
