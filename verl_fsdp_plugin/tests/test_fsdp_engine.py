"""What is FSDP-specific and the conformance kit does not look at: the sharded layout, resharding after
inference, one gradient reduction per step, mixed precision, CPU offload, lazy weight export, a
checkpoint saved at 2 ranks resumed at 1, and the Hugging Face export's config.

Three spawns in all (each costs ~10 s): a 2-rank job, a 1-rank job that resumes its checkpoint, and a
4-rank job for hybrid sharding (2 groups of 2).
The properties themselves live in ``fsdp_jobs.py`` (the rank side); each test here asserts one of them
on every rank, with the rank's traceback when it fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verl_core.config import EngineConfig, ModelConfig
from verl_core.engine import build_engine
from verl_core.testing.checks import SCHEDULE_OPTIM

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def workdir(tiny_models) -> Path:
    """Where the jobs find the tiny model (``<workdir>/model``) and leave their results."""
    return Path(tiny_models.lm).parents[1]


@pytest.fixture(scope="module")
def two_ranks(fsdp_jobs, workdir) -> list[dict[str, str | None]]:
    return run(fsdp_jobs, "two_ranks", 2, workdir)


@pytest.fixture(scope="module")
def four_ranks(fsdp_jobs, workdir) -> list[dict[str, str | None]]:
    return run(fsdp_jobs, "hsdp", 4, workdir)  # shard_size 2: two groups of two


@pytest.fixture(scope="module")
def one_rank(fsdp_jobs, workdir, two_ranks) -> list[dict[str, str | None]]:
    return run(fsdp_jobs, "one_rank", 1, workdir)  # resumes the checkpoint of the 2-rank job


def run(fsdp_jobs, job: str, world_size: int, workdir: Path) -> list[dict[str, str | None]]:
    try:
        return fsdp_jobs.spawn(job, world_size, workdir)
    except fsdp_jobs.JobFailed as error:
        pytest.fail(str(error), pytrace=False)


def assert_holds(fsdp_jobs, results: list[dict[str, str | None]], prop: str) -> None:
    failures = fsdp_jobs.failures(results, prop)
    assert not failures, failures


def test_each_decoder_layer_then_the_root_is_a_unit_with_real_buffers(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "layout")


def test_shards_are_registered_again_after_inference(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "shards_registered_after_inference")


def test_gradients_are_reduced_once_per_step_not_per_micro_batch(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "gradients_reduced_once_per_step")


def test_mixed_precision_computes_in_bf16_and_reduces_in_reduce_dtype(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "mixed_precision")


def test_cpu_offload_trains_exactly_like_the_default_layout(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "cpu_offload")


def test_shard_modules_selects_the_units(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "custom_units")


def test_engine_recovers_from_a_loss_that_raises_mid_step(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "recovers_from_a_failed_step")


def test_weight_export_gathers_one_tensor_at_a_time(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "export_gathers_one_tensor_at_a_time")


def test_checkpoint_saved_at_two_ranks_resumes_at_one(fsdp_jobs, two_ranks, one_rank) -> None:
    assert_holds(fsdp_jobs, two_ranks, "checkpoint_at_two_ranks")
    assert_holds(fsdp_jobs, one_rank, "resumes_checkpoint_of_two_ranks")


def test_sharded_engine_moves_parameters_and_gradients_together(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "refuses_moving_parameters_without_gradients")


def test_a_one_rank_group_runs_the_plain_model_unless_an_option_needs_fsdp(fsdp_jobs, one_rank) -> None:
    assert_holds(fsdp_jobs, one_rank, "one_rank_group_runs_unsharded")


def test_checkpoint_saved_at_two_ranks_loads_without_a_process_group(fsdp_jobs, workdir, two_ranks) -> None:
    """Without torch.distributed the engine runs the plain model, and still reads sharded checkpoints."""
    assert_holds(fsdp_jobs, two_ranks, "checkpoint_at_two_ranks")
    saved = torch.load(workdir / fsdp_jobs.SAVED_STATE, weights_only=False)
    config = EngineConfig(
        backend="fsdp",
        model=ModelConfig(path=str(workdir / "model" / "lm")),
        optim=SCHEDULE_OPTIM,
        device="cpu",
    )
    engine = build_engine(config)
    engine.initialize()
    assert engine.load_checkpoint(str(workdir / fsdp_jobs.CHECKPOINT)) == 1
    assert not engine.sharded and engine.get_lr() == saved["lr"]
    loaded = list(engine.get_per_tensor_param())
    assert [name for name, _ in loaded] == [name for name, _ in saved["weights"]]
    for (name, tensor), (_, expected) in zip(loaded, saved["weights"], strict=True):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
    for name, parameter in engine.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            expected = saved["optimizer"]["state"][name][key]
            torch.testing.assert_close(engine.optimizer.state[parameter][key], expected, rtol=0, atol=0)


def test_hf_export_names_the_model_class_not_the_fsdp_wrapper(fsdp_jobs, workdir, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "hf_export")
    export = workdir / fsdp_jobs.HF_EXPORT
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"], "the FSDP wrapper's class name leaked"
    assert sorted(p.name for p in export.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]


def test_load_on_rank0_reads_the_checkpoint_once_and_starts_bitwise_alike(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "load_on_rank0_starts_like_every_rank_loading")


def test_a_rank0_loader_that_forgets_the_buffers_is_caught(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "load_on_rank0_that_forgets_buffers_is_caught")


def test_keep_params_gathered_gathers_each_unit_once_per_step(fsdp_jobs, two_ranks) -> None:
    assert_holds(fsdp_jobs, two_ranks, "keep_params_gathered_gathers_once_per_step")


def test_hsdp_replicates_across_groups_and_shards_within(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "hsdp_layout")


def test_hsdp_2x2_matches_the_single_process_loss_and_gradients(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "hsdp_matches_the_single_process_reference")


def test_hsdp_averaging_gradients_within_groups_is_caught(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "hsdp_averaging_within_groups_is_caught")


def test_hsdp_checkpoint_loads_into_a_one_dimensional_mesh(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "hsdp_checkpoint_loads_into_plain_fsdp")


def test_hsdp_with_load_on_rank0_starts_bitwise_alike(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "hsdp_load_on_rank0_starts_like_every_rank_loading")


def test_shard_size_that_does_not_divide_the_ranks_names_the_key(fsdp_jobs, four_ranks) -> None:
    assert_holds(fsdp_jobs, four_ranks, "shard_size_must_divide_the_ranks")
