"""The Megatron engine's parallel layouts against each other and the single-process Hugging Face
reference, on spawned gloo ranks (the runs live in ``megatron_jobs.py``).

The model is the kit's tiny Qwen2 with 4 layers (so that 2 stages x 2 virtual chunks divide them)
and an odd vocabulary (129: padded to 130 rows at TP=2),
the data the kit's batches A and B, each DP rank training on its share; the micro-batch size differs
between layouts on purpose: nothing may depend on the micro-batch count, TP, PP or DP.

Three spawns in all: the runs at two ranks (layouts, a TP=2 checkpoint, the broken variants) in one,
those at one rank (the baseline, the TP=2 checkpoint reloaded, a broken variant) in another, and
TP=2 x PP=2 at four ranks. Against the ``fsdp`` backend the engine is not compared directly: both
match the same single-process reference (here ``test_one_rank_equals_the_hugging_face_reference``
and ``test_parallel_layouts_equal_one_rank``; for fsdp the conformance kit's ``first_step``,
``lr_schedule`` and ``checkpoint`` checks in verl_fsdp_plugin/tests/test_conformance.py).
"""

from __future__ import annotations

import pytest
import torch

from verl_core.testing import reference
from verl_core.testing.checks import BASE_OPTIM, OUTPUT_TOLERANCE, STEP_PARAM_TOLERANCE
from verl_core.testing.losses import TEMPERATURE
from verl_core.testing.tiny import (
    ModelDirs,
    TinyModelSpec,
    collate,
    make_samples,
    response_token_mask,
    save_tiny_models,
)

pytestmark = pytest.mark.distributed

#: fp32 loss and grad norm of two steps, against the reference and across layouts.
SCALAR_TOLERANCE = {"abs": 1e-6, "rel": 1e-5}

#: name -> (world size, job arguments): every layout trains the same two steps. TP=2 and PP=2 alone
#: run the whole conformance kit (test_conformance.py); these are the layouts it does not cover.
LAYOUTS = {
    "pp2_vpp2": (
        2,
        {
            "options": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "micro_batch_size": 2,
        },
    ),
    "dp2_distributed_optimizer_recompute": (
        2,
        {
            "options": {"use_distributed_optimizer": True},
            "micro_batch_size": 2,
            "gradient_checkpointing": True,
        },
    ),
    "tp2_pp2": (
        4,
        {
            "options": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "micro_batch_size": 3,
        },
    ),
}
TP2 = {"tensor_model_parallel_size": 2}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def model(workdir) -> ModelDirs:
    # 129 tokens: TP=2 pads megatron-core's vocabulary to 130 rows (the batches use 128).
    return save_tiny_models(workdir / "model", TinyModelSpec(num_hidden_layers=4, vocab_size=129))


@pytest.fixture(scope="module")
def reference_steps(model):
    batches = [make_samples(seed, share_prompts=seed == 1) for seed in (1, 2)]
    return reference.reference_steps(model.lm, "lm", batches, BASE_OPTIM, TEMPERATURE)


def steps(model, name, **kwargs) -> tuple[str, dict]:
    """A ``steps`` job of ``megatron_jobs``: two training steps, named ``name``."""
    return "steps", {"name": name, "model": model.lm, "backend": "megatron", "micro_batch_size": 2, **kwargs}


@pytest.fixture(scope="module")
def at_two_ranks(megatron_jobs, workdir, model) -> dict:
    """Every run at two ranks, by name, in one spawn."""
    jobs = [steps(model, name, **kwargs) for name, (world_size, kwargs) in LAYOUTS.items() if world_size == 2]
    jobs += [
        # PP=2 with 4 micro-batches of 3: the gradients come out a quarter (the reported loss is read
        # before the schedule's division, so the grad norm is what shows it).
        steps(
            model,
            "broken_averaging",
            options={"pipeline_model_parallel_size": 2},
            micro_batch_size=3,
            broken="schedule_averaging_kept",
        ),
        steps(model, "broken_tp_tags", options=TP2, micro_batch_size=1, broken="untagged_tp_parameters"),
        (
            "infer",
            {"name": "tp2_saving", "model": model.lm, "options": TP2, "train": True, "save": "ckpt_tp2"},
        ),
    ]
    return megatron_jobs.spawn_in_turn(2, workdir, jobs)


@pytest.fixture(scope="module")
def at_one_rank(megatron_jobs, workdir, model, at_two_ranks) -> dict:
    """Every run at one rank, by name, in one spawn (after ``at_two_ranks``: one reloads its checkpoint)."""
    jobs = [
        steps(model, "tp1"),
        ("infer", {"name": "tp1_loading", "model": model.lm, "load": "ckpt_tp2"}),
        ("infer", {"name": "broken_qkv", "model": model.lm, "broken": "qkv_not_grouped"}),
    ]
    return megatron_jobs.spawn_in_turn(1, workdir, jobs)


@pytest.fixture(scope="module")
def baseline(at_one_rank):
    """TP=1, PP=1 on one rank."""
    return at_one_rank["tp1"]


def assert_same_steps(actual, expected, against: str) -> None:
    for number, (mine, theirs) in enumerate(zip(actual["steps"], expected["steps"], strict=True), start=1):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], **SCALAR_TOLERANCE), (
                f"step {number} {key} vs {against}"
            )
    assert list(actual["params"]) == list(expected["params"])
    for name, tensor in actual["params"].items():
        difference = float((tensor - expected["params"][name]).abs().max())
        assert difference <= STEP_PARAM_TOLERANCE.atol, (
            f"{name} after 2 steps differs from {against} by {difference}"
        )


def as_job_result(steps_: list) -> dict:
    return {
        "steps": [{"loss": s.loss, "grad_norm": s.grad_norm} for s in steps_],
        "params": steps_[-1].params,
    }


def test_one_rank_equals_the_hugging_face_reference(baseline, reference_steps):
    assert_same_steps(baseline, as_job_result(reference_steps), "the single-process Hugging Face reference")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_equal_one_rank(megatron_jobs, workdir, model, at_two_ranks, baseline, layout):
    world_size, kwargs = LAYOUTS[layout]
    if world_size == 2:
        result = at_two_ranks[layout]
    else:
        job, job_kwargs = steps(model, layout, **kwargs)
        result = megatron_jobs.spawn(job, world_size, workdir, **job_kwargs)
    assert_same_steps(result, baseline, "TP=1 PP=1 on one rank")


# -- broken variants: what the comparisons above catch ------------------------------------------------


def test_a_loss_left_averaged_over_micro_batches_is_caught(at_two_ranks, baseline):
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_steps(at_two_ranks["broken_averaging"], baseline, "TP=1 PP=1 on one rank")


def test_untagged_tensor_parallel_parameters_give_a_wrong_grad_norm(at_two_ranks, baseline):
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_steps(at_two_ranks["broken_tp_tags"], baseline, "TP=1 PP=1 on one rank")


# -- checkpoints across layouts and weight layouts --------------------------------------------------------


def reference_outputs(model: ModelDirs) -> dict[str, torch.Tensor]:
    hf_model = reference.load_reference_model(model.lm, "lm")
    return reference.reference_outputs(hf_model, make_samples(2), "lm", TEMPERATURE)


def max_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    mask = response_token_mask(collate(make_samples(2)))
    return max(float(((actual[k] - expected[k]).abs() * mask).max()) for k in ("log_probs", "entropy"))


def test_tp2_outputs_and_a_tp2_checkpoint_reloaded_at_tp1(model, at_two_ranks, at_one_rank):
    saved = at_two_ranks["tp2_saving"]
    assert max_difference(saved["initial"], reference_outputs(model)) <= OUTPUT_TOLERANCE.atol
    loaded = at_one_rank["tp1_loading"]
    assert max_difference(loaded["initial"], saved["trained"]) <= OUTPUT_TOLERANCE.atol
    # ... and the step did change them: the load restored trained weights, not the initial ones.
    assert max_difference(loaded["initial"], saved["initial"]) > 1e-4


def test_a_qkv_layout_not_grouped_by_query_group_is_caught(model, at_one_rank):
    assert max_difference(at_one_rank["broken_qkv"]["initial"], reference_outputs(model)) > 1e-3
