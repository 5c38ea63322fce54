"""What the ``vllm`` rollout refuses before any worker starts (``VLLMRollout.check_before_start``, run by
``verl-core config`` and ``train`` on the driver), each at its config key with the fix: on the demo's
assets, no engine started. Each case passed these checks before they existed and failed later, in a
worker: vLLM refused to start, cut responses short at ``max_model_len`` without a word, crawled
through a KV cache too small for the batch, or crashed in its attention kernel on the first step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from fixtures.demo import run_overrides

from verl_core.cli import main
from verl_core.config import load_config
from verl_core.trainer.preflight import check_run
from verl_vllm.plugin import INSTALL

if importlib.util.find_spec("vllm") is None:  # found without importing it: vLLM's import changes torch
    pytest.skip(f"vLLM is not installed: {INSTALL}", allow_module_level=True)

VLLM = {"rollout.backend": "vllm"}


def problems(demo, tmp_path, **changes) -> dict[str, str]:
    """The run's problems found before start-up, by key (the demo: 4 prompts x 4 responses of 16 + 6
    tokens a step, in process)."""
    config = load_config([], run_overrides(demo, tmp_path, **{**VLLM, **changes}))
    return dict(check_run(config, "rl"))


def test_a_config_vllm_can_run_passes(wide_demo, tmp_path, capsys) -> None:
    assert main(["config", *run_overrides(wide_demo, tmp_path, **VLLM)]) == 0
    assert "checked as a config for `verl-core train`" in capsys.readouterr().err


def test_verl_core_config_names_the_key_and_exits_2(wide_demo, tmp_path, capsys) -> None:
    overrides = run_overrides(wide_demo, tmp_path, **VLLM, **{"rollout.vllm.max_model_len": 20})
    assert main(["config", *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        "rollout.vllm.max_model_len: 20 tokens cannot hold rollout.prompt_length + rollout.response_length = "
        "22 tokens: set max_model_len >= 22"
    ) in err, err


def test_max_model_len_against_the_sequences_and_the_model(wide_demo, tmp_path) -> None:
    """The demo's model has 64 positions; a step's sequences have 16 + 6."""
    found = problems(wide_demo, tmp_path, **{"rollout.vllm.max_model_len": 100})
    assert list(found) == ["rollout.vllm.max_model_len"], found
    assert (
        "max_position_embeddings=64 (config.json), which vLLM refuses" in found["rollout.vllm.max_model_len"]
    )
    found = problems(wide_demo, tmp_path, **{"rollout.response_length": 60})
    assert list(found) == ["rollout.response_length"], found
    assert "76 tokens, more than the model's max_position_embeddings=64" in found["rollout.response_length"]


def test_a_kv_cache_too_small_for_one_ranks_share_of_a_step(wide_demo, tmp_path) -> None:
    """4 prompts x 8 responses of 22 tokens, each in a 128-token block of 512 bytes a token (2 layers x
    1 KV head x 32 dimensions x keys and values x 4 bytes): 2 MiB in one process, 1 MiB a rank at two."""
    small = {"rollout.vllm.kv_cache_megabytes": 1, "rollout.n": 8}
    found = problems(wide_demo, tmp_path, **small)
    assert list(found) == ["rollout.vllm.kv_cache_megabytes"], found
    assert found["rollout.vllm.kv_cache_megabytes"].startswith(
        "1 MiB holds 16 sequences of 22 tokens (128-token blocks, 512 bytes per token: 2 layers x 1 KV heads "
        "x 32 x 2 x 4 bytes), and each engine generates 32 at once"
    ), found
    assert found["rollout.vllm.kv_cache_megabytes"].endswith("set kv_cache_megabytes >= 2")
    assert problems(wide_demo, tmp_path, **small, **{"trainer.workers": "ray", "trainer.world_size": 2}) == {}


def test_what_vllms_cpu_backend_does_not_run(demo, wide_demo, tmp_path) -> None:
    """Blocks of 16 tokens, tensor parallelism, and the demo's own model (heads of 16 dimensions: vLLM
    started, then its attention kernel aborted the first step)."""
    assert list(problems(wide_demo, tmp_path, **{"rollout.vllm.block_size": 16})) == [
        "rollout.vllm.block_size"
    ]
    found = problems(wide_demo, tmp_path, **{"rollout.vllm.tensor_parallel_size": 2})
    assert found == {
        "rollout.vllm.tensor_parallel_size": "2: the rollout runs one vLLM CPU engine in each actor rank; set "
        "tensor_parallel_size=1"
    }
    found = problems(demo, tmp_path)
    assert list(found) == ["rollout.backend"], found
    assert (
        "this model's have 16 (hidden_size / num_attention_heads in config.json): use rollout.backend=hf"
        in (found["rollout.backend"])
    )


def test_a_cpu_engine_prefills_each_prompt_in_one_step(wide_demo, tmp_path) -> None:
    """A seeded prompt prefilled over two steps killed vLLM's CPU engine (test_vllm_rollout.py has the
    engine side); the demo's model has 64 positions, the engine's max_model_len by default."""
    found = problems(wide_demo, tmp_path, **{"rollout.vllm.engine_kwargs.enable_chunked_prefill": True})
    assert list(found) == ["rollout.vllm.engine_kwargs.enable_chunked_prefill"], found
    assert "'CPU Generator does not use offset'" in found["rollout.vllm.engine_kwargs.enable_chunked_prefill"]
    found = problems(wide_demo, tmp_path, **{"rollout.vllm.engine_kwargs.max_num_batched_tokens": 32})
    assert found == {
        "rollout.vllm.engine_kwargs.max_num_batched_tokens": "32 tokens a step cannot prefill a prompt of the "
        "engine's max_model_len=64 in one step, as vLLM's CPU build must: set it >= 64, or leave it out"
    }
    budget = {"rollout.vllm.engine_kwargs.max_num_batched_tokens": 32, "rollout.vllm.max_model_len": 32}
    assert problems(wide_demo, tmp_path, **budget) == {}


def test_an_architecture_vllm_cannot_load(wide_demo, tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(wide_demo.model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FooBarForCausalLM"]}))
    found = problems(wide_demo, tmp_path, **{"actor.engine.model.path": str(model)})
    assert list(found) == ["rollout.backend"], found
    assert "Model architectures ['FooBarForCausalLM'] are not supported" in found["rollout.backend"]
    assert found["rollout.backend"].endswith("use rollout.backend=hf, or a model vLLM supports")
    assert "Supported architectures" not in found["rollout.backend"]  # not the hundreds it supports


def test_engine_kwargs_vllm_does_not_take_and_those_the_rollout_sets(wide_demo, tmp_path) -> None:
    assert problems(wide_demo, tmp_path, **{"rollout.vllm.engine_kwargs.max_num_seqs": 8}) == {}
    found = problems(wide_demo, tmp_path, **{"rollout.vllm.engine_kwargs.no_such_arg": 1})
    assert found == {
        "rollout.vllm.engine_kwargs": "vLLM's EngineArgs refuses them: EngineArgs.__init__() got an unexpected "
        "keyword argument 'no_such_arg'"
    }
    from verl_core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        problems(wide_demo, tmp_path, **{"rollout.vllm.engine_kwargs.dtype": "float16"})
    assert dict(caught.value.errors)["rollout.vllm.engine_kwargs.dtype"].startswith(
        "the rollout sets dtype itself; use rollout.dtype instead"
    )


def test_a_dtype_vllm_refuses_on_this_device(wide_demo, tmp_path) -> None:
    from vllm.platforms import current_platform

    from verl_core.toolkit.model import DTYPES

    refused = [name for name, dtype in DTYPES.items() if dtype not in current_platform.supported_dtypes]
    for name in DTYPES:
        found = problems(wide_demo, tmp_path, **{"rollout.dtype": name})
        assert list(found) == (["rollout.dtype"] if name in refused else []), (name, found)
    if not refused:
        pytest.skip(
            f"vLLM runs {', '.join(DTYPES)} on this {current_platform.get_cpu_architecture().name} CPU: no dtype "
            "to see refused here (an Arm Mac without bf16 refuses bfloat16)"
        )
