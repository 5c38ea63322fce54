"""The RL trainer in process: GRPO and PPO steps on the demo's tiny model, what each phase computes,
exact resume from a checkpoint, and a crash during a save that leaves the previous resume point."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.demo import build_small_demo, run_overrides

from verl_core.config import load_config
from verl_core.data.batch import OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from verl_core.errors import ConfigError
from verl_core.toolkit.checkpoint import MARKER_FILE
from verl_core.trainer import checkpoints
from verl_core.trainer.rl import RLTrainer, outcome_rewards

torch.set_num_threads(1)


def trainer_for(demo, tmp_path, **changes) -> RLTrainer:
    config = load_config([], run_overrides(demo, tmp_path, **changes))
    return RLTrainer.from_config(config, show_progress=False)


def metrics_lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_outcome_rewards_sit_on_each_responses_last_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    rewards = outcome_rewards(torch.tensor([0.5, -1.0, 2.0]), mask)
    assert rewards.tolist() == [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 2.0]]


def test_two_grpo_steps_train_and_log(demo, tmp_path) -> None:
    trainer = trainer_for(demo, tmp_path, **{"trainer.test_freq": 1})
    recomputed = []
    compute = trainer.actor.compute_log_probs
    trainer.actor.compute_log_probs = lambda batch: recomputed.append(len(batch)) or compute(batch)
    final = trainer.fit()
    lines = metrics_lines(tmp_path)
    assert [line["step"] for line in lines] == [0, 1, 2]  # step 0: the validation before training
    for line in lines[1:]:
        assert 0.0 <= line["reward/mean"] <= 1.0
        assert line["actor/grad_norm"] is not None and line["actor/grad_norm"] > 0
        assert line["timing/generate"] > 0 and "val/score/mean" in line
    assert final["actor/lr"] == pytest.approx(1e-3)
    # One mini-batch, one epoch: the rollout's log-probs are the old log-probs, no recompute ran.
    assert "timing/old_log_probs" in final and recomputed == []
    assert (tmp_path / "run" / "validation" / "step_2.jsonl").is_file()


def test_resume_continues_exactly_and_a_crashed_save_is_never_the_resume_point(
    demo, tmp_path, monkeypatch
) -> None:
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    changes = {"trainer.total_training_steps": 3, "trainer.save_freq": 1}
    straight = trainer_for(demo, straight_dir, **changes)
    straight.fit()
    expected = {line["step"]: line for line in metrics_lines(straight_dir)}

    first = trainer_for(demo, resumed_dir, **changes | {"trainer.total_training_steps": 2})
    first.fit()
    # A crash while saving step 3 must leave step 2 the resume point.
    second = trainer_for(demo, resumed_dir, **changes)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(second.actor, "save_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        second.fit()
    saved = [step for step, _ in checkpoints.complete_checkpoints(resumed_dir / "checkpoints")]
    assert saved == [1, 2], saved
    assert (resumed_dir / "checkpoints" / ".global_step_3.saving").exists()  # never trusted: no marker
    assert not (resumed_dir / "checkpoints" / "global_step_3" / MARKER_FILE).exists()

    third = trainer_for(demo, resumed_dir, **changes)
    third.fit()
    resumed = {line["step"]: line for line in metrics_lines(resumed_dir)}
    assert sorted(resumed) == [1, 2, 3]
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
        assert resumed[3][key] == expected[3][key], key  # bitwise, as the uninterrupted run
    final_straight = dict(straight.actor.group.worker.policy.get_per_tensor_param())
    for name, tensor in third.actor.group.worker.policy.get_per_tensor_param():
        assert torch.equal(tensor, final_straight[name]), name


def test_ppo_with_a_critic_runs_gae(demo, tmp_path) -> None:
    trainer = trainer_for(
        demo,
        tmp_path,
        **{
            "algorithm.adv_estimator": "gae",
            "critic.enable": "true",
            "critic.engine": f"{{backend: ddp, model: {{path: {demo.model}}}, device: cpu, optim: {{lr: 1e-3}}}}",
            "trainer.total_training_steps": 1,
        },
    )
    final = trainer.fit()
    assert final["critic/vf_loss"] > 0 and final["critic/grad_norm"] > 0
    assert "timing/values" in final and "timing/update_critic" in final


def test_verl_core_train_runs_and_draws_the_curves(demo, tmp_path, capsys) -> None:
    from verl_core.cli import main

    assert main(["train", *run_overrides(demo, tmp_path, **{"trainer.test_freq": 1})]) == 0
    err = capsys.readouterr().err  # the end-of-run summary, with the files, is on stderr
    assert "curves:" in err and (tmp_path / "run" / "curves.png").is_file()


def test_verl_core_train_names_a_missing_dataset(demo, tmp_path, capsys) -> None:
    from verl_core.cli import main

    overrides = run_overrides(demo, tmp_path, **{"data.train_files": f"[{tmp_path / 'nope.jsonl'}]"})
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert "data.train_files" in err and "nope.jsonl" in err


CONSTANT_FOR_SOME = """
def score(prompt, response, extra):
    # Every response to a prompt whose answer starts with 0-4 gets the same score: no signal in the group.
    if extra["ground_truth"][0] in "01234":
        return 0.5
    return float(len(response)) + 0.1 * response.count("1")
"""


def test_dynamic_sampling_drops_groups_without_signal_and_fills_the_batch(demo, tmp_path) -> None:

    reward = tmp_path / "reward.py"
    reward.write_text(CONSTANT_FOR_SOME)
    trainer = trainer_for(
        demo,
        tmp_path,
        **{
            "reward.function": f"{reward}:score",
            "algorithm.filter_groups.enable": "true",
            "rollout.temperature": 1.5,
        },
    )
    collected = trainer.collect(1)
    batch, rounds = collected.batch, collected.rounds
    assert batch.batch_size[0] == 4 * trainer.n
    prompt_ids = batch["input_ids"][:, : -batch["responses"].shape[1]]
    prompts = trainer.tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    # "rev 3851=": the ground truth (the digits reversed) starts with the prompt's last digit
    assert all(prompt.strip().rstrip("=")[-1] not in "01234" for prompt in prompts), prompts
    assert rounds >= 2  # about half the prompts are dropped, so one round cannot fill the batch
    scores = batch["scores"].view(4, trainer.n)
    assert all(bool((group != group[0]).any()) for group in scores)
    assert batch["uid"].tolist() == [g for g in range(4) for _ in range(trainer.n)]


def test_dynamic_sampling_gives_up_after_max_rounds_naming_the_key(demo, tmp_path) -> None:
    reward = tmp_path / "flat.py"
    reward.write_text("def score(prompt, response, extra):\n    return 1.0\n")
    trainer = trainer_for(
        demo,
        tmp_path,
        **{
            "reward.function": f"{reward}:score",
            "algorithm.filter_groups.enable": "true",
            "algorithm.filter_groups.max_num_gen_batches": 2,
        },
    )
    with pytest.raises(
        RuntimeError, match=r"after 2 generation rounds only 0 of 4 prompts.*max_num_gen_batches"
    ):
        trainer.fit()


def test_a_reward_function_that_raises_names_the_sample(demo, tmp_path) -> None:
    reward = tmp_path / "broken.py"
    reward.write_text("def score(prompt, response, extra):\n    raise ValueError('cannot parse')\n")
    trainer = trainer_for(demo, tmp_path, **{"reward.function": f"{reward}:score"})
    with pytest.raises(Exception) as caught:
        trainer.fit()
    message = str(caught.value)
    assert "sample 0" in message and "rev " in message and "cannot parse" in message


def test_a_checkpoint_at_an_epoch_boundary_resumes_into_the_next_epoch(tmp_path) -> None:
    """verl's issue 7401: resuming there trained zero steps. Two steps make an epoch of 8 prompts."""
    small = build_small_demo(tmp_path / "demo", train_size=8, val_size=4)
    changes = {"trainer.save_freq": 2, "trainer.total_training_steps": 3}
    straight = trainer_for(small, tmp_path / "straight", **changes)
    straight.fit()
    first = trainer_for(small, tmp_path / "resumed", **changes | {"trainer.total_training_steps": 2})
    first.fit()  # ends exactly at the epoch boundary, with its checkpoint
    resumed = trainer_for(small, tmp_path / "resumed", **changes)
    final = resumed.fit()
    assert resumed.global_step == 3 and final["training/epoch"] == 1.0  # a step of the next epoch ran
    expected = metrics_lines(tmp_path / "straight")[-1]
    for key in ("reward/mean", "actor/loss", "actor/grad_norm"):
        assert final[key] == expected[key], key


def test_truncated_importance_sampling_recomputes_the_old_log_probs(demo, tmp_path) -> None:
    # With the rollout's log-probs standing in for the engine's, every weight would be exactly 1.
    for cap, recomputes in (("null", False), (2.0, True)):
        trainer = trainer_for(
            demo,
            tmp_path / str(cap),
            **{"actor.policy_loss.rollout_is_cap": cap, "trainer.total_training_steps": 1},
        )
        calls = []
        compute = trainer.actor.compute_log_probs
        trainer.actor.compute_log_probs = lambda batch, calls=calls, compute=compute: (
            calls.append(len(batch)) or compute(batch)
        )
        final = trainer.fit()
        assert trainer.recompute_old_log_probs is recomputes and bool(calls) is recomputes
        assert ("actor/rollout_is_weight_mean" in final) is recomputes
        # Logged with the recompute only; one dtype, one model: the two sides compute alike.
        assert ("rollout/log_prob_diff_mean" in final) is recomputes
        if recomputes:
            assert final["rollout/log_prob_diff_max"] < 1e-5, final


def test_the_rollout_correction_runs_in_the_step_and_logs_its_metrics(demo, tmp_path) -> None:
    # A bfloat16 rollout (its log-probs differ from the engine's by ~1e-3) with TRL's sequence masking
    # and a geometric rejection tight enough to drop some sequences: the engine recomputes, the step
    # logs the batch's metrics, and the rejected sequences leave the update's mask.
    correction = "actor.policy_loss.rollout_correction"
    changes = {
        "rollout.dtype": "bfloat16",
        f"{correction}.rollout_is": "sequence",
        f"{correction}.rollout_is_threshold": "0_3.0",
        f"{correction}.rollout_rs": "seq_mean_k1",
        f"{correction}.rollout_rs_threshold": 1.0002,
        "trainer.total_training_steps": 1,
    }
    trainer = trainer_for(demo, tmp_path / "corrected", **changes)
    final = trainer.fit()
    assert trainer.recompute_old_log_probs
    for name in (
        "k3_kl",
        "log_ppl_diff",
        "chi2_token",
        "chi2_seq",
        "ess_token",
        "ess_seq",
        "token_masked_fraction",
    ):
        assert f"rollout_corr/{name}" in final, name
    assert 0 < final["rollout_corr/k3_kl"] < 1e-3 and 0 < final["rollout_corr/ess_seq"] <= 1
    rows_kept = trainer.last_batch[RESPONSE_MASK].any(dim=-1)
    assert 0 < final["rollout_corr/rollout_rs_seq_masked_fraction"] < 1
    assert final["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(
        1 - rows_kept.double().mean()
    )

    # Bypass: the rollout's log-probs are the old ones even over two mini-batches (no recompute); the
    # metrics then come from the update's forward pass.
    changes = {
        f"{correction}.bypass_mode": "true",
        "actor.ppo_mini_batch_size": 2,
        "actor.engine.micro_batch.micro_batch_size": 2,
        "trainer.total_training_steps": 1,
    }
    trainer = trainer_for(demo, tmp_path / "bypass", **changes)
    calls = []
    compute = trainer.actor.compute_log_probs
    trainer.actor.compute_log_probs = lambda batch: calls.append(len(batch)) or compute(batch)
    final = trainer.fit()
    assert calls == [] and torch.equal(
        trainer.last_batch[OLD_LOG_PROBS], trainer.last_batch[ROLLOUT_LOG_PROBS]
    )
    assert "rollout_corr/k3_kl" in final and "rollout_corr/token_masked_fraction" not in final


@pytest.mark.parametrize(
    ("dtype", "recompute", "source"),
    [("bfloat16", False, "update"), ("bfloat16", True, "engine"), ("float32", False, "rollout")],
)
def test_the_old_log_probs_of_a_rollout_in_another_dtype_are_the_engines(
    demo, tmp_path, dtype, recompute, source
) -> None:
    changes = {"rollout.dtype": dtype, "trainer.recompute_old_log_probs": str(recompute).lower()}
    trainer = trainer_for(demo, tmp_path, **changes, **{"trainer.total_training_steps": 1})
    worker = trainer.actor.group.worker
    assert {p.dtype for p in worker.rollout.model.parameters()} == {getattr(torch, dtype)}
    assert {p.dtype for p in worker.policy.module.parameters()} == {torch.float32}  # the actor's dtype
    assert trainer.config.old_log_probs_source(trainer.num_mini_batches) == source
    calls = []
    compute = trainer.actor.compute_log_probs
    trainer.actor.compute_log_probs = lambda batch: calls.append(len(batch)) or compute(batch)
    trainer.fit()
    assert trainer.recompute_old_log_probs is (source == "engine") and bool(calls) is (source == "engine")
    batch, logged = trainer.last_batch, metrics_lines(tmp_path)[-1]
    assert torch.equal(batch[OLD_LOG_PROBS], batch[ROLLOUT_LOG_PROBS]) is (source != "engine")
    # The mismatch metrics whatever the source: the batch's, or the update's forward pass's.
    assert (logged["rollout_corr/k3_kl"] > 1e-9) is (dtype == "bfloat16"), logged  # float32: ~1e-14
    if source == "rollout":
        assert not any(key.startswith("rollout/") for key in logged)
        return
    if source == "update":
        # The update's own log-probs, detached: PPO's ratio is exactly 1 (the rollout's bf16 log-probs
        # in its place would read as a policy change: the broken variant below).
        assert logged["actor/ppo_kl"] == 0.0 and logged["actor/pg_clipfrac"] == 0.0, logged
    # bfloat16 rounds the weights and the activations: the rollout's log-probs move, by about 7e-4 on
    # average here (3e-3 at most), where float32 on both sides gives 0 (the test above).
    mean, largest = logged["rollout/log_prob_diff_mean"], logged["rollout/log_prob_diff_max"]
    assert 1e-4 < mean <= largest < 1.0, logged
    assert 0 < logged["rollout/prob_diff_mean"] <= mean, logged  # exp is 1-Lipschitz below 0


def test_an_update_that_takes_the_bfloat16_rollouts_log_probs_as_the_old_ones_is_caught(
    demo, tmp_path, monkeypatch
) -> None:
    from verl_core.config.run import RunConfig

    monkeypatch.setattr(
        RunConfig, "old_log_probs_source", lambda self, num_mini_batches, registry=None: "rollout"
    )
    trainer = trainer_for(demo, tmp_path, **{"rollout.dtype": "bfloat16", "trainer.total_training_steps": 1})
    trainer.fit()
    assert metrics_lines(tmp_path)[-1]["actor/ppo_kl"] != 0.0


def test_a_fresh_run_refuses_to_save_among_an_earlier_runs_checkpoints(demo, tmp_path) -> None:
    changes = {"trainer.total_training_steps": 1, "trainer.save_freq": 1}
    trainer_for(demo, tmp_path, **changes).fit()
    fresh = changes | {"trainer.resume_mode": "disable"}
    with pytest.raises(ConfigError, match=r"trainer\.checkpoint_dir: .* holds checkpoints of an earlier run"):
        trainer_for(demo, tmp_path, **fresh).fit()
    trainer_for(demo, tmp_path, **(fresh | {"trainer.save_freq": 0})).fit()  # saves nothing: no mix-up


def test_a_group_whose_samples_came_back_with_other_prompts_is_named_once_and_still_trains(
    demo, tmp_path, capsys
) -> None:
    """A rollout that rewrote one sample's prompt: the group is named with its rows (once per run), and the
    update runs on the prompts as returned (sharing goes by tokens, so that sample keeps its own)."""
    trainer = trainer_for(demo, tmp_path)
    generate = trainer._generate

    def rewriting(prompts, sampling, seed):
        batch = generate(prompts, sampling, seed)
        last_prompt_token = batch["input_ids"].shape[1] - batch["responses"].shape[1] - 1
        batch["input_ids"][1, last_prompt_token] += 1  # sample 1 of group 0 (left-padded: a real token)
        return batch

    trainer._generate = rewriting
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    err = capsys.readouterr().err
    assert err.count("do not share one prompt") == 1, err  # two steps, one warning
    assert "1 group(s) of the rollout's responses do not share one prompt (group 0: rows [0, 1, 2, 3])" in err
    assert len(metrics_lines(tmp_path)) == 2
