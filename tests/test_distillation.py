"""On-policy distillation in the RL trainer (in process, on the demo's tiny model): the teachers' scores
against a plain forward pass of each teacher, the reverse-KL reward written out, routing by a data
column, a teacher on ranks of its own computing what a colocated one does, and every bad input refused
before start at its key."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from fixtures.demo import build_teacher, plain_response_log_probs, run_overrides

from verl_core.config import load_config
from verl_core.data.batch import (
    ADVANTAGES,
    CANDIDATE_IDS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    SCORES,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_K_IDS,
    TEACHER_TOP_K_LOG_PROBS,
    TOKEN_LEVEL_REWARDS,
    UID,
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


def grpo_advantages(scores: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO's advantages written out: each response's score against its group's mean, over the group's
    unbiased std (+1e-6), on every response token."""
    advantages = torch.zeros(mask.shape)
    for row in range(scores.shape[0]):
        group = scores[groups == groups[row]].double()
        advantages[row] = float((scores[row] - group.mean()) / (group.std() + 1e-6))
    return advantages * mask


@pytest.mark.parametrize("reverse_kl_as", ["advantage", "reward"])
def test_the_reverse_kl_joins_each_tokens_advantage_or_its_reward(demo, teachers, tmp_path, reverse_kl_as):
    """The teacher's log-probs against its plain forward pass; then ``coef * (log pi_teacher - log
    pi_student)`` on each sampled token added to the task's advantages (weighted by task_reward_coef)
    after GRPO, or to the task's rewards before it."""
    coef, task = 0.5, 2.0
    batch, metrics = distilled_run(
        demo,
        tmp_path,
        **teacher_keys("a", teachers["a"]),
        **{
            "distillation.coef": coef,
            "distillation.task_reward_coef": task,
            "distillation.reverse_kl_as": reverse_kl_as,
        },
    )
    expected_teacher = plain_log_probs(teachers["a"], batch)
    assert torch.allclose(batch[TEACHER_LOG_PROBS], expected_teacher, atol=1e-5)
    mask = batch[RESPONSE_MASK]
    signal = coef * (expected_teacher - batch[OLD_LOG_PROBS]) * mask
    task_rewards = outcome_rewards(batch[SCORES], mask)
    if reverse_kl_as == "advantage":
        assert torch.allclose(batch[TOKEN_LEVEL_REWARDS], task_rewards)
        expected = task * grpo_advantages(batch[SCORES], batch[UID], mask) + signal
        assert torch.allclose(batch[ADVANTAGES], expected, atol=1e-5)
    else:
        assert torch.allclose(batch[TOKEN_LEVEL_REWARDS], task * task_rewards + signal, atol=1e-5)
        summed = batch[TOKEN_LEVEL_REWARDS].sum(-1)  # GRPO's outcome: a response's rewards summed
        assert torch.allclose(batch[ADVANTAGES], grpo_advantages(summed, batch[UID], mask), atol=1e-4)
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
    assert torch.count_nonzero(batch[ADVANTAGES]) == 0  # task_reward_coef 0: GKD alone
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


def test_options_the_run_would_ignore_are_warned_about(demo, teachers, tmp_path):
    from verl_core.errors import ConfigWarning

    with pytest.warns(ConfigWarning, match="distillation.route_by: ignored: distillation.teachers is empty"):
        load_config([], run_overrides(demo, tmp_path, **{"distillation.route_by": "teacher"}))
    with pytest.warns(ConfigWarning, match="distillation.beta: ignored: it is GKD's"):
        load_config(
            [],
            run_overrides(demo, tmp_path, **teacher_keys("t", teachers["a"]), **{"distillation.beta": 0.9}),
        )
    with pytest.warns(
        ConfigWarning, match="distillation.teachers.t.top_k: ignored: distillation.loss reverse_kl"
    ):
        load_config([], run_overrides(demo, tmp_path, **teacher_keys("t", teachers["a"], top_k=8)))


@contextlib.contextmanager
def third_party_backend(tmp_path, name: str, **fields):
    """A registry that sees engine backend ``name`` of an installed third-party distribution (the
    ``acme_engines`` module: engines on core's toolkit), its descriptor with ``fields``."""
    from fixtures.fake_dist import THIRD_PARTY_ENGINES, backends_plugin, fake_distributions

    from verl_core.plugins.registry import Registry

    with fake_distributions(tmp_path) as dists:
        plugin = backends_plugin(
            name,
            engine="acme_engines:AcmeEngine",
            config="acme_engines:AcmeConfig",
            roles=("lm",),
            devices=("cpu",),
            **fields,
        )
        dists.add(
            f"{name}-engines",
            plugins={name: plugin},
            requires=("verl-core",),
            modules={"acme_engines": THIRD_PARTY_ENGINES},
        )
        yield Registry.from_plugins(autoload=True)


def test_a_third_party_engine_that_passes_the_top_k_check_serves_a_gkd_teacher(demo, teachers, tmp_path):
    """The engine of an installed third-party distribution (tests/test_conformance_kit.py holds it to
    the ``top_k_log_probs`` check) scores as the teacher: its top-k are the teacher's plain forward pass."""
    changes = teacher_keys("t", teachers["b"], top_k=5) | {
        "distillation.teachers.t.engine.backend": "acme",
        "distillation.loss": "gkd",
        "trainer.total_training_steps": 1,
        "rollout.temperature": TEMPERATURE,
    }
    with third_party_backend(tmp_path, "acme", top_k_log_probs=True) as registry:
        config = load_config([], run_overrides(demo, tmp_path, **changes), registry=registry)
        assert not list(check_run(config, "rl", registry))
        trainer = RLTrainer.from_config(config, registry=registry, show_progress=False)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    batch = trainer.last_batch
    mask = batch[RESPONSE_MASK].bool()
    values, ids = plain_response_log_probs(teachers["b"], batch, TEMPERATURE).topk(5, dim=-1)
    assert torch.allclose(batch[TEACHER_TOP_K_LOG_PROBS][mask], values[mask], atol=1e-5)
    assert torch.equal(batch[TEACHER_TOP_K_IDS][mask], ids[mask])


def test_gkd_is_refused_for_a_backend_that_does_not_return_top_k(demo, teachers, tmp_path):
    changes = teacher_keys("t", teachers["b"], top_k=5) | {
        "distillation.teachers.t.engine.backend": "plain",
        "distillation.loss": "gkd",
    }
    with third_party_backend(tmp_path, "plain") as registry:
        config = load_config([], run_overrides(demo, tmp_path, **changes), registry=registry)
        found = dict(check_run(config, "rl", registry))
    message = found["distillation.teachers.t.top_k"]
    assert (
        "engine backend 'plain'" in message
        and "does not declare EngineBackend(top_k_log_probs=True)" in message
    )
    assert "ddp" in message and "fsdp" in message  # the backends that do
