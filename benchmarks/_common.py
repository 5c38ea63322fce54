"""Helpers the benchmarks share (``engine_overhead.py``, ``memory.py``, ``grpo_vs_trl.py``, ``async.py``);
not a benchmark.

- ``--fsdp KEY=VALUE`` options of the fsdp engine: any field of ``verl_fsdp.config.FSDPConfig`` (so
  options added later need no change here), the value parsed as YAML and structured as a config
  override's would be (``verl_core.config``: unknown keys and wrong types refused, with the path);
- a Qwen2 built from a config and written with ``save_pretrained`` (nothing is downloaded);
- a policy-gradient batch in the batch contract, and engines built through the plugin registry;
- a trainer's run with the time each step ended and its metrics (``fit_timed``);
- the spawned ranks' results, written by rank 0 and read back by the parent;
- this machine's limits (streaming read bandwidth, matrix-product throughput), its CPU and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

#: Where the spawned ranks' results go, inside each run's folder.
RESULT_FILE = "result.json"


def fsdp_option(text: str) -> tuple[str, Any]:
    """argparse ``type`` of ``--fsdp KEY=VALUE``: the value is YAML, as in a config override
    (``true``, ``4``, ``bfloat16``, ``[Qwen2DecoderLayer]``)."""
    from verl_core.config.loading import parse_override

    try:
        override = parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(override.steps) != 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name one option of the fsdp engine, e.g. cpu_offload=true"
        )
    return override.steps[0], override.value


def add_fsdp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fsdp",
        type=fsdp_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the fsdp engine (a field of verl_fsdp.config.FSDPConfig), repeatable",
    )


def fsdp_options(parser: argparse.ArgumentParser, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``--fsdp`` pairs as a mapping, checked against ``FSDPConfig`` now (not after minutes of
    benchmarking): unknown keys and bad values fail with the config loader's messages."""
    from verl_core.errors import ConfigError

    options = dict(pairs)
    try:
        structure_options("fsdp", options)
    except ConfigError as exc:
        parser.error(f"--fsdp: {exc}")
    return options


def structure_options(backend: str, options: dict[str, Any]) -> Any:
    """``options`` structured into ``backend``'s options class, as a run config's section is."""
    from verl_core.config.convert import structure
    from verl_core.plugins import Kind, get_registry

    options_class = get_registry().entry(Kind.ENGINE_BACKENDS, backend).load("config")
    return structure(options, options_class, f"engine.{backend}")


def options_label(backend: str, options: dict[str, Any]) -> str:
    """``fsdp`` or ``fsdp[reshard_after_forward=False]``."""
    if not options:
        return backend
    return f"{backend}[{','.join(f'{key}={value}' for key, value in options.items())}]"


def quiet_transformers() -> None:
    """No progress bars for every ``save_pretrained`` / ``from_pretrained``: they would bury the table."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def save_qwen2(directory: str | Path, seed: int = 0, **dimensions: Any) -> tuple[str, int]:
    """A seeded Qwen2 causal LM built from ``Qwen2Config(**dimensions)`` (fp32), saved under
    ``directory``; returns its path and parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_core.toolkit import seeded

    config = Qwen2Config(pad_token_id=0, dtype="float32", **dimensions)
    with seeded(seed):
        model = Qwen2ForCausalLM(config)
    path = str(Path(directory) / "model")
    model.save_pretrained(path)
    return path, sum(parameter.numel() for parameter in model.parameters())


def policy_batch(
    sequences: int,
    prompt_length: int,
    response_length: int,
    vocab_size: int,
    seed: int = 0,
    temperature: float = 1.0,
    compute_entropy: bool = True,
):
    """A ``[sequences, prompt_length + response_length]`` batch for ``policy_loss_fn``: prompts of
    half to all of ``prompt_length`` tokens (left-padded), responses of half to all of
    ``response_length`` (right-padded), random tokens and advantages."""
    from tensordict import TensorDict

    from verl_core.data import COMPUTE_ENTROPY, TEMPERATURE
    from verl_core.data import batch as keys

    generator = torch.Generator().manual_seed(seed)

    def lengths(longest: int) -> torch.Tensor:
        return torch.randint(longest // 2, longest + 1, (sequences,), generator=generator)

    columns = torch.arange(prompt_length + response_length)
    prompt_mask = columns[None, :prompt_length] >= prompt_length - lengths(prompt_length)[:, None]
    response_mask = columns[None, :response_length] < lengths(response_length)[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1).long()
    input_ids = torch.randint(1, vocab_size, attention_mask.shape, generator=generator) * attention_mask
    batch = TensorDict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, prompt_length:].clone(),
            keys.RESPONSE_MASK: response_mask.long(),
            keys.ADVANTAGES: torch.randn(sequences, response_length, generator=generator),
        },
        batch_size=[sequences],
    )
    batch.set_non_tensor(TEMPERATURE, temperature)
    batch.set_non_tensor(COMPUTE_ENTROPY, compute_entropy)
    return batch


def build_engine(
    backend: str,
    model_path: str,
    options: dict[str, Any] | None = None,
    micro_batch_size: int = 1,
    packing: bool = False,
    lr: float = 1e-4,
    compile_layers: bool = False,
    model_options: dict[str, Any] | None = None,
):
    """An initialised ``backend`` engine (role ``lm``, fp32, CPU, weight decay 0.01, clipping at 1)
    found through the installed plugins, with ``options`` structured into its options class and
    ``model_options`` further ``ModelConfig`` fields (LoRA's)."""
    from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
    from verl_core.engine import build_engine as build

    config = EngineConfig(
        backend=backend,
        model=ModelConfig(
            path=model_path, dtype="float32", compile_layers=compile_layers, **(model_options or {})
        ),
        options=structure_options(backend, options or {}),
        optim=OptimConfig(lr=lr),
        micro_batch=MicroBatchConfig(micro_batch_size=micro_batch_size, packing=packing),
        device="cpu",
    )
    engine = build(config, "lm")
    engine.initialize()
    return engine


def fit_timed(trainer: Any) -> tuple[list[float], list[dict[str, float]]]:
    """``trainer.fit()`` (an ``RLTrainer``), then its shutdown: when each step ended (``train_step``
    returning inside ``fit``, ``time.perf_counter()``) and its metrics, in step order."""
    import contextlib
    import io

    ends: list[float] = []
    metrics: list[dict[str, float]] = []
    train_step = trainer.train_step

    def timed_step(step: int) -> dict[str, float]:
        result = train_step(step)
        metrics.append(result)
        ends.append(time.perf_counter())
        return result

    trainer.train_step = timed_step
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the dataset summary line
            trainer.fit()
    finally:
        trainer.shutdown()
    return ends, metrics


def write_result(rank: Any, result: Any) -> None:
    """Rank 0 writes ``result`` where ``read_result`` finds it (``rank`` is ``spawn``'s ``Rank``)."""
    if rank.rank == 0:
        (rank.workdir / RESULT_FILE).write_text(json.dumps(result))


def read_result(workdir: str | Path) -> Any:
    return json.loads((Path(workdir) / RESULT_FILE).read_text())


def median(values: list[float]) -> float:
    return statistics.median(values)


# -- the machine -----------------------------------------------------------------------------------


def best_seconds(run, rounds: int) -> float:
    """The fastest of ``rounds`` calls of ``run`` after one warm-up call."""
    run()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def machine_limits(rounds: int) -> dict[str, float]:
    """Streaming read bandwidth (the sum of a 1 GiB tensor) and matrix-product throughput (a 2048^3
    product, float32 and bfloat16, by the faster of torch's product and oneDNN's on a packed weight)
    at the current ``torch`` thread count, best of ``rounds``."""
    data = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    bandwidth = data.numel() * 4 / best_seconds(data.sum, rounds)
    del data
    limits = {"stream_GBps": bandwidth / 1e9}
    size = 2048
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        products = [lambda a=a, b=b: a @ b]
        if torch.backends.mkldnn.is_available():  # float32 products go to MKL, which oneDNN beats off Intel
            packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
            products.append(
                lambda a=a, packed=packed: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
            )
        seconds = min(best_seconds(product, rounds) for product in products)
        limits[f"matmul_{str(dtype).removeprefix('torch.')}_GFLOPs"] = 2 * size**3 / seconds / 1e9
    return limits


#: CPU flags that decide which kernels the products run on (``/proc/cpuinfo`` names).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine_description() -> dict[str, object]:
    """The CPU's model name, its cores, the kernel-relevant flags it has, and what torch reports it
    computes with: the figures of a benchmark mean little without them (the project's machines differ)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "flags": [flag for flag in CPU_FLAGS if flag in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def load_average() -> tuple[float, float, float]:
    """``uptime``'s 1-, 5- and 15-minute load averages (other jobs on a shared machine skew timings)."""
    return tuple(round(value, 2) for value in os.getloadavg())
