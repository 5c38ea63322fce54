"""Megatron engine runs on spawned ranks, for ``test_megatron_engine.py`` (loaded by path, not collected).

Each job trains or infers with one parallel layout on the kit's tiny model and batches (each DP rank
takes its DP share, every rank of a replica the same) and leaves what it measured in
``<workdir>/<name>.pt`` (written by global rank 0): the test side compares layouts with each other and
with the single-process Hugging Face reference. ``broken`` names a deliberately wrong variant of the
engine, which the tests require to be caught.

``spawn_in_turn`` runs several jobs of one world size on one set of ranks (starting ranks and
importing megatron-core costs seconds per spawn, a job on the tiny model less): each job gets a fresh
megatron-core parallel state, so that its layout may differ from the one before, and its broken
variant, if any, is undone after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig
from verl_core.data import COMPUTE_ENTROPY, TEMPERATURE
from verl_core.engine import build_engine
from verl_core.testing.checks import BASE_OPTIM
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.losses import policy_loss_fn
from verl_core.testing.spawn import Rank
from verl_core.testing.spawn import spawn as run_ranks
from verl_core.testing.tiny import collate, make_samples, shard

#: A whole layout job, model build included (megatron-core's import takes ~5 s per rank).
JOB_TIMEOUT_S = 300.0
#: The batches of the two steps (the kit's A and B).
STEP_SEEDS = (1, 2)


def spawn(job: str, world_size: int, workdir: Path, **kwargs: Any) -> dict[str, Any]:
    """Run ``job`` on ``world_size`` ranks; return what its rank 0 saved."""
    return spawn_in_turn(world_size, workdir, [(job, kwargs)])[kwargs["name"]]


def spawn_in_turn(world_size: int, workdir: Path, jobs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run ``jobs`` (``(job, kwargs)`` each) one after the other on one set of ``world_size`` ranks;
    return what each one's rank 0 saved, by name."""
    names = [kwargs["name"] for _, kwargs in jobs]
    run_ranks(
        run_in_turn,
        (str(workdir), jobs),
        world_size=world_size,
        workdir=workdir / f"ranks_{'+'.join(names)}",
        timeout_s=JOB_TIMEOUT_S * len(jobs),
    )
    return {name: torch.load(workdir / f"{name}.pt", weights_only=False) for name in names}


def run_in_turn(rank: Rank, workdir: str, jobs: list[tuple[str, dict[str, Any]]]) -> None:
    for job, kwargs in jobs:
        broken = kwargs.get("broken") if kwargs.get("backend", "megatron") == "megatron" else None
        with broken_variant(broken):
            JOBS[job](rank, workdir, kwargs)
        _reset_parallel_state()


def _reset_parallel_state() -> None:
    """Forget megatron-core's parallel layout (one per process), so that the next job sets its own."""
    import sys

    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def engine(
    model_dir: str,
    backend: str,
    options: dict[str, Any],
    micro_batch_size: int,
    gradient_checkpointing: bool = False,
):
    from verl_core.plugins import get_registry

    if backend == "megatron":
        options = {"cpu_bridge": True, **options}
    registry = get_registry()
    options_class = registry.get("engine_backends", backend).load_config()
    config = EngineConfig(
        backend=backend,
        model=ModelConfig(path=model_dir, dtype="float32", gradient_checkpointing=gradient_checkpointing),
        options=options_class(**options) if options_class else None,
        optim=BASE_OPTIM,
        micro_batch=MicroBatchConfig(micro_batch_size=micro_batch_size, packing=False),
        device="cpu",
        seed=0,
    )
    built = build_engine(config, "lm", registry)
    built.initialize()
    return built


@contextlib.contextmanager
def broken_variant(broken: str | None) -> Iterator[None]:
    """A deliberately wrong variant of the engine in this rank, for the block; then the engine again."""
    if broken is None:
        yield
        return
    from verl_megatron import engine as megatron_engine
    from verl_megatron import model, weights

    if broken == "schedule_averaging_kept":  # the loss averaged over micro-batches twice
        patches = [
            (
                megatron_engine.MegatronEngine,
                "_undo_schedule_averaging",
                staticmethod(lambda loss, count: loss),
            )
        ]
    elif broken == "untagged_tp_parameters":  # megatron-core's TP attributes never set: wrong grad norm
        build = model.transformer_config
        patches = [
            (
                model,
                "transformer_config",
                lambda *a, **k: dataclasses.replace(build(*a, **k), perform_initialization=False),
            )
        ]
    elif broken == "qkv_not_grouped":  # [all q, all k, all v] instead of per query group
        patches = [
            (weights, "_fuse_qkv", lambda q, k, v, heads: torch.cat([q, k, v])),
            (
                weights,
                "_split_qkv",
                lambda fused, heads: list(
                    fused.split(
                        [
                            heads.num_attention_heads * heads.head_dim,
                            *[heads.num_query_groups * heads.head_dim] * 2,
                        ]
                    )
                ),
            ),
        ]
    else:
        raise ValueError(f"no broken variant {broken!r}")
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def local_batch(seed: int, built) -> Any:
    samples = make_samples(seed, share_prompts=seed == STEP_SEEDS[0])
    batch = collate(samples[shard(samples, built.dp_rank, built.dp_size)])
    batch.set_non_tensor(TEMPERATURE, KIT_TEMPERATURE)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


def run_steps(rank: Rank, workdir: str, kwargs: dict[str, Any]) -> None:
    """Two steps (batches A, B): each step's loss and grad norm, the weights after them."""
    built = engine(
        kwargs["model"],
        kwargs["backend"],
        kwargs.get("options", {}),
        kwargs["micro_batch_size"],
        kwargs.get("gradient_checkpointing", False),
    )
    metrics = []
    for seed in STEP_SEEDS:
        with built.train_mode():
            step = built.train_batch(local_batch(seed, built), policy_loss_fn)
        metrics.append({"loss": step["loss"], "grad_norm": step["grad_norm"]})
    params = {name: tensor.detach().clone() for name, tensor in built.get_per_tensor_param()}
    _save(rank, workdir, kwargs["name"], {"steps": metrics, "params": params, "dp_size": built.dp_size})


def run_infer(rank: Rank, workdir: str, kwargs: dict[str, Any]) -> None:
    """Log-probs and entropy on batch B (gathered over the DP ranks in batch order): ``initial``
    (after ``load``, if given), and ``trained`` after a step on A when ``train`` is set; then ``save``
    a checkpoint if asked."""
    built = engine(kwargs["model"], "megatron", kwargs.get("options", {}), 2)
    if "load" in kwargs:
        built.load_checkpoint(str(Path(workdir) / kwargs["load"]))
    result = {"initial": gathered_outputs(built)}
    if kwargs.get("train"):
        with built.train_mode():
            built.train_batch(local_batch(STEP_SEEDS[0], built), policy_loss_fn)
        result["trained"] = gathered_outputs(built)
    if "save" in kwargs:
        built.save_checkpoint(str(Path(workdir) / kwargs["save"]), global_step=1)
    _save(rank, workdir, kwargs["name"], result)


def gathered_outputs(built) -> dict[str, torch.Tensor]:
    with built.eval_mode():
        outputs = built.infer_batch(local_batch(STEP_SEEDS[1], built)).outputs
    mine = None if outputs is None else (built.dp_rank, {k: outputs[k] for k in ("log_probs", "entropy")})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    shares = dict(share for share in gathered if share is not None)
    return {key: torch.cat([shares[r][key] for r in sorted(shares)]) for key in ("log_probs", "entropy")}


def _save(rank: Rank, workdir: str, name: str, result: dict[str, Any]) -> None:
    if rank.rank == 0:
        torch.save(result, Path(workdir) / f"{name}.pt")
    dist.barrier()


JOBS = {"steps": run_steps, "infer": run_infer}
