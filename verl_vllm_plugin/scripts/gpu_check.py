"""Prove the vllm rollout's GPU paths on a CUDA machine: ``python verl_vllm_plugin/scripts/gpu_check.py``.

1. The rollout kit (every check of ``verl_core.testing.ROLLOUT_CHECKS``) on ``cuda`` with CUDA graphs
   (``enforce_eager: false``, the GPU default) and vLLM's sleep mode, on the kit's tiny model made wide
   enough for vLLM's attention kernels; prints each check and the measured log-prob tolerance against
   the declared one. First it builds one engine alone to confirm CUDA graphs were captured and which
   model runner's sampler the tempered log-probs wrap (V2 by default, V1 with
   ``VLLM_USE_V2_MODEL_RUNNER=0``).
2. With two GPUs or more: tensor parallelism, two processes (ranks) sharing one engine
   (``tensor_parallel_size: 2``, vLLM's ``external_launcher`` over their NCCL process group), each
   calling ``generate`` with prompts of its own, whose log-probs must be the Hugging Face reference's
   within the declared tolerance. With one GPU it says so and skips it.

Exits non-zero when CUDA or vLLM's GPU build is missing (nothing would be proved) or when any check
fails. Needs the editable installs (``pip install -e .[test] -e verl_vllm_plugin``) and ``vllm==0.32.*``.
A few minutes (CUDA graph capture is most of each engine's start).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

#: The kit's model with heads of 32 dimensions (its default has 8, below vLLM's kernels' smallest).
SPEC = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
#: The rollout's options: CUDA graphs on (the GPU default, stated), a small share of the GPU.
OPTIONS = {"enforce_eager": False, "gpu_memory_utilization": 0.3, "block_size": 16}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Exits 0 when every check passed."
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the kit's model is written (default: a temporary folder)",
    )
    parser.add_argument(
        "--skip-tp", action="store_true", help="skip the tensor-parallel check even with two GPUs"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run this on a GPU machine", file=sys.stderr)
        return 2
    import importlib.metadata

    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        print('gpu_check: vLLM\'s GPU build is not installed: pip install "verl-core[vllm]"', file=sys.stderr)
        return 2
    import vllm

    names = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    print(
        f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, vLLM {vllm.__version__}, GPUs {names}"
    )
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-check-") as scratch:
        workdir = args.workdir or Path(scratch)
        from verl_core.testing import TinyModelSpec, save_rollout_model

        model_dir = save_rollout_model(workdir / "model", TinyModelSpec(**SPEC))
        failures = engine_check(model_dir) + kit_check(model_dir)
        if args.skip_tp:
            print("gpu_check: tensor parallelism skipped (--skip-tp)")
        elif torch.cuda.device_count() < 2:
            print(f"gpu_check: tensor parallelism skipped: {torch.cuda.device_count()} GPU here, it needs 2")
        else:
            failures += tensor_parallel_check(model_dir)
    print(f"gpu_check: {'FAILED: ' + '; '.join(failures) if failures else 'every check passed'}")
    return 1 if failures else 0


def engine_check(model_dir: str) -> list[str]:
    """One engine alone: CUDA graphs captured, the sampler wrapped, a generation."""
    from vllm.config import CUDAGraphMode

    from verl_core.config.engine import ModelConfig
    from verl_core.rollout import SamplingParams
    from verl_vllm.config import VLLMRolloutConfig
    from verl_vllm.rollout import VLLMRollout

    rollout = VLLMRollout(
        ModelConfig(path=model_dir, dtype="float32"), VLLMRolloutConfig(**OPTIONS), device="cuda"
    )
    rollout.initialize()
    try:
        mode = rollout.engine.vllm_config.compilation_config.cudagraph_mode
        (sampler,) = rollout.engine.collective_rpc(
            lambda worker: type(worker.model_runner.sampler).__module__
        )
        print(
            f"gpu_check: engine: cudagraph_mode={mode}, sampler {sampler}, sleep mode {rollout._sleep_mode}"
        )
        output = rollout.generate(
            [[5, 6, 7]] * 4, SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=0), 0
        )
        problems = []
        if mode == CUDAGraphMode.NONE:
            problems.append("CUDA graphs are off although enforce_eager is false")
        if tuple(output["responses"].shape) != (4, 8):
            problems.append(f"generate returned responses of shape {tuple(output['responses'].shape)}")
        return problems
    finally:
        rollout.close()


def kit_check(model_dir: str) -> list[str]:
    from verl_core.plugins import get_registry
    from verl_core.testing import run_rollout_conformance

    report = run_rollout_conformance("vllm", options=OPTIONS, device="cuda", model_dir=model_dir)
    if report.error:
        print(f"gpu_check: the kit could not run: {report.error}")
        return ["the rollout kit could not run"]
    failed = []
    for name, outcome in report.outcomes.items():
        print(f"  {name}: {outcome.status}")
        for comparison in outcome.comparisons:
            if not comparison.passed or comparison.quantity == "the declared log_prob_tolerance holds":
                print(f"    {comparison.describe()}")
        for reason in outcome.reasons:
            print(f"    {reason}")
        if outcome.status not in ("passed", "skipped"):
            failed.append(f"kit check {name}")
    declared = get_registry().get("rollout_backends", "vllm").capabilities.log_prob_tolerance
    print(
        f"gpu_check: declared log_prob_tolerance {declared:g} (the log_probs line above has the measured value)"
    )
    return failed


def tensor_parallel_check(model_dir: str) -> list[str]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [
        context.Process(target=tensor_parallel_rank, args=(rank, port, model_dir, queue)) for rank in range(2)
    ]
    for process in ranks:
        process.start()
    results = [queue.get(timeout=900) for _ in ranks]
    for process in ranks:
        process.join(timeout=60)
    failures = []
    for rank, worst, error in sorted(results):
        measured = f"max |log-prob - reference| / (1 + |reference|) = {worst:.3g}"
        print(f"gpu_check: tensor parallel rank {rank}: {error or measured}")
        if error:
            failures.append(f"tensor parallel rank {rank}")
    return failures


def tensor_parallel_rank(rank: int, port: int, model_dir: str, queue) -> None:
    """One rank of a two-GPU engine, as an actor rank runs it: the trainer's NCCL group first."""
    import datetime

    import torch
    import torch.distributed as dist

    worst, error = float("nan"), None
    try:
        torch.cuda.set_device(rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=10))
        from verl_core.config.engine import ModelConfig
        from verl_core.data import ROLLOUT_LOG_PROBS
        from verl_core.rollout import SamplingParams
        from verl_core.testing.reference import load_reference_model
        from verl_core.testing.rollout_context import make_prompts, reference_log_probs
        from verl_vllm.config import VLLMRolloutConfig
        from verl_vllm.rollout import VLLMRollout

        options = VLLMRolloutConfig(**OPTIONS, tensor_parallel_size=2, enable_sleep_mode=False)
        rollout = VLLMRollout(ModelConfig(path=model_dir, dtype="float32"), options, device=f"cuda:{rank}")
        rollout.initialize()
        prompts = make_prompts([6] * (3 + rank), seed=300 + rank)  # each rank its own prompts, unequal shares
        sampling = SamplingParams(max_new_tokens=12, eos_token_ids=(2,), pad_token_id=0, temperature=0.7)
        output = rollout.generate(prompts, sampling, seed=rank).to("cpu")
        expected, mask = reference_log_probs(load_reference_model(model_dir, "lm").eval(), output, 0.7)
        # As the kit's log_probs check measures it: |rollout - reference| / (1 + |reference|).
        difference = (output[ROLLOUT_LOG_PROBS].double() - expected).abs() / (1 + expected.abs())
        worst = float(difference[mask].max())
        from verl_core.plugins import get_registry

        declared = get_registry().get("rollout_backends", "vllm").capabilities.log_prob_tolerance
        if not worst <= declared:
            error = f"max |log-prob - reference| / (1 + |reference|) = {worst:.3g}, declared {declared:g}"
        rollout.close()
        dist.destroy_process_group()
    except BaseException as caught:  # reported to the parent, which decides the exit code
        import traceback

        error = f"{type(caught).__name__}: {caught}\n{traceback.format_exc()[-2000:]}"
    queue.put((rank, worst, error))


if __name__ == "__main__":
    sys.exit(main())
