"""verl-core inside your own RL loop: an engine, the hf rollout and GRPO, without the trainer.

    python examples/embedding.py [--steps 2] [--out-dir DIR]

Builds the demo's tiny model and digit-reversal data (examples/demo/make_demo.py) in a temporary
folder (or DIR), then runs a few GRPO steps in this process: generate with the rollout, score with
a reward function, GRPO advantages, one optimiser step with the engine, weights into the rollout.
docs/embedding.md walks through it. Needs the fsdp backend: pip install "verl-core[fsdp]".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoTokenizer

from verl_core.algos import compute_actor_loss, get_advantage_estimator
from verl_core.config import (
    AlgorithmConfig,
    EngineConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
)
from verl_core.data import (
    ADVANTAGES,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOG_PROBS,
    TEMPERATURE,
    get_global_counts,
)
from verl_core.engine import build_engine
from verl_core.reward import load_reward_function, score_responses
from verl_core.rollout import HFRollout, SamplingParams

PROMPTS_PER_STEP = 8
RESPONSES_PER_PROMPT = 4  # GRPO compares the responses to one prompt


class Run(NamedTuple):
    """What ``main`` leaves behind: each step's metrics, and the engine and rollout it trained."""

    steps: list[dict[str, float]]
    engine: Any
    rollout: HFRollout


def build_demo(out_dir: Path) -> Any:
    """examples/demo/make_demo.py's ``build_demo`` (examples/ is not a package: loaded by path)."""
    make_demo = sys.modules.get("make_demo")
    if make_demo is None:
        path = Path(__file__).parent / "demo" / "make_demo.py"
        spec = importlib.util.spec_from_file_location("make_demo", path)
        make_demo = importlib.util.module_from_spec(spec)
        sys.modules["make_demo"] = make_demo  # dataclasses look their module up by name
        spec.loader.exec_module(make_demo)
    return make_demo.build_demo(out_dir, seed=0)


def main(steps: int = 2, out_dir: str | Path | None = None) -> Run:
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="verl_core_embedding_")
    demo = build_demo(Path(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(demo.model, local_files_only=True)
    rows = [json.loads(line) for line in demo.train.read_text().splitlines()]

    # 1. The training engine: any installed backend (`verl-core plugins`), here FSDP on one CPU rank.
    engine = build_engine(
        EngineConfig(
            backend="fsdp",
            model=ModelConfig(path=str(demo.model)),
            device="cpu",
            optim=OptimConfig(lr=1e-3),
            micro_batch=MicroBatchConfig(micro_batch_size=8),
        ),
        role="lm",
    )
    engine.initialize()

    # 2. The rollout: its own copy of the same weights, with a KV-cache decoding loop.
    rollout = HFRollout(engine.config.model, device="cpu")
    rollout.initialize()
    sampling = SamplingParams(
        max_new_tokens=8,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        temperature=1.0,
    )

    # 3. The algorithms, by name, as the trainer looks them up.
    grpo = get_advantage_estimator("grpo")
    algorithm = AlgorithmConfig(adv_estimator="grpo")
    policy_loss = PolicyLossConfig()  # PPO's clipped surrogate, token-mean
    reward = load_reward_function("digits")  # or "path/to/rewards.py:my_score"

    def loss_fn(output, micro_batch, dp_group):
        return compute_actor_loss(
            log_prob=output["log_probs"],
            old_log_prob=micro_batch[OLD_LOG_PROBS],
            advantages=micro_batch[ADVANTAGES],
            response_mask=micro_batch[RESPONSE_MASK],
            config=policy_loss,
            counts=get_global_counts(micro_batch),  # the step's global token count, for token-mean
        )

    history = []
    for step in range(steps):
        # Generate: RESPONSES_PER_PROMPT responses to each of this step's prompts.
        chosen = rows[step * PROMPTS_PER_STEP : (step + 1) * PROMPTS_PER_STEP]
        prompt_ids = [tokenizer(row["prompt"], add_special_tokens=False).input_ids for row in chosen]
        prompts = [ids for ids in prompt_ids for _ in range(RESPONSES_PER_PROMPT)]
        batch = rollout.generate(prompts, sampling, seed=step)
        batch.set_non_tensor(TEMPERATURE, sampling.temperature)  # the engine's log-probs use it too
        group = torch.arange(len(chosen)).repeat_interleave(RESPONSES_PER_PROMPT)

        # Score: the reward function sees the prompt, the decoded response and the row (ground_truth).
        mask = batch[RESPONSE_MASK].bool()
        texts = tokenizer.batch_decode(
            [ids[keep].tolist() for ids, keep in zip(batch[RESPONSES], mask, strict=True)],
            skip_special_tokens=True,
        )
        scored = score_responses(
            reward,
            [row["prompt"] for row in chosen for _ in range(RESPONSES_PER_PROMPT)],
            texts,
            [row for row in chosen for _ in range(RESPONSES_PER_PROMPT)],
        )
        scores = torch.tensor(scored.scores)

        # Advantages: the outcome score on each response's last token, normalised within its group.
        token_level_rewards = torch.zeros(mask.shape)
        token_level_rewards[torch.arange(len(scores)), mask.sum(-1) - 1] = scores
        batch[ADVANTAGES], _ = grpo(
            token_level_rewards=token_level_rewards,
            response_mask=batch[RESPONSE_MASK],
            index=group,
            config=algorithm,
        )
        # One optimiser step per batch: the rollout sampled from exactly the policy being updated.
        batch[OLD_LOG_PROBS] = batch[ROLLOUT_LOG_PROBS]

        # Train, then put the new weights into the rollout.
        with engine.train_mode():
            metrics = engine.train_batch(batch, loss_fn)
        rollout.update_weights(engine.get_per_tensor_param())

        metrics["reward"] = float(scores.mean())
        history.append(metrics)
        print(
            f"step {step + 1}: reward={metrics['reward']:.3f} loss={metrics['loss']:.4f} "
            f"grad_norm={metrics['grad_norm']:.3f}"
        )
    return Run(history, engine, rollout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out-dir", help="where the demo's assets go (default: a temporary folder)")
    args = parser.parse_args()
    main(args.steps, args.out_dir)
