"""On-policy distillation in the RL trainer (in process, on the demo's tiny model): the teachers' scores
against a plain forward pass of each teacher, the reverse-KL reward written out, routing by a data
column, a teacher on ranks of its own computing what a colocated one does, and every bad input refused
before start at its key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures.demo import build_teacher, plain_response_log_probs, run_overrides

from verl_core.config import load_config
from verl_core.data.batch import (
    CANDIDATE_IDS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    SCORES,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
    TOKEN_LEVEL_REWARDS,
)
from verl_core.errors import ConfigError
from verl_core.trainer.distillation import TEACHER_INDEX
from verl_core.trainer.preflight import check_run
from verl_core.trainer.rl import RLTrainer, outcome_rewards

torch.set_num_threads(1)

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def teachers(demo, tmp_path_factory):
    """Two teachers with the student's tokenizer (the demo model, its weights moved by seeded noise), and
    one with another vocabulary."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("teachers")
    folders = {name: build_teacher(demo, root / name, seed) for name, seed in (("a", 1), ("b", 2))}
    folders["other_vocabulary"] = root / "other_vocabulary"
    shutil.copytree(folders["a"], folders["other_vocabulary"])
    tokenizer = AutoTokenizer.from_pretrained(demo.model)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(folders["other_vocabulary"])
    return folders


def teacher_keys(name: str, path, **options) -> dict[str, object]:
    keys = {
        f"distillation.teachers.{name}.engine.backend": "ddp",
        f"distillation.teachers.{name}.engine.model.path": str(path),
        f"distillation.teachers.{name}.engine.device": "cpu",
    }
    return keys | {f"distillation.teachers.{name}.{key}": value for key, value in options.items()}


def distilled_run(demo, tmp_path, **changes):
    """One GRPO step that distills, its batch kept (``RLTrainer.last_batch``)."""
    values = {"trainer.total_training_steps": 1, "rollout.temperature": TEMPERATURE} | changes
    trainer = RLTrainer.from_config(
        load_config([], run_overrides(demo, tmp_path, **values)), show_progress=False
    )
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    return trainer.last_batch, metrics


def plain_log_probs(model_path, batch) -> torch.Tensor:
    """The teacher's log-probs of the responses from a plain forward pass of its Hugging Face model."""
    every = plain_response_log_probs(model_path, batch, TEMPERATURE)
    return every.gather(-1, batch[RESPONSES].unsqueeze(-1)).squeeze(-1) * batch[RESPONSE_MASK]


def test_reverse_kl_rewards_are_the_teachers_log_probs_minus_the_students(demo, teachers, tmp_path):
    coef, task = 0.5, 2.0
    batch, metrics = distilled_run(
        demo,
        tmp_path,
        **teacher_keys("a", teachers["a"]),
        **{"distillation.coef": coef, "distillation.task_reward_coef": task},
    )
    expected_teacher = plain_log_probs(teachers["a"], batch)
    assert torch.allclose(batch[TEACHER_LOG_PROBS], expected_teacher, atol=1e-5)
    mask = batch[RESPONSE_MASK]
    expected = (
        task * outcome_rewards(batch[SCORES], mask) + coef * (expected_teacher - batch[OLD_LOG_PROBS]) * mask
    )
    assert torch.allclose(batch[TOKEN_LEVEL_REWARDS], expected, atol=1e-5)
    log_ratio = ((batch[OLD_LOG_PROBS] - expected_teacher) * mask).sum() / mask.sum()
    assert metrics["distillation/reverse_kl"] == pytest.approx(float(log_ratio), abs=1e-5)
    assert metrics["timing/teachers"] > 0


def test_rows_go_to_the_teacher_their_column_names(demo, teachers, tmp_path):
    rows = [json.loads(line) for line in demo.train.read_text().splitlines()]
    routed = tmp_path / "routed.jsonl"
    routed.write_text(
        "".join(json.dumps(row | {"teacher": "ab"[i % 2]}) + "\n" for i, row in enumerate(rows))
    )
    batch, metrics = distilled_run(
        demo,
        tmp_path,
        **teacher_keys("a", teachers["a"]),
        **teacher_keys("b", teachers["b"]),
        **{"distillation.route_by": "teacher", "data.train_files": f"[{routed}]", "data.shuffle": "false"},
    )
    routes = batch[TEACHER_INDEX]
    assert set(routes.tolist()) == {0, 1}
    for index, name in enumerate("ab"):
        rows = routes == index
        expected = plain_log_probs(teachers[name], batch[rows])
        assert torch.allclose(batch[TEACHER_LOG_PROBS][rows], expected, atol=1e-5), name
    assert "distillation/a/reverse_kl" in metrics and "distillation/b/reverse_kl" in metrics


def test_a_teacher_on_ranks_of_its_own_computes_what_a_colocated_one_does(demo, teachers, tmp_path):
    colocated, _ = distilled_run(demo, tmp_path / "colocated", **teacher_keys("a", teachers["a"]))
    separate, _ = distilled_run(
        demo, tmp_path / "separate", **teacher_keys("a", teachers["a"], placement="separate")
    )
    for key in (TEACHER_LOG_PROBS, TOKEN_LEVEL_REWARDS):
        assert torch.equal(colocated[key], separate[key]), key


# -- bad input, refused before start ---------------------------------------------------------------


def problems(demo, tmp_path, **changes) -> dict[str, str]:
    """The pre-flight problems of a distilling run's config (load_config's own errors included)."""
    try:
        config = load_config([], run_overrides(demo, tmp_path, **changes))
    except ConfigError as error:
        return dict(error.errors)
    return dict(check_run(config, "rl"))


def test_a_missing_teacher_model_is_refused_at_its_path(demo, tmp_path):
    found = problems(demo, tmp_path, **teacher_keys("big", tmp_path / "nowhere"))
    assert "nowhere" in found["distillation.teachers.big.engine.model.path"]


def test_a_teacher_with_another_vocabulary_is_refused(demo, teachers, tmp_path):
    found = problems(demo, tmp_path, **teacher_keys("t", teachers["other_vocabulary"]))
    message = found["distillation.teachers.t.engine.model.path"]
    assert (
        "the teacher's tokenizer is not the student's" in message
        and "tokens against the student's" in message
    )
    assert "cross-tokenizer distillation is not supported" in message


def test_top_k_must_be_positive_for_gkd_and_within_the_vocabulary(demo, teachers, tmp_path):
    found = problems(demo, tmp_path, **teacher_keys("t", teachers["a"]), **{"distillation.loss": "gkd"})
    assert "set top_k" in found["distillation.teachers.t.top_k"]
    found = problems(demo, tmp_path, **teacher_keys("t", teachers["a"], top_k=-1))
    assert "distillation.teachers.t.top_k" in found
    found = problems(
        demo, tmp_path, **teacher_keys("t", teachers["a"], top_k=100_000), **{"distillation.loss": "gkd"}
    )
    assert "more than the teacher's vocabulary" in found["distillation.teachers.t.top_k"]


def test_routing_needs_a_column_every_row_has_naming_a_teacher(demo, teachers, tmp_path):
    two = teacher_keys("a", teachers["a"]) | teacher_keys("b", teachers["b"])
    assert "required with several teachers" in problems(demo, tmp_path, **two)["distillation.route_by"]
    found = problems(demo, tmp_path, **two, **{"distillation.route_by": "teacher"})
    assert "has no column 'teacher'" in found["distillation.route_by"]
    rows = [json.loads(line) for line in demo.train.read_text().splitlines()]
    routed = tmp_path / "routed.jsonl"
    routed.write_text("".join(json.dumps(row | {"teacher": "c"}) + "\n" for row in rows))
    found = problems(
        demo, tmp_path, **two, **{"distillation.route_by": "teacher", "data.train_files": f"[{routed}]"}
    )
    assert "routes to 'c', which is not a teacher" in found["distillation.route_by"]


def test_gkd_trains_on_the_teachers_top_k_and_reports_the_divergence(demo, teachers, tmp_path):
    """The teacher's top-k against its plain forward pass; the update's divergence against GKD written
    out from the student's and the teacher's plain forward passes (the update's forward is the first
    optimiser step's: the student before it)."""
    from test_algos_distillation import jsd_reference

    k, beta = 4, 0.3
    batch, metrics = distilled_run(
        demo,
        tmp_path,
        **teacher_keys("a", teachers["a"], top_k=k),
        **{"distillation.loss": "gkd", "distillation.beta": beta, "distillation.task_reward_coef": 0.0},
    )
    mask = batch[RESPONSE_MASK].bool()
    values, ids = plain_response_log_probs(teachers["a"], batch, TEMPERATURE).topk(k, dim=-1)
    assert torch.allclose(batch[TEACHER_TOP_K_LOG_PROBS][mask], values[mask], atol=1e-5)
    assert torch.equal(batch[TEACHER_TOP_K_IDS][mask], ids[mask])
    assert torch.equal(batch[CANDIDATE_IDS], batch[TEACHER_TOP_K_IDS])
    assert torch.count_nonzero(batch[TOKEN_LEVEL_REWARDS]) == 0  # task_reward_coef 0: GKD alone
    assert metrics["actor/grad_norm"] > 0  # which moves the student by itself
    student_at_ids = plain_response_log_probs(demo.model, batch, TEMPERATURE).gather(-1, ids)
    # The metric is each micro-batch's token mean (4 rows each, in batch order), averaged over them.
    per_micro_batch = []
    for rows in torch.arange(mask.shape[0]).split(4):
        divergences = [
            jsd_reference(student_at_ids[i, t].tolist(), values[i, t].tolist(), beta)
            for i in rows.tolist()
            for t in mask[i].nonzero().squeeze(-1).tolist()
        ]
        per_micro_batch.append(sum(divergences) / len(divergences))
    assert metrics["distillation/jsd"] == pytest.approx(sum(per_micro_batch) / len(per_micro_batch), rel=1e-4)
