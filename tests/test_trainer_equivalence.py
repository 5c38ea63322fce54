"""One GRPO step through the trainer (Ray, 2 fsdp ranks) equals an independent single-process
computation written here: the scores (the demo's digit scorer written out), GRPO's group-normalised
advantages, the token-mean PPO loss of an on-policy step, one clipped AdamW step of the Hugging Face
model, from the responses the trainer generated. The weights after the step agree within 1e-5: the
check that the batch was split over the ranks, normalised by global counts and collected right.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.demo import run_overrides
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_core.config import load_config
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, RESPONSE_MASK, RESPONSES
from verl_core.trainer.rl import RLTrainer

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)

LR, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-3, 1e-4, 0.01, 1.0


def digit_score(response: str, truth: str) -> float:
    """Positions where the response's leading digits match the truth, over the longer of the two."""
    response = response.lstrip()
    digits = ""
    for char in response:
        if not char.isdigit():
            break
        digits += char
    longest = max(len(digits), len(truth))
    return sum(a == b for a, b in zip(digits, truth, strict=False)) / longest if longest else 0.0


def reference_step(model_dir, prompts, responses, scores_by_group, n):
    """One on-policy GRPO step in plain PyTorch; the weights after it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)
    advantages = []
    for group in scores_by_group:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        advantages += [(s - mean) / (std + 1e-6) for s in group]
    total, tokens = torch.zeros(()), 0
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        ratio = torch.exp(log_probs - log_probs.detach())  # on policy: 1, with the policy's gradient
        total = total + (-advantages[i] * ratio).sum()
        tokens += len(response)
    (total / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
    optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_one_grpo_step_on_two_ranks_equals_the_single_process_computation(
    demo, tmp_path, ray_cluster
) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        backend="fsdp",
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "trainer.total_training_steps": 1,
            "actor.engine.optim.lr": LR,
            "actor.engine.optim.eps": EPS,
            "actor.engine.optim.weight_decay": WEIGHT_DECAY,
            "actor.engine.optim.clip_grad": CLIP_GRAD,
            "actor.engine.micro_batch.micro_batch_size": 3,  # uneven micro-batches on each rank
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        trainer.fit()
        batch = trainer.last_batch
        after = trainer.actor.weights()
    finally:
        trainer.shutdown()

    tokenizer = AutoTokenizer.from_pretrained(str(demo.model), local_files_only=True)
    width = batch[RESPONSES].shape[-1]
    prompts, responses = [], []
    for row in range(batch.batch_size[0]):
        prompt_mask = batch[ATTENTION_MASK][row, :-width].bool()
        prompts.append(batch[INPUT_IDS][row, :-width][prompt_mask].tolist())
        responses.append(batch[RESPONSES][row][batch[RESPONSE_MASK][row].bool()].tolist())
    truths = [
        row.extra["ground_truth"] for row in trainer.train_data.select(trainer.sampler.epoch_order(0)[:4])
    ]
    n = trainer.n
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores = [digit_score(text, truths[i // n]) for i, text in enumerate(texts)]
    assert scores == pytest.approx(batch["scores"].tolist())  # the reward saw the right prompts' truths
    groups = [scores[g * n : (g + 1) * n] for g in range(len(truths))]
    assert any(len(set(group)) > 1 for group in groups), "no group has a signal: the check would be vacuous"

    expected = reference_step(str(demo.model), prompts, responses, groups, n)
    assert list(after) == list(expected)
    initial = AutoModelForCausalLM.from_pretrained(str(demo.model)).state_dict()
    moved = max(float((expected[name] - initial[name]).abs().max()) for name in expected)
    assert moved > 1e-4  # the step changed the weights, so agreeing is not vacuous
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0, msg=name)
