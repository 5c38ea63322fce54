"""The RL trainer under Ray: the actor's worker group is two Ray actors forming a gloo group, with the
fsdp backend sharded over them; an unreachable cluster address is an error within seconds."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time

import pytest
import torch
from fixtures.demo import build_teacher, plain_response_log_probs, run_overrides
from fixtures.processes import stop_processes_mentioning

from verl_core.config import load_config
from verl_core.data.batch import RESPONSE_MASK, TEACHER_LOG_PROBS, TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS
from verl_core.trainer.distillation import TEACHER_INDEX
from verl_core.trainer.rl import RLTrainer
from verl_core.trainer.run_files import validation_samples_path
from verl_core.workers.group import WorkerError

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)


def test_grpo_on_two_fsdp_ranks_under_ray_validates_batches_that_do_not_split_as_one_rank_does(
    demo, tmp_path, ray_cluster
) -> None:
    """Validation batches of 3, 3 and 2 prompts over 2 DP ranks (each rank generates its share, one
    rank gets one prompt more): the score before training is the one a single in-process rank gives
    (greedy decoding, the same weights), scored by a reward that tells the untrained model's
    responses apart (the digit-reversal reward scores them all 0)."""
    (tmp_path / "variety.py").write_text(
        "def score(prompt, response, extra):\n    return len(set(response)) / 8\n"
    )
    changes = {
        "trainer.test_freq": 2,
        "data.val_batch_size": 3,
        "reward.function": f"{tmp_path / 'variety.py'}:score",
    }
    overrides = run_overrides(
        demo,
        tmp_path,
        backend="fsdp",
        **{"trainer.workers": "ray", "trainer.world_size": 2, "trainer.save_freq": 2, **changes},
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        assert trainer.actor.dp_size == 2
        final = trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert final["actor/grad_norm"] > 0 and 0.0 <= final["reward/mean"] <= 1.0
    assert (tmp_path / "checkpoints" / "global_step_2" / "actor").is_dir()

    one_rank = RLTrainer.from_config(
        load_config([], run_overrides(demo, tmp_path / "one_rank", backend="fsdp", **changes)),
        show_progress=False,
    )
    try:
        expected = one_rank.validate(0)
    finally:
        one_rank.shutdown()
    assert {key: lines[0][key] for key in expected} == expected and expected["val/score/mean"] > 0
    # The same responses, in the same order: the logged samples are the first prompts' generations.
    samples = [
        validation_samples_path(folder / "run", 0).read_text() for folder in (tmp_path, tmp_path / "one_rank")
    ]
    assert samples[0] == samples[1] and samples[0].count("\n") == 8


def test_ppo_with_a_critic_on_two_fsdp_ranks_under_ray(demo, tmp_path, ray_cluster) -> None:
    critic = f"{{backend: fsdp, model: {{path: {demo.model}}}, device: cpu, optim: {{lr: 1e-3}}}}"
    overrides = run_overrides(
        demo,
        tmp_path,
        backend="fsdp",
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "algorithm.adv_estimator": "gae",
            "critic.enable": "true",
            "critic.engine": critic,
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        assert trainer.critic.dp_size == 2
        final = trainer.fit()
    finally:
        trainer.shutdown()
    assert final["critic/vf_loss"] > 0 and final["critic/grad_norm"] > 0 and final["actor/grad_norm"] > 0


def test_gkd_from_two_teachers_one_in_the_actors_ranks_one_on_its_own_under_ray(
    demo, tmp_path, ray_cluster
) -> None:
    """Rows routed by a data column to a teacher in the fsdp actor's two ranks and to one on two ddp ranks
    of its own: each row's top-k and log-probs are its teacher's plain forward pass."""
    rows = [json.loads(line) for line in demo.train.read_text().splitlines()]
    routed = tmp_path / "routed.jsonl"
    routed.write_text(
        "".join(json.dumps(row | {"teacher": "ab"[i % 2]}) + "\n" for i, row in enumerate(rows))
    )
    teachers = {name: build_teacher(demo, tmp_path / name, seed) for name, seed in (("a", 1), ("b", 2))}
    temperature = 0.7
    changes = {
        "trainer.workers": "ray",
        "trainer.world_size": 2,
        "trainer.total_training_steps": 1,
        "rollout.temperature": temperature,
        "data.train_files": f"[{routed}]",
        "distillation.loss": "gkd",
        "distillation.route_by": "teacher",
    }
    for name, backend, placement in (("a", "fsdp", "colocated"), ("b", "ddp", "separate")):
        changes |= {
            f"distillation.teachers.{name}.engine": f"{{backend: {backend}, model: {{path: {teachers[name]}}}, device: cpu}}",
            f"distillation.teachers.{name}.top_k": 3,
            f"distillation.teachers.{name}.placement": placement,
        }
    trainer = RLTrainer.from_config(
        load_config([], run_overrides(demo, tmp_path, backend="fsdp", **changes)), show_progress=False
    )
    try:
        assert trainer.separate_teachers["b"].dp_size == 2
        final = trainer.fit()
    finally:
        trainer.shutdown()
    batch = trainer.last_batch
    assert final["distillation/jsd"] > 0 and final["actor/grad_norm"] > 0
    for index, name in enumerate("ab"):
        mine = batch[batch[TEACHER_INDEX] == index]
        mask = mine[RESPONSE_MASK].bool()
        every = plain_response_log_probs(teachers[name], mine, temperature)
        values, ids = every.topk(3, dim=-1)
        sampled = every.gather(-1, mine["responses"].unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(mine[TEACHER_TOP_K_LOG_PROBS][mask], values[mask], atol=1e-5), name
        assert torch.equal(mine[TEACHER_TOP_K_IDS][mask], ids[mask]), name
        assert torch.allclose(mine[TEACHER_LOG_PROBS][mask], sampled[mask], atol=1e-5), name


def test_an_unreachable_ray_address_is_an_error_within_seconds(monkeypatch) -> None:
    """Within seconds: one connection attempt bounded by CONNECT_TIMEOUT_S, and Ray (whose own
    connection attempts retry for minutes) is never asked to connect."""
    from verl_core.workers import ray_group

    for name, value in ray_group.RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)  # as ensure_ray does, before Ray is imported
    import ray

    attempts = []
    connect = ray_group.socket.create_connection
    monkeypatch.setattr(
        ray_group.socket,
        "create_connection",
        lambda address, timeout: attempts.append((address, timeout)) or connect(address, timeout=timeout),
    )
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("ray.init was called"))
    with pytest.raises(
        WorkerError, match=r"trainer\.ray_address='127\.0\.0\.1:1': no Ray cluster answers there"
    ):
        ray_group.RayWorkerGroup("actor", lambda: None, world_size=1, address="127.0.0.1:1")
    assert attempts == [(("127.0.0.1", 1), ray_group.CONNECT_TIMEOUT_S)]


class _FlakyRay:
    """Ray whose first ``failures`` starts miss their deadline, as on a machine with every core busy."""

    def __init__(self, failures: int) -> None:
        self.failures, self.inits, self.shutdowns = failures, 0, 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        self.kwargs = kwargs
        if self.inits <= self.failures:
            raise Exception("Failed to get node info: RPC error: Deadline Exceeded")

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_local_ray_start_that_misses_a_deadline_is_tried_once_more(capfd) -> None:
    from verl_core.workers import ray_group

    ray = _FlakyRay(failures=1)
    ray_group._start_local_cluster(ray, 300 << 20)
    assert (ray.inits, ray.shutdowns) == (2, 1)  # the failed start's processes are shut down first
    assert ray.kwargs["object_store_memory"] == 300 << 20  # trainer.ray_object_store_megabytes
    assert "starting Ray failed (Failed to get node info" in capfd.readouterr().err

    ray = _FlakyRay(failures=ray_group.LOCAL_START_ATTEMPTS)
    with pytest.raises(WorkerError, match=r"could not start a local Ray cluster \(2 attempts\).*Deadline"):
        ray_group._start_local_cluster(ray, 300 << 20)
    assert ray.shutdowns == ray_group.LOCAL_START_ATTEMPTS


def test_a_stopped_then_a_killed_worker_end_the_run_naming_the_role_and_rank_and_the_checkpoint_stays(
    demo, tmp_path, ray_cluster, capfd
) -> None:
    """A rank stopped with SIGSTOP is named in a warning after half of trainer.worker_timeout_s and
    ends the run after all of it (it answers no liveness check); a rank whose process died, at once.
    Either way the last checkpoint stays the resume point."""
    import signal

    from ray.exceptions import RayActorError

    from verl_core.trainer import checkpoints

    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.worker_timeout_s": 5,
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    pid, _ = trainer.actor.group.processes[1]
    try:
        trainer.fit()  # step 1, checkpoint 1
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        stopped = (
            r"actor rank 1 \(pid \d+ on [\d.]+\) has not answered for \d+ s \(trainer\.worker_timeout_s=5\)"
        )
        with pytest.raises(WorkerError, match=stopped) as caught:
            trainer.train_step(2)
        assert time.monotonic() - started < 5 + 10
        assert "the last checkpoint is intact" in str(caught.value)
        warned = r"verl-core: warning: actor rank 1 \(pid \d+ on [\d.]+\) has not answered for \d+ s"
        assert re.search(warned, capfd.readouterr().err), "no warning before the error"

        os.kill(pid, signal.SIGKILL)  # the kernel's OOM killer, say
        with pytest.raises(WorkerError, match=r"actor rank 1's process \(pid \d+ on [\d.]+\) died") as caught:
            trainer.train_step(2)
        # Ray's report of the dead actor, not rank 0's collective timing out waiting for it.
        assert isinstance(caught.value.__cause__, RayActorError)
        assert "the last checkpoint is intact" in str(caught.value)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        trainer.shutdown()
    assert [step for step, _ in checkpoints.complete_checkpoints(tmp_path / "checkpoints")] == [1]


def test_two_steps_on_a_ray_cluster_started_with_ray_start_in_another_folder_with_relative_paths(
    demo, tmp_path
) -> None:
    """A real head on loopback (`ray start --head`, run in one folder); the run joins it through
    trainer.ray_address from another folder, every path relative to that one. Its ranks run in the
    head's folder: the model loads, both checkpoints are whole (the ranks' shards beside the trainer's
    state) and the export lands in the run's folder, nothing in the head's."""
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from verl_core.toolkit.checkpoint import MARKER_FILE
    from verl_core.trainer import checkpoints
    from verl_core.workers.ray_group import RAY_ENVIRONMENT

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    head_dir, work = tmp_path / "cluster" / "head", tmp_path / "work"  # at other depths: "../x" differs
    head_dir.mkdir(parents=True)
    work.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # Unix socket paths must stay under 108 bytes
    env = {**os.environ, **RAY_ENVIRONMENT, "VERL_TEST_RAY_HEAD": ray_tmp}
    ray = str(Path(sys.executable).with_name("ray"))
    head = [ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2"]
    head += ["--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_tmp}"]
    subprocess.run(head, env=env, check=True, capture_output=True, timeout=120, cwd=head_dir)
    relative = {
        "actor.engine.model.path": os.path.relpath(demo.model, work),
        "data.train_files": f"[{os.path.relpath(demo.train, work)}]",
        "data.val_files": f"[{os.path.relpath(demo.val, work)}]",
        "trainer.run_dir": "run",
        "trainer.checkpoint_dir": "checkpoints",
    }
    try:
        overrides = run_overrides(
            demo,
            tmp_path,
            **{
                "trainer.workers": "ray",
                "trainer.ray_address": f"127.0.0.1:{port}",
                "trainer.save_freq": 1,
                "trainer.save_hf_model": "true",
                **relative,
            },
        )
        result = subprocess.run(
            [sys.executable, "-m", "verl_core", "train", *overrides],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=work,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "Connecting to existing Ray cluster" in result.stderr or f"127.0.0.1:{port}" in result.stderr
    finally:
        # Not `ray stop`: it stops every Ray cluster on the machine, this test process's own included.
        stop_processes_mentioning(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    steps = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    saved = checkpoints.complete_checkpoints(work / "checkpoints")
    assert [step for step, _ in saved] == [1, 2]
    assert all((folder / "actor" / MARKER_FILE).is_file() for _, folder in saved)
    assert (work / "run" / "hf_model" / "config.json").is_file()
    assert sorted(path.name for path in head_dir.iterdir()) == []


def test_responses_that_do_not_split_over_the_ranks_are_refused_before_the_first_step(
    demo, tmp_path, ray_cluster
) -> None:
    from verl_core.errors import ConfigError

    overrides = run_overrides(
        demo, tmp_path, **{"trainer.workers": "ray", "trainer.world_size": 3, "rollout.n": 2}
    )
    with pytest.raises(ConfigError) as caught:
        RLTrainer.from_config(load_config([], overrides), show_progress=False)
    message = str(caught.value)
    assert (
        "data.train_batch_size: 4 prompts x rollout.n=2 = 8 responses cannot be split evenly over 3"
        in message
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


def test_grpo_with_lora_on_two_fsdp_ranks_under_ray_exports_what_it_trained(
    demo, tmp_path, ray_cluster
) -> None:
    """The acceptance run of LoRA (docs/lora.md): the merged export and the adapter folder both give
    the trained policy's log-probs, as the sharded engine computes them (for a batch that does not
    divide over the ranks)."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_core.data.batch import LOG_PROBS
    from verl_core.testing.reference import reference_outputs
    from verl_core.testing.tiny import collate, make_samples
    from verl_core.toolkit import LORA_ADAPTER_DIR

    overrides = run_overrides(
        demo,
        tmp_path,
        backend="fsdp",
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "actor.engine.model.lora_rank": 8,
            "actor.engine.optim.lr": 1e-2,
            "actor.policy_loss.use_kl_loss": "true",
            "trainer.save_hf_model": "true",
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    # 3 sequences on 2 DP ranks: filled with a copy to equal shards, its log-probs dropped.
    samples = make_samples(seed=2, vocab_size=AutoConfig.from_pretrained(demo.model).vocab_size)[:3]
    batch = collate(samples)
    try:
        final = trainer.fit()
        trained = trainer.actor.compute_log_probs(batch)
        base = trainer.actor.compute_ref_log_probs(batch)
    finally:
        trainer.shutdown()
    assert final["actor/grad_norm"] > 0 and "timing/ref_log_probs" in final
    mask = batch["response_mask"].bool()
    assert (trained - base)[mask].abs().max() > 1e-4  # the adapter trained; the reference is the base
    export = tmp_path / "run" / "hf_model"
    merged = AutoModelForCausalLM.from_pretrained(export)
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(demo.model), export / LORA_ADAPTER_DIR
    )
    for model in (merged, adapted):
        log_probs = reference_outputs(model, samples, "lm", 1.0)[LOG_PROBS]
        torch.testing.assert_close(log_probs[mask], trained[mask], atol=1e-5, rtol=0)
