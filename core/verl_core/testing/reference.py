"""The independent single-process reference every conformance check compares an engine (or a
rollout) with.

Plain PyTorch and ``transformers`` only, none of core's engine helpers: each sample is run
*unpadded* through the Hugging Face model (eager attention, default positions), log-probs are
``log_softmax(logits / T)`` gathered at the response tokens, entropy is ``-sum p log p``, the
training step is one ``loss.backward()`` over the whole batch, ``clip_grad_norm_`` and
``torch.optim.AdamW``. Padding, micro-batching, data parallelism and global counts never enter it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from verl_core.config.engine import OptimConfig
from verl_core.data.batch import CANDIDATE_LOG_PROBS, ENTROPY, LOG_PROBS, VALUES
from verl_core.testing.losses import distillation_token_loss, policy_token_loss, value_token_loss
from verl_core.testing.tiny import RESPONSE_LENGTH, Sample

#: One sample's teacher top-k: token ids ``[r, k]`` and their log-probs ``[r, k]`` (``teacher_top_k``).
TeacherTopK = tuple[torch.Tensor, torch.Tensor]


def load_reference_model(path: str, role: str) -> torch.nn.Module:
    """The Hugging Face model of ``path`` for ``role`` (``lm`` or ``value``), fp32, eager attention."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    model_class = AutoModelForTokenClassification if role == "value" else AutoModelForCausalLM
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def sample_outputs(
    model: torch.nn.Module,
    sample: Sample,
    role: str,
    temperature: float,
    candidate_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Outputs at each response token of one unpadded sample: ``log_probs`` and ``entropy`` of the
    tempered distribution (``lm``), or ``values`` (``value``), each ``[r]``; with ``candidate_ids``
    ``[r, k]`` also their log-probs ``candidate_log_probs`` ``[r, k]``.

    Response token ``t`` is predicted from the position just before it, so its outputs come from
    the model output at position ``p + t - 1``.
    """
    prompt_length, response_length = len(sample.prompt), len(sample.response)
    logits = model(input_ids=sample.input_ids.unsqueeze(0)).logits[0]
    predicting = logits[prompt_length - 1 : prompt_length + response_length - 1]
    if role == "value":
        return {VALUES: predicting[:, 0]}
    log_softmax = F.log_softmax(predicting / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, sample.response.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    outputs = {LOG_PROBS: log_probs, ENTROPY: entropy}
    if candidate_ids is not None:
        outputs[CANDIDATE_LOG_PROBS] = log_softmax.gather(-1, candidate_ids)
    return outputs


@torch.no_grad()
def reference_log_softmax(
    model: torch.nn.Module, samples: Sequence[Sample], temperature: float
) -> torch.Tensor:
    """``log_softmax(logits / T)`` at each response token of every sample, each run alone and
    unpadded in eval mode: ``[B, RESPONSE_LENGTH, V]``, zeros after each response. A top-k, or the
    log-probs of any tokens, are read from it."""
    model.eval()
    return pad_responses(
        [
            F.log_softmax(
                response_logits(model, sample.prompt.tolist(), sample.response.tolist()) / temperature, -1
            )
            for sample in samples
        ]
    )


@torch.no_grad()
def response_logits(model: torch.nn.Module, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """The logits ``[r, V]`` that predict each of ``response``'s tokens, teacher-forced: ``prompt``
    and ``response`` run alone, unpadded, through the Hugging Face model in eval mode (default
    positions, no cache). Row ``t`` comes from position ``p + t - 1``, as in ``sample_outputs``.
    The rollout kit's reference: ``log_softmax(logits / T)`` is what an engine computes for them."""
    model.eval()
    input_ids = torch.tensor([[*prompt, *response]], dtype=torch.int64)
    logits = model(input_ids=input_ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1].float()


@torch.no_grad()
def next_token_logits(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits ``[B, V]`` that predict each prompt's first response token (its last position's),
    each prompt run unpadded through the Hugging Face model in eval mode; prompts of one length go
    in one batch, which needs no padding. ``response_logits``' first row, for many prompts at once."""
    model.eval()
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    for indices in by_length.values():
        input_ids = torch.tensor([list(prompts[index]) for index in indices], dtype=torch.int64)
        for index, row in zip(indices, model(input_ids=input_ids).logits[:, -1].float(), strict=True):
            logits[index] = row
    return torch.stack(logits)


def pad_responses(per_sample: Sequence[torch.Tensor], width: int = RESPONSE_LENGTH) -> torch.Tensor:
    """Stack per-sample ``[r]`` (or ``[r, ...]``) tensors into ``[B, width]`` (``[B, width, ...]``),
    zeros after each response."""
    first = per_sample[0]
    padded = first.new_zeros(len(per_sample), width, *first.shape[1:])
    for row, values in enumerate(per_sample):
        padded[row, : len(values)] = values
    return padded


@torch.no_grad()
def reference_outputs(
    model: torch.nn.Module, samples: Sequence[Sample], role: str, temperature: float
) -> dict[str, torch.Tensor]:
    """``sample_outputs`` of every sample in eval mode, padded to ``[B, RESPONSE_LENGTH]``."""
    model.eval()
    per_sample = [sample_outputs(model, sample, role, temperature) for sample in samples]
    return {name: pad_responses([outputs[name] for outputs in per_sample]) for name in per_sample[0]}


@attrs.frozen
class ReferenceStep:
    """One reference optimiser step: the full-batch loss, the gradient norm before clipping, the
    parameters after the step (Hugging Face names, state-dict order) and the model itself."""

    loss: float
    grad_norm: float
    lr: float
    params: dict[str, torch.Tensor]
    model: torch.nn.Module = attrs.field(eq=False, repr=False)


def scheduled_lr(optim: OptimConfig, steps_taken: int) -> float:
    """The learning rate of the optimiser step after ``steps_taken`` steps, written out for the
    schedules the kit uses: constant, and linear decay from ``lr`` to ``min_lr_ratio * lr`` over
    ``total_steps`` (no warmup)."""
    if optim.lr_warmup_steps:
        raise ValueError("the reference schedules have no warmup")
    if optim.lr_scheduler == "constant":
        return optim.lr
    if optim.lr_scheduler == "linear":
        remaining = 1.0 - min(1.0, steps_taken / optim.total_steps)
        return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * remaining)
    raise ValueError(f"the reference knows no lr_scheduler={optim.lr_scheduler!r}")


def reference_steps(
    path: str,
    role: str,
    batches: Sequence[Sequence[Sample]],
    optim: OptimConfig,
    temperature: float,
    teacher: Sequence[TeacherTopK] | None = None,
) -> list[ReferenceStep]:
    """Load ``path``; take one AdamW step per batch on the token-mean loss over all of its samples,
    at the rate ``scheduled_lr`` gives for that step. One ``ReferenceStep`` per step (they share the
    model, which ends in the state after the last step). ``teacher``: the loss is the distillation
    loss on it, for every batch (``reference_loss``)."""
    model = load_reference_model(path, role)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    steps = []
    for taken, samples in enumerate(batches):
        lr = scheduled_lr(optim, taken)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = reference_loss(model, samples, role, temperature, teacher)
        loss.backward()
        max_norm = optim.clip_grad if optim.clip_grad > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm))
        optimizer.step()
        params = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        steps.append(ReferenceStep(float(loss.detach()), grad_norm, lr, params, model))
    return steps


def reference_loss(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    role: str,
    temperature: float,
    teacher: Sequence[TeacherTopK] | None = None,
) -> torch.Tensor:
    """The kit's loss on ``samples`` (each run alone, unpadded): the token mean over all of them of
    the policy loss (``lm``) or the value loss (``value``), differentiable. With ``teacher`` (each
    sample's top-k ids and log-probs, ``teacher_top_k``) the distillation loss on the log-probs at
    those ids instead."""
    total = torch.zeros(())
    num_tokens = 0
    for index, sample in enumerate(samples):
        top_k = None if teacher is None else teacher[index]
        outputs = sample_outputs(model, sample, role, temperature, None if top_k is None else top_k[0])
        if role == "value":
            token_loss = value_token_loss(outputs[VALUES], sample.returns)
        elif top_k is not None:
            token_loss = distillation_token_loss(outputs[CANDIDATE_LOG_PROBS], top_k[1])
        else:
            token_loss = policy_token_loss(outputs[LOG_PROBS], outputs[ENTROPY], sample.advantages)
        total = total + (token_loss * sample.loss_mask).sum()
        num_tokens += int(sample.loss_mask.sum())
    return total / num_tokens


def reference_gradients(
    path: str, role: str, samples: Sequence[Sample], temperature: float
) -> tuple[float, dict[str, torch.Tensor]]:
    """Load ``path``; the loss on all ``samples`` and its gradient per parameter (Hugging Face names)."""
    model = load_reference_model(path, role)
    model.train()
    loss = reference_loss(model, samples, role, temperature)
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def reference_step(
    path: str,
    role: str,
    samples: Sequence[Sample],
    optim: OptimConfig,
    temperature: float,
    teacher: Sequence[TeacherTopK] | None = None,
) -> ReferenceStep:
    """Load ``path``, take one AdamW step on the token-mean loss over all ``samples`` (the
    distillation loss on ``teacher``'s top-k, if given)."""
    if optim.lr_scheduler != "constant" or optim.lr_warmup_steps:
        raise ValueError("the reference step takes a constant learning rate without warmup")
    return reference_steps(path, role, [samples], optim, temperature, teacher)[0]


@torch.no_grad()
def hf_state_dict(path: str, role: str) -> dict[str, torch.Tensor]:
    """The state dict ``from_pretrained`` gives for ``path``: names, order, shapes and values that a
    weight export must reproduce."""
    return dict(load_reference_model(path, role).state_dict())
