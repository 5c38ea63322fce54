"""What is Ulysses-specific and the conformance kit does not look at, on spawned gloo ranks: sp=2
against a single-process reference on a batch built to break the usual mistakes (an odd packed
length, one KV head for two SP ranks, a response across the shard boundary), with the broken variants
each caught; the head layouts the kit's model (4 heads, 2 KV heads) never gives an SP rank, each
against the reference, with the head-order bugs only they show caught; meta-device init from rank 0
(buffers recomputed, a forgetful loader caught); and a checkpoint saved at sp=2 loaded at (dp 2, sp 1)
and in one process.

One 2-rank spawn (a spawn costs ~10 s, mostly imports): ``ulysses_jobs.py`` holds the properties (the
rank side); each test here asserts one of them on every rank, with the rank's traceback when it fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from verl_core.config import EngineConfig, MicroBatchConfig, ModelConfig
from verl_core.engine import build_engine
from verl_core.plugins import Registry

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workdir(ulysses_jobs, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ulysses")
    ulysses_jobs.prepare(directory)
    return directory


@pytest.fixture(scope="module")
def two_ranks(ulysses_jobs, workdir) -> list[dict[str, Any]]:
    try:
        return ulysses_jobs.run("sp2", 2, workdir)
    except ulysses_jobs.JobFailed as error:
        pytest.fail(str(error), pytrace=False)


def assert_holds(results: list[dict[str, Any]], prop: str) -> dict[str, Any]:
    """Rank 0's figures, once ``prop`` held on every rank."""
    failures = "\n".join(
        f"rank {rank}: {r[prop]['error']}" for rank, r in enumerate(results) if r[prop]["error"] is not None
    )
    assert not failures, failures
    return results[0][prop]["figures"]


def test_sp2_equals_one_process_and_each_broken_variant_is_caught(two_ranks) -> None:
    figures = assert_holds(two_ranks, "equivalence")
    assert figures["layout"] == {"packed_length": 23, "padding": 1, "predicted_across_boundary": [11]}
    assert figures["no KV repeat"].startswith("raised")


def test_head_layouts_at_sp2_equal_one_process_and_head_order_bugs_are_caught(
    two_ranks, ulysses_jobs
) -> None:
    figures = assert_holds(two_ranks, "head_layouts")
    assert [key for key in figures if "KV heads" in key] == [
        f"{heads} heads, {kv_heads} KV heads" for heads, kv_heads in ulysses_jobs.HEAD_LAYOUTS
    ]
    assert figures["interleaved all-to-all on (8, 4)"]["gradients"] > ulysses_jobs.GRADIENT_ATOL
    assert figures["tiled GQA on (8, 4)"]["gradients"] > ulysses_jobs.GRADIENT_ATOL


def test_the_model_is_built_on_meta_and_filled_from_rank_0(two_ranks) -> None:
    figures = assert_holds(two_ranks, "meta_init")
    assert figures["loaded_from"] == "safetensors" and figures["critic loaded_from"] == "from_pretrained"


def test_a_checkpoint_saved_at_sp2_loads_at_dp2(two_ranks) -> None:
    assert_holds(two_ranks, "checkpoint_across_layouts")


def test_a_checkpoint_saved_at_sp2_loads_in_one_process(ulysses_jobs, workdir, two_ranks) -> None:
    """Without a process group the engine runs the plain model (sp 1): DCP reshards the sp=2 shards
    into it; the weights are the saved ones and the log-probs those sp=2 computed (1e-5)."""
    assert_holds(two_ranks, "checkpoint_across_layouts")
    config = EngineConfig(
        backend="ulysses",
        model=ModelConfig(path=ulysses_jobs.Models.under(workdir).kit.lm),
        optim=ulysses_jobs.OPTIM,
        micro_batch=MicroBatchConfig(micro_batch_size=2),
        device="cpu",
    )
    engine = build_engine(config, registry=Registry.from_plugins(autoload=True))
    engine.initialize()
    assert engine.mesh is None and engine.load_checkpoint(str(workdir / ulysses_jobs.CHECKPOINT)) == 1
    saved = torch.load(workdir / ulysses_jobs.SAVED, weights_only=True)
    for name, tensor in ulysses_jobs.exported(engine).items():
        assert torch.equal(tensor, saved["params"][name]), name
    batch = ulysses_jobs.batch_of(ulysses_jobs.make_samples(2))
    outputs = ulysses_jobs.infer(engine, batch)
    mask = ulysses_jobs.response_token_mask(batch)
    assert ulysses_jobs.max_diff(outputs["log_probs"], saved["log_probs"], mask) <= ulysses_jobs.OUTPUT_ATOL
