"""Asynchronous training in process: separate rollout replicas, the one-step-off and async modes, the
policy version of every sample, exact resume across a checkpoint with batches generated ahead, and the
config's refusals.

The references are the synchronous runs: a separate replica generates what the colocated rollout
does, token for token; ``async`` with ``max_staleness=0`` is ``sync``'s run bitwise; and the staleness
of each step's samples is the formula of ``source_version`` written out."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.data.batch import RESPONSE_MASK, ROLLOUT_POLICY_VERSIONS
from verl_core.errors import ConfigError
from verl_core.trainer.asynchronous import source_version
from verl_core.trainer.rl import RLTrainer

torch.set_num_threads(1)

SEPARATE = {"rollout.placement": "separate"}
#: What differs between two runs of the same computation: wall times and what follows from them.
TIMING_PREFIXES = ("timing/", "perf/", "async/overlap", "async/buffer_depth")


def trainer_for(demo, tmp_path, **changes) -> RLTrainer:
    config = load_config([], run_overrides(demo, tmp_path, **changes))
    return RLTrainer.from_config(config, show_progress=False)


def run(demo, tmp_path, **changes) -> dict[int, dict[str, float]]:
    trainer = trainer_for(demo, tmp_path, **changes)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return read_metrics(tmp_path)


def read_metrics(tmp_path) -> dict[int, dict[str, float]]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def computed(records: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The metrics a computation determines: every one but the timings, and no ``async/*`` (a
    synchronous run logs none)."""
    return {
        step: {
            key: value
            for key, value in record.items()
            if not key.startswith(TIMING_PREFIXES) and not key.startswith("async/")
        }
        for step, record in records.items()
    }


@pytest.mark.parametrize(
    ("step", "staleness", "first_step", "save_freq", "expected"),
    [
        (1, 0, 0, 0, 0),  # sync: the policy before the step
        (5, 0, 0, 0, 4),
        (1, 2, 0, 0, 0),  # nothing older than the start
        (5, 2, 0, 0, 2),
        (5, 2, 3, 0, 3),  # nor than a resume point
        (5, 2, 0, 4, 4),  # the batch after a checkpoint: the checkpoint's weights
        (6, 3, 0, 4, 4),
        (9, 1, 0, 4, 8),
        (8, 3, 0, 4, 4),
    ],
)
def test_source_version_is_the_staleness_behind_and_never_before_a_barrier(
    step, staleness, first_step, save_freq, expected
) -> None:
    assert source_version(step, staleness, first_step, save_freq) == expected


def test_a_separate_replica_trains_as_the_colocated_rollout_bitwise(demo, tmp_path) -> None:
    changes = {"trainer.total_training_steps": 2, "trainer.test_freq": 1}
    colocated = run(demo, tmp_path / "colocated", **changes)
    separate = run(demo, tmp_path / "separate", **changes | SEPARATE)
    assert computed(separate) == computed(colocated)


def test_async_with_no_staleness_is_the_sync_run_bitwise(demo, tmp_path) -> None:
    changes = SEPARATE | {"trainer.total_training_steps": 3, "trainer.test_freq": 2}
    sync = run(demo, tmp_path / "sync", **changes)
    asynchronous = run(
        demo,
        tmp_path / "async",
        **changes | {"async_training.mode": "async", "async_training.max_staleness": 0},
    )
    assert computed(asynchronous) == computed(sync)
    assert all(asynchronous[step]["async/staleness/max"] == 0 for step in (1, 2, 3))


def test_each_sample_is_as_stale_as_its_mode_says_and_the_engine_recomputes_old_log_probs(
    demo, tmp_path
) -> None:
    trainer = trainer_for(
        demo,
        tmp_path,
        **SEPARATE | {"async_training.mode": "async", "async_training.max_staleness": 2},
        **{"trainer.total_training_steps": 4},
    )
    recomputed = []
    compute = trainer.actor.compute_log_probs
    trainer.actor.compute_log_probs = lambda batch: recomputed.append(len(batch)) or compute(batch)
    versions = []
    train_step = trainer.train_step

    def remember_versions(step):
        metrics = train_step(step)
        batch = trainer.last_batch
        versions.append(set(batch[ROLLOUT_POLICY_VERSIONS][batch[RESPONSE_MASK].bool()].tolist()))
        return metrics

    trainer.train_step = remember_versions
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Batch s comes from version max(s - 3, 0): 0, 0, 0, 1; it trains the policy of version s - 1.
    assert versions == [{0}, {0}, {0}, {1}]
    assert [record["async/staleness/max"] for record in records] == [0, 1, 2, 2]
    assert [record["async/staleness/2"] for record in records] == [0, 0, 1, 1]
    assert len(recomputed) == 4  # decoupled PPO: the proximal policy's log-probs, every step


def test_async_resumes_exactly_from_a_checkpoint_taken_with_the_next_batch_generated(demo, tmp_path) -> None:
    changes = SEPARATE | {
        "async_training.mode": "async",
        "async_training.max_staleness": 2,
        "trainer.save_freq": 2,
        "trainer.total_training_steps": 4,
    }
    straight = trainer_for(demo, tmp_path / "straight", **changes)
    # The checkpoint of step 2 is saved once batch 3 is generated (its prompts drawn, its samples
    # scored): what the checkpoint keeps must be step 2's, not the generation thread's.
    generated = {}
    collect, save = straight.collect, straight.save_checkpoint

    def collect_and_tell(step):
        collected = collect(step)
        generated[step] = threading.Event()
        generated[step].set()
        return collected

    def save_after_the_next_batch(step):
        while step == 2 and 3 not in generated:
            time.sleep(0.01)
        return save(step)

    straight.collect, straight.save_checkpoint = collect_and_tell, save_after_the_next_batch
    try:
        straight.fit()
    finally:
        straight.shutdown()
    expected = computed(read_metrics(tmp_path / "straight"))
    checkpoint = tmp_path / "straight" / "checkpoints" / "global_step_2"
    resumed = run(
        demo,
        tmp_path / "resumed",
        **changes | {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(checkpoint)},
    )
    assert sorted(resumed) == [3, 4]
    assert computed(resumed)[3] == expected[3]
    assert computed(resumed)[4] == expected[4]


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"async_training.mode": "one_step_off"}, "async_training.mode", "rollout.placement=separate"),
        ({"async_training.max_staleness": -1}, "async_training.max_staleness", ">= 0"),
        ({"async_training.max_staleness": 1.5}, "async_training.max_staleness", "int"),
        ({"async_training.mode": "later"}, "async_training.mode", "one_step_off"),
        ({"rollout.replicas": 0}, "rollout.replicas", "> 0"),
        ({"rollout.replica_resources": "{CPU: -1}"}, "rollout.replica_resources.CPU", ">= 0"),
    ],
)
def test_bad_async_settings_are_refused_at_their_key(demo, tmp_path, changes, key, words) -> None:
    with pytest.raises(ConfigError) as error:
        load_config([], run_overrides(demo, tmp_path, **changes))
    assert any(path == key and words in message for path, message in error.value.errors), error.value.errors


FILES_PLUGIN = """
from verl_core import WeightTransport, hookimpl

@hookimpl
def verl_weight_transports():
    return [WeightTransport(name="files", transport="files_transport:FilesTransport", workers=("in_process",))]
"""

FILES_TRANSPORT = """
import os, tempfile, torch
from verl_core.rollout import BaseWeightTransport

class FilesTransport(BaseWeightTransport):
    '''Each bucket a file in a folder every process sees; the handle is the list of paths.'''

    def publish(self, buckets):
        folder = tempfile.mkdtemp(dir=os.environ["FILES_TRANSPORT_DIR"])
        paths = []
        for bucket in buckets:
            paths.append(os.path.join(folder, f"{bucket.index}.pt"))
            torch.save(bucket, paths[-1])
        return paths

    def receive(self, handle):
        for path in handle:
            yield torch.load(path, weights_only=False)
"""


def test_a_third_party_weight_transport_carries_the_weights_as_the_default_does(
    demo, tmp_path, monkeypatch
) -> None:
    import tempfile
    from pathlib import Path

    from fixtures.fake_dist import fake_distributions

    from verl_core.plugins import Registry

    changes = SEPARATE | {"trainer.total_training_steps": 2}
    expected = computed(run(demo, tmp_path / "memory", **changes))
    monkeypatch.setenv("FILES_TRANSPORT_DIR", str(tmp_path))
    with fake_distributions(Path(tempfile.mkdtemp(dir=tmp_path))) as dists:
        dists.add("verl-files", "1.0", {"files": FILES_PLUGIN}, modules={"files_transport": FILES_TRANSPORT})
        registry = Registry.from_plugins(autoload=True)
        overrides = run_overrides(demo, tmp_path / "files", **changes | {"rollout.weight_transport": "files"})
        trainer = RLTrainer.from_config(load_config([], overrides, registry=registry), registry=registry)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    assert computed(read_metrics(tmp_path / "files")) == expected
    published = [
        folder for folder in tmp_path.iterdir() if folder.name.startswith("tmp") and any(folder.glob("*.pt"))
    ]
    assert len(published) == 3  # the start's weights and each step's


class CappedTransport:
    """In-process buckets of at most 1 MiB (``max_bucket_megabytes``); the buffers' sizes recorded."""

    sizes: list[int] = []

    def __new__(cls):
        from verl_core.rollout.transport import MemoryTransport

        class Capped(MemoryTransport):
            max_bucket_megabytes = 1

            def publish(self, buckets):
                published = super().publish(buckets)
                cls.sizes.append([bucket.nbytes for bucket in published])
                return published

        return Capped()


def test_the_actor_packs_buckets_no_larger_than_the_transport_takes(demo, tmp_path) -> None:
    """``rollout.update_weights_bucket_megabytes`` asks 512 MiB; the transport moves at most 1: the
    buckets of a 5 MB model are packed at 1 (each tensor of it is smaller)."""
    from fixtures.demo import make_demo_module
    from transformers import AutoTokenizer

    from verl_core import WeightTransport, hookimpl
    from verl_core.plugins import Registry

    make_demo = make_demo_module()
    tokenizer = AutoTokenizer.from_pretrained(demo.model)
    spec = make_demo.ModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    model = make_demo.build_model(tokenizer, spec, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest <= 1 << 20 < sum(p.numel() * p.element_size() for p in model.parameters()) // 3

    class Plugin:
        @hookimpl
        def verl_weight_transports(self):
            return [WeightTransport(name="capped", transport=CappedTransport, workers=("in_process",))]

    CappedTransport.sizes.clear()
    registry = Registry.from_plugins([Plugin()], autoload=True)
    changes = SEPARATE | {
        "rollout.weight_transport": "capped",
        "rollout.update_weights_bucket_megabytes": 512,
        "actor.engine.model.path": str(tmp_path / "model"),
        "trainer.total_training_steps": 1,
    }
    trainer = RLTrainer.from_config(
        load_config([], run_overrides(demo, tmp_path, **changes), registry=registry),
        registry=registry,
        show_progress=False,
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    assert CappedTransport.sizes, "the transport published nothing"
    for sizes in CappedTransport.sizes:
        assert len(sizes) >= 3 and max(sizes) <= 1 << 20, sizes


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rollout.weight_transport": "objectstore"}, "did you mean 'object_store'"),
        (
            {"rollout.weight_transport": "memory", "trainer.workers": "ray"},
            "works with trainer.workers in_process",
        ),
    ],
)
def test_a_transport_unknown_or_unfit_for_the_workers_is_refused(demo, tmp_path, changes, words) -> None:
    with pytest.raises(ConfigError) as error:
        load_config([], run_overrides(demo, tmp_path, **SEPARATE | changes))
    assert any(
        key == "rollout.weight_transport" and words in message for key, message in error.value.errors
    ), error.value.errors
