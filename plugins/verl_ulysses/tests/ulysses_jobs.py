"""Properties of the ulysses engine checked on spawned ranks, for ``test_ulysses.py`` and ``test_gpu.py``.

``run(job, world_size, workdir)`` (the test side) runs ``run_job`` (the rank side) on one process per
rank through ``verl_core.testing.spawn``, which loads this file by path in each rank. Each rank runs
the job's properties in order and writes ``<job>_rank<rank>.json``: per property, ``error`` (None
when it holds, else why not) and ``figures`` (the measured differences, for the report). Properties
call the engines' collectives in the same order on every rank. ``prepare(workdir)`` writes the
models the jobs use. Only verl-core's public API and this plugin are used, as a third party would.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor, Replicate, Shard
from verl_core.config import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.data import COMPUTE_ENTROPY, TEMPERATURE
from verl_core.engine import build_engine
from verl_core.plugins import Registry
from verl_core.testing import (
    ModelDirs,
    Rank,
    Sample,
    SpawnError,
    TinyModelSpec,
    collate,
    load_reference_model,
    make_samples,
    policy_loss_fn,
    policy_token_loss,
    reference_outputs,
    reference_step,
    response_token_mask,
    save_tiny_models,
    shard,
)

# Not ``from verl_core.testing import spawn``: once ``verl_core.testing.spawn`` (the module) is imported,
# the package attribute of that name is the module, not the function.
from verl_core.testing.spawn import spawn
from verl_core.toolkit import load_hf_model, pack_sequences

from verl_ulysses import loading, ulysses
from verl_ulysses.config import UlyssesConfig

#: The sampling temperature of every log-prob here (not 1: a temperature ignored shows).
KIT_TEMPERATURE = 0.7
#: The issue's bounds for SP against the single-process reference.
OUTPUT_ATOL = 1e-5  # log-probs, entropy, loss
GRADIENT_ATOL = 1e-6
#: A step at one layout against the same step at another (other reduction orders).
STEP_ATOL = 1e-6
#: Where the checkpoint saved at sp=2 goes, and what the 1-process test compares its load against.
CHECKPOINT = "checkpoint_sp2"
SAVED = "saved_at_sp2.pt"
#: Hard limit of one job: the ranks' collectives time out by themselves after 60 s.
JOB_TIMEOUT_S = 300
OPTIM = OptimConfig(lr=1e-3, eps=1e-4, weight_decay=0.1, clip_grad=1.0)


class JobFailed(RuntimeError):
    """A rank of a job crashed or the job timed out; the message holds the ranks' log tails."""


# -- models and batches ----------------------------------------------------------------------------


#: The head layouts (query heads, KV heads) ulysses accepts at sp 2 that ``head_layouts`` compares
#: with the reference, beyond the kit's model (4, 2), which gives each SP rank two query heads and one
#: KV head (and ``equivalence``'s (4, 1), one KV head repeated for the two ranks): every query head
#: its own KV head (4, 4); two KV heads per rank, each shared by two query heads (8, 4), where KV
#: heads paired with the wrong query heads show; four query heads per KV head (8, 2). At sp 4 the
#: layouts are checked in one process, the ranks emulated (``test_plugin.py``): a 4-rank spawn costs
#: about twice a 2-rank one.
HEAD_LAYOUTS = ((4, 4), (8, 4), (8, 2))


@attrs.frozen
class Models:
    """The kit's tiny Qwen2 (4 heads, 2 KV heads), a variant with one KV head (fewer than sp=2), and
    one per layout of ``HEAD_LAYOUTS``."""

    kit: ModelDirs
    one_kv_head: ModelDirs
    workdir: Path

    @classmethod
    def under(cls, workdir: Path) -> Models:
        return cls(ModelDirs.under(workdir / "model"), ModelDirs.under(workdir / "model_kv1"), workdir)

    def layout(self, heads: int, kv_heads: int) -> ModelDirs:
        """The model with ``heads`` query heads and ``kv_heads`` KV heads (the kit's for (4, 2))."""
        if (heads, kv_heads) == (4, 2):
            return self.kit
        return ModelDirs.under(self.workdir / f"model_h{heads}_kv{kv_heads}")


def prepare(workdir: Path) -> Models:
    """Write the models (once per workdir)."""
    save_tiny_models(workdir / "model")
    save_tiny_models(workdir / "model_kv1", TinyModelSpec(num_key_value_heads=1))
    for heads, kv_heads in HEAD_LAYOUTS:
        spec = TinyModelSpec(num_attention_heads=heads, num_key_value_heads=kv_heads)
        save_tiny_models(workdir / f"model_h{heads}_kv{kv_heads}", spec)
    return Models.under(workdir)


#: (prompt, response) lengths of the straddling batch: 7 + 8 + 8 = 23 packed tokens, an odd total
#: (one padding token at sp=2), and the second sequence (packed tokens 7..14, response from 9) runs
#: across the shard boundary at 12, where token 11 of shard 0 predicts token 12 of shard 1.
STRADDLING_LENGTHS = ((3, 4), (2, 6), (4, 4))


def straddling_samples(seed: int = 7, vocab_size: int = 128) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt_length, response_length in STRADDLING_LENGTHS:
        tokens = torch.randint(1, vocab_size, (prompt_length + response_length,), generator=generator)
        samples.append(
            Sample(
                prompt=tokens[:prompt_length],
                response=tokens[prompt_length:],
                loss_mask=torch.ones(response_length, dtype=torch.long),
                advantages=torch.randn(response_length, generator=generator),
                returns=torch.randn(response_length, generator=generator),
            )
        )
    return samples


def batch_of(samples: list[Sample]) -> TensorDict:
    batch = collate(samples)
    batch.set_non_tensor(TEMPERATURE, KIT_TEMPERATURE)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    return batch


def straddling_layout(sp_size: int = 2) -> dict[str, Any]:
    """What makes the straddling batch a test: its packed length, padding, and the response tokens
    predicted across a shard boundary (the positions a per-shard roll gets wrong)."""
    batch = collate(straddling_samples())
    packed = pack_sequences(batch["attention_mask"], batch["responses"].shape[-1])
    length = int(packed.mask.sum())
    total = length + (-length % sp_size)
    boundaries = {(k + 1) * total // sp_size - 1 for k in range(sp_size - 1)}
    crossing = sorted(set(packed.predicting.tolist()) & boundaries)
    return {"packed_length": length, "padding": total - length, "predicted_across_boundary": crossing}


# -- the reference ----------------------------------------------------------------------------------


def reference_loss_and_gradients(path: str, samples: list[Sample]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch: the Hugging Face model on each sample alone, the token mean of the kit's policy
    loss over all of them, one backward."""
    model = load_reference_model(path, "lm")
    model.train()
    total, tokens = torch.zeros(()), 0
    for sample in samples:
        logits = model(input_ids=sample.input_ids[None]).logits[0]
        start = len(sample.prompt) - 1
        predicting = logits[start : start + len(sample.response)] / KIT_TEMPERATURE
        log_softmax = torch.log_softmax(predicting, dim=-1)
        log_probs = log_softmax.gather(-1, sample.response[:, None])[:, 0]
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        total = total + (policy_token_loss(log_probs, entropy, sample.advantages) * sample.loss_mask).sum()
        tokens += int(sample.loss_mask.sum())
    loss = total / tokens
    loss.backward()
    return float(loss), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def max_diff(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    difference = (actual.detach().float().cpu() - expected.detach().float().cpu()).abs()
    if mask is not None:
        difference = difference[mask]
    return float(difference.max()) if difference.numel() else 0.0


def max_state_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    if list(actual) != list(expected):
        raise AssertionError(f"names differ: {list(actual)} vs {list(expected)}")
    return max(max_diff(actual[name], expected[name]) for name in expected)


# -- engines ----------------------------------------------------------------------------------------


@attrs.frozen
class Context:
    rank: int
    world_size: int
    device: str
    workdir: Path
    models: Models
    registry: Any

    def engine(
        self,
        path: str,
        role: str = "lm",
        micro_batch: MicroBatchConfig | None = None,
        **options: Any,
    ):
        config = EngineConfig(
            backend="ulysses",
            model=ModelConfig(path=path, dtype="float32"),
            options=UlyssesConfig(**options),
            optim=OPTIM,
            micro_batch=micro_batch or MicroBatchConfig(micro_batch_size=2),
            device=self.device,
            seed=0,
        )
        engine = build_engine(config, role, self.registry)
        engine.initialize()
        return engine


def infer(engine, batch: TensorDict) -> TensorDict | None:
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs


def train_step(engine, batch: TensorDict) -> dict[str, float]:
    with engine.train_mode():
        return engine.train_batch(batch, policy_loss_fn)


def gradients(engine, batch: TensorDict) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward/backward (no step): the reported loss and every full gradient (a collective)."""
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward_batch(batch, policy_loss_fn, forward_only=False)
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu()
    return result.loss, grads


def exported(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in engine.get_per_tensor_param()}


@contextlib.contextmanager
def patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


# -- broken variants (each must be caught) ------------------------------------------------------------


def _roll_after_the_split(original: Callable[..., Any]) -> Callable[..., Any]:
    """``shard_sequence`` that labels each shard by rolling it alone (verl issue #6068's bug)."""

    def shard_sequence(*args: Any, **kwargs: Any) -> ulysses.SequenceShard:
        shard = original(*args, **kwargs)
        return attrs.evolve(shard, labels=torch.roll(shard.input_ids, -1))

    return shard_sequence


def _no_backward_scaling(original: Callable[..., Any]) -> Callable[..., Any]:
    def gather_sequence(local: torch.Tensor, group: Any, grad_scale: float) -> torch.Tensor:
        return original(local, group, 1.0)

    return gather_sequence


def _no_kv_repeat(x: torch.Tensor, sp_size: int) -> torch.Tensor:
    return x


def _interleaved_sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``_sequence_to_heads`` that sends rank ``r`` heads ``r, r + sp, r + 2 sp, ...`` (a reshape with the
    head and rank dimensions swapped) instead of ``r H/sp ..``; ``_interleaved_heads_to_sequence``
    puts every head back where it came from. Each head then attends as it should, so with one KV
    head per query head (or one KV head in all) nothing changes; with grouped KV heads a rank pairs
    query heads with KV heads of other groups."""
    sp = torch.distributed.get_world_size(group)
    local, heads, dim = x.shape
    send = x.reshape(local, heads // sp, sp, dim).permute(2, 0, 1, 3).contiguous()
    received = torch.empty_like(send)
    torch.distributed.all_to_all_single(received, send, group=group)
    return received.reshape(sp * local, heads // sp, dim)


def _interleaved_heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    sp = torch.distributed.get_world_size(group)
    total, heads, dim = x.shape
    send = x.reshape(sp, total // sp, heads, dim).contiguous()
    received = torch.empty_like(send)
    torch.distributed.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3).reshape(total // sp, heads * sp, dim)


def _tiled_gqa(original: Callable[..., Any]) -> Callable[..., Any]:
    """``segment_attention`` that expands each rank's KV heads to its query heads itself, by tiling
    (``repeat``: 0, 1, 0, 1), where grouped-query attention shares KV head ``j`` among consecutive
    query heads (``repeat_interleave``: 0, 0, 1, 1, what transformers' ``repeat_kv`` does). With one
    KV head per rank both are the same."""

    def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        groups = query.shape[1] // key.shape[1]
        return original(query, key.repeat(1, groups, 1), value.repeat(1, groups, 1), *args, **kwargs)

    return segment_attention


# -- properties ------------------------------------------------------------------------------------


@attrs.frozen
class Expected:
    """The single-process reference on the straddling batch for one model: outputs, loss, gradients."""

    outputs: dict[str, torch.Tensor]
    loss: float
    gradients: dict[str, torch.Tensor]

    @classmethod
    def of(cls, path: str) -> Expected:
        samples = straddling_samples()
        outputs = reference_outputs(load_reference_model(path, "lm"), samples, "lm", KIT_TEMPERATURE)
        return cls(outputs, *reference_loss_and_gradients(path, samples))


def measure(engine, expected: Expected) -> dict[str, float]:
    """How far ``engine``'s log-probs and entropy (on its output ranks), loss and gradients on the
    straddling batch (one packed row) are from ``expected``."""
    batch = batch_of(straddling_samples())
    outputs = infer(engine, batch)
    loss, grads = gradients(engine, batch)
    figures = {"loss": abs(loss - expected.loss), "gradients": max_state_diff(grads, expected.gradients)}
    if outputs is not None:  # SP rank 0
        mask = response_token_mask(batch)
        figures["log_probs"] = max_diff(outputs["log_probs"], expected.outputs["log_probs"], mask)
        figures["entropy"] = max_diff(outputs["entropy"], expected.outputs["entropy"], mask)
    return figures


def beyond_bounds(figures: dict[str, float]) -> list[str]:
    """The quantities of ``measure``'s ``figures`` beyond the issue's bounds."""
    bounds = {
        "log_probs": OUTPUT_ATOL,
        "entropy": OUTPUT_ATOL,
        "loss": OUTPUT_ATOL,
        "gradients": GRADIENT_ATOL,
    }
    return [f"{name} {value:.3g} > {bounds[name]}" for name, value in figures.items() if value > bounds[name]]


def equivalence(ctx: Context) -> dict[str, Any]:
    """sp=2 against the single-process reference on the straddling batch (odd length, one KV head
    for two SP ranks, a sequence across the boundary), and each broken variant against it."""
    samples = straddling_samples()
    batch = batch_of(samples)
    path = ctx.models.one_kv_head.lm
    whole = MicroBatchConfig(micro_batch_size=len(samples))  # one packed row
    expected = Expected.of(path)

    def measured() -> dict[str, float]:
        return measure(ctx.engine(path, micro_batch=whole, sp_size=2), expected)

    figures = {"layout": straddling_layout(), "sp2": measured()}
    with patched(ulysses, "shard_sequence", _roll_after_the_split(ulysses.shard_sequence)):
        figures["roll after the split"] = measured()
    with patched(ulysses, "gather_sequence", _no_backward_scaling(ulysses.gather_sequence)):
        figures["no backward scaling"] = measured()
    with patched(ulysses, "repeat_kv_heads", _no_kv_repeat):
        engine = ctx.engine(path, micro_batch=whole, sp_size=2)
        try:
            infer(engine, batch)
        except RuntimeError as error:  # raised alike on every rank, before any collective
            figures["no KV repeat"] = f"raised: {' '.join(str(error).split())[:160]}"
        else:
            figures["no KV repeat"] = "ran"

    problems = [f"sp2 {beyond}" for beyond in beyond_bounds(figures["sp2"])]
    roll = figures["roll after the split"]
    if ctx.rank == 0 and roll["log_probs"] <= OUTPUT_ATOL:
        problems.append(f"rolling after the split went unnoticed: log_probs {roll['log_probs']:.3g}")
    if roll["gradients"] <= GRADIENT_ATOL:
        problems.append(f"rolling after the split went unnoticed: gradients {roll['gradients']:.3g}")
    unscaled = figures["no backward scaling"]
    if unscaled["gradients"] <= GRADIENT_ATOL:
        problems.append(f"dropping the backward scaling went unnoticed: {unscaled['gradients']:.3g}")
    if unscaled["loss"] > OUTPUT_ATOL:  # the forward is untouched: only gradients change
        problems.append(f"the unscaled variant changed the loss: {unscaled['loss']:.3g}")
    if not str(figures["no KV repeat"]).startswith("raised"):
        problems.append(f"without repeating the one KV head for two SP ranks: {figures['no KV repeat']}")
    layout = figures["layout"]
    if layout["padding"] == 0 or not layout["predicted_across_boundary"]:
        problems.append(f"the straddling batch lost its point: {layout}")
    if problems:
        raise AssertionError("\n".join(problems))
    return figures


def meta_init(ctx: Context) -> dict[str, Any]:
    """The model built on meta and filled from rank 0: rank 0 streamed the safetensors, every buffer
    (the rotary inv_freq, in no checkpoint) is the Hugging Face model's on every rank; a loader that
    skips recomputing them is caught. A critic from a causal LM's checkpoint (no value head in the
    files) falls back to from_pretrained's seeded head."""
    lm = ctx.models.kit.lm
    expected_buffers = dict(load_reference_model(lm, "lm").named_buffers())
    problems, figures = [], {}

    def buffer_diff(engine) -> float:
        buffers = dict(engine.module.named_buffers())
        if sorted(buffers) != sorted(expected_buffers):
            raise AssertionError(f"buffers {sorted(buffers)}, expected {sorted(expected_buffers)}")
        return max(max_diff(buffers[name], expected_buffers[name]) for name in expected_buffers)

    engine = ctx.engine(lm, sp_size=2)
    figures["loaded_from"] = engine.loaded_from
    figures["buffers"] = buffer_diff(engine)
    if engine.loaded_from != "safetensors" or figures["buffers"] != 0.0:
        problems.append(f"loaded from {engine.loaded_from}, buffers differ by {figures['buffers']}")
    with patched(loading, "recompute_non_persistent_buffers", lambda model, device: None):
        figures["buffers not recomputed"] = buffer_diff(ctx.engine(lm, sp_size=2))
    if figures["buffers not recomputed"] == 0.0:
        problems.append("a loader that keeps to_empty's buffers went unnoticed")

    critic = ctx.engine(lm, role="value", sp_size=2)
    expected_critic = load_hf_model(ModelConfig(path=lm), "value", seed=0).state_dict()
    figures["critic loaded_from"] = critic.loaded_from
    figures["critic weights"] = max_state_diff(exported(critic), dict(expected_critic))
    if critic.loaded_from != "from_pretrained" or figures["critic weights"] != 0.0:
        problems.append(
            f"critic from an LM checkpoint: loaded from {critic.loaded_from}, weights differ by "
            f"{figures['critic weights']}"
        )
    if problems:
        raise AssertionError("\n".join(problems))
    return figures


def checkpoint_across_layouts(ctx: Context) -> dict[str, Any]:
    """Train a step at sp=2, save; load at (dp 2, sp 1): the same weights (bitwise), log-probs (1e-5),
    and the same next step (its optimiser state resharded). Rank 0 leaves what the 1-process test
    compares its own load against."""
    samples = {name: make_samples(seed) for name, seed in (("A", 1), ("B", 2), ("C", 3))}
    path = ctx.workdir / CHECKPOINT
    lm = ctx.models.kit.lm
    at_sp2 = ctx.engine(lm, sp_size=2)
    train_step(at_sp2, batch_of(samples["A"]))
    at_sp2.save_checkpoint(str(path), global_step=1)
    saved = exported(at_sp2)
    outputs = infer(at_sp2, batch_of(samples["B"]))
    continued = train_step(at_sp2, batch_of(samples["C"]))
    continued_params = exported(at_sp2)
    # SP rank 0 owns the outputs; the DP ranks of the next engine each compare their rows.
    shared = [None if outputs is None else outputs["log_probs"]]
    torch.distributed.broadcast_object_list(shared, src=0)
    log_probs = shared[0]
    if ctx.rank == 0:
        torch.save({"params": saved, "log_probs": log_probs}, ctx.workdir / SAVED)

    at_dp2 = ctx.engine(lm, sp_size=1)  # two DP ranks of one SP rank each
    rows = shard(samples["B"], at_dp2.dp_rank, at_dp2.dp_size)
    step = at_dp2.load_checkpoint(str(path))
    mask = response_token_mask(batch_of(samples["B"][rows]))
    figures = {
        "global step": step,
        "weights": max_state_diff(exported(at_dp2), saved),
    }
    outputs = infer(at_dp2, batch_of(samples["B"][rows]))
    figures["log_probs"] = max_diff(outputs["log_probs"], log_probs[rows], mask)
    resumed = train_step(at_dp2, batch_of(samples["C"][rows]))
    figures["next step loss"] = abs(resumed["loss"] - continued["loss"])
    figures["next step grad_norm"] = abs(resumed["grad_norm"] - continued["grad_norm"])
    figures["weights after the next step"] = max_state_diff(exported(at_dp2), continued_params)
    problems = []
    if step != 1 or figures["weights"] != 0.0 or figures["log_probs"] > OUTPUT_ATOL:
        problems.append(f"load at (dp 2, sp 1): {figures}")
    if (
        max(figures[k] for k in ("next step loss", "next step grad_norm", "weights after the next step"))
        > STEP_ATOL
    ):
        problems.append(f"the step after loading at (dp 2, sp 1) differs: {figures}")
    if problems:
        raise AssertionError("\n".join(problems))
    return figures


def other_layouts(ctx: Context) -> dict[str, Any]:
    """HSDP (``dp_replicate_size: 2``: a 2-D mesh, weights broadcast along the replicated dimension at
    load), with its layers kept gathered from forward to backward (``reshard_after_forward: false``),
    takes the reference's first step; bf16 compute (the all-to-alls carry bf16) stays close to fp32 and
    trains."""
    samples = make_samples(1)
    lm = ctx.models.kit.lm
    hsdp = ctx.engine(lm, dp_replicate_size=2, reshard_after_forward=False)
    placements = {tuple(p.placements) for p in hsdp.module.parameters()}
    rows = shard(samples, hsdp.dp_rank, hsdp.dp_size)
    metrics = train_step(hsdp, batch_of(samples[rows]))
    expected = reference_step(lm, "lm", samples, OPTIM, KIT_TEMPERATURE)
    figures = {
        "hsdp placements": sorted(str(p) for p in placements),
        "hsdp loss": abs(metrics["loss"] - expected.loss),
        "hsdp grad_norm": abs(metrics["grad_norm"] - expected.grad_norm),
        "hsdp weights": max_state_diff(exported(hsdp), expected.params),
    }
    del hsdp
    batch = batch_of(samples)
    fp32_engine = ctx.engine(lm, sp_size=2)
    fp32 = infer(fp32_engine, batch)
    # Inference has no backward to reshard the root: the engine does, so the shards are registered again.
    figures["sharded after inference"] = all(isinstance(p, DTensor) for p in fp32_engine.module.parameters())
    bf16 = ctx.engine(lm, sp_size=2, param_dtype="bfloat16", reduce_dtype="float32")
    outputs = infer(bf16, batch)
    bf16_step = train_step(bf16, batch)
    if outputs is not None:
        figures["bf16 log_probs vs fp32"] = max_diff(
            outputs["log_probs"], fp32["log_probs"], response_token_mask(batch)
        )
    figures["bf16 step grad_norm"] = bf16_step["grad_norm"]
    problems = []
    if not figures["sharded after inference"]:
        problems.append("gathered parameters stay registered after inference")
    if placements != {(Replicate(), Shard(0))}:
        problems.append(f"HSDP placements {placements}")
    if max(figures[k] for k in ("hsdp loss", "hsdp grad_norm", "hsdp weights")) > STEP_ATOL:
        problems.append(f"HSDP's first step differs from the reference: {figures}")
    if not 0.0 < figures.get("bf16 log_probs vs fp32", 0.01) < 0.1 or not bf16_step["grad_norm"] > 0:
        problems.append(f"bf16 compute: {figures}")
    if problems:
        raise AssertionError("\n".join(problems))
    return figures


@attrs.frozen
class LayoutBug:
    """A broken variant of ``ulysses`` that head layouts tell apart: ``patches`` replace its functions
    (each given the original), ``caught_on`` are layouts where it must be caught, ``right_on`` one
    where it is right (why a layout that cannot see it is not enough)."""

    name: str
    patches: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]
    caught_on: tuple[int, int]
    right_on: tuple[int, int]


#: The broken variants ``head_layouts`` runs.
LAYOUT_BUGS = (
    LayoutBug(
        "interleaved all-to-all",
        {
            "_sequence_to_heads": lambda original: _interleaved_sequence_to_heads,
            "_heads_to_sequence": lambda original: _interleaved_heads_to_sequence,
        },
        caught_on=(8, 4),
        right_on=(4, 4),
    ),
    LayoutBug("tiled GQA", {"segment_attention": _tiled_gqa}, caught_on=(8, 4), right_on=(4, 2)),
)


def head_layouts(ctx: Context) -> dict[str, Any]:
    """At sp 2, each layout of ``HEAD_LAYOUTS`` against the single-process reference on the straddling
    batch, and ``LAYOUT_BUGS``' variants caught where they must be (and right where they must be): an
    all-to-all that interleaves the heads over the ranks, right where every query head has its own KV
    head (4, 4), caught with grouped ones; KV heads expanded to their query heads by tiling, caught
    with two KV heads per rank (8, 4), right with one, as the kit's model has."""
    sp = 2
    whole = MicroBatchConfig(micro_batch_size=len(straddling_samples()))  # one packed row
    expected: dict[tuple[int, int], Expected] = {}

    def run(layout: tuple[int, int]) -> dict[str, float]:
        path = ctx.models.layout(*layout).lm
        expected.setdefault(layout, Expected.of(path))
        return measure(ctx.engine(path, micro_batch=whole, sp_size=sp), expected[layout])

    figures: dict[str, Any] = {"layout": straddling_layout(sp)}
    problems = []
    for heads, kv_heads in HEAD_LAYOUTS:
        measured = figures[f"{heads} heads, {kv_heads} KV heads"] = run((heads, kv_heads))
        problems += [f"sp{sp}, ({heads}, {kv_heads}): {beyond}" for beyond in beyond_bounds(measured)]
    for bug in LAYOUT_BUGS:
        with contextlib.ExitStack() as stack:
            for function, broken in bug.patches.items():
                stack.enter_context(patched(ulysses, function, broken(getattr(ulysses, function))))
            caught, right = run(bug.caught_on), run(bug.right_on)
        figures[f"{bug.name} on {bug.caught_on}"], figures[f"{bug.name} on {bug.right_on}"] = caught, right
        if not beyond_bounds(caught):
            problems.append(f"{bug.name} went unnoticed on {bug.caught_on}: {caught}")
        if beyond_bounds(right):
            problems.append(f"{bug.name} should be right on {bug.right_on}: {right}")
    if problems:
        raise AssertionError("\n".join(problems))
    return figures


JOBS: dict[str, list[Callable[[Context], dict[str, Any]]]] = {
    "sp2": [equivalence, meta_init, checkpoint_across_layouts, other_layouts, head_layouts],
}


# -- the two sides ------------------------------------------------------------------------------------


def run(job: str, world_size: int, workdir: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """Run ``job`` on ``world_size`` processes; return each rank's results."""
    ranks = workdir / f"ranks_{job}"
    shutil.rmtree(ranks, ignore_errors=True)  # a stale rendezvous file would send ranks to dead ports
    try:
        spawn(
            run_job,
            (job, str(workdir)),
            world_size=world_size,
            workdir=ranks,
            timeout_s=JOB_TIMEOUT_S,
            device=device,
        )
    except SpawnError as error:
        raise JobFailed(f"job {job!r}: {error}") from None
    return [json.loads((workdir / f"{job}_rank{rank}.json").read_text()) for rank in range(world_size)]


def run_job(rank: Rank, job: str, workdir: str) -> None:
    """The rank side: the process group is up; check the job's properties in order."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    registry = Registry.from_plugins(autoload=True)  # the installed entry point, as users get it
    ctx = Context(
        rank.rank, rank.world_size, rank.device, Path(workdir), Models.under(Path(workdir)), registry
    )
    results = {}
    for prop in JOBS[job]:
        try:
            results[prop.__name__] = {"error": None, "figures": prop(ctx)}
        except Exception:
            # Also into the rank's log, which a timeout's report carries (see fsdp_jobs.outcome).
            reason = traceback.format_exc()
            print(f"{prop.__name__} failed on rank {rank.rank}:\n{reason}", file=sys.stderr)
            results[prop.__name__] = {"error": reason, "figures": None}
    (Path(workdir) / f"{job}_rank{rank.rank}.json").write_text(json.dumps(results, indent=2, default=str))
