"""Tinker's data and loss functions in the engine's terms: ``Datum`` lists as batches, losses as ``LossFn``.

A datum of ``N`` input tokens ``x`` and targets ``y`` (``y[i]`` predicted after reading ``x[0..i]``)
becomes one row of the engine's batch contract: the prompt is ``x[0]``, the response ``x[1..N-1]``
followed by ``y[N-1]``, so that response token ``i`` is predicted from exactly ``x[0..i]`` and the
engine's ``log_probs[i]`` is ``log p(y[i] | x[0..i])`` wherever ``y`` is ``x`` shifted by one (Tinker's
usual case). A batch with any other target asks the engine for the log-probs of ``y`` itself as
``candidate_ids`` (backends declaring ``top_k_log_probs``: ddp, fsdp, ulysses).

The losses are Tinker's, summed over tokens and data (not averaged), with the per-datum inputs at
each position ``i``: ``lp`` the target's log-prob under the model being trained, ``q`` the sampler's::

    cross_entropy        -sum(weights * lp)
    importance_sampling  -sum(exp(lp - q) * advantages)
    ppo                  -sum(min(r * advantages, clip(r, clip_low_threshold, clip_high_threshold) * advantages)),
                         r = exp(lp - q); thresholds from loss_fn_config, 0.8 and 1.2 by default
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from verl_core.data import batch as keys
from verl_core.data.batch import get_global_counts
from verl_core.errors import did_you_mean
from verl_core.service.types import Datum, ModelInput, TensorData

#: Batch keys of the losses' per-token inputs (beside the contract's ``advantages``).
TARGET_WEIGHTS = "target_weights"
SAMPLER_LOG_PROBS = "sampler_log_probs"

#: The ``loss_fn_inputs`` each loss reads, and the batch key each goes to (``target_tokens``: the batch's
#: tokens themselves).
LOSS_INPUTS: dict[str, dict[str, str | None]] = {
    "cross_entropy": {"target_tokens": None, "weights": TARGET_WEIGHTS},
    "importance_sampling": {
        "target_tokens": None,
        "logprobs": SAMPLER_LOG_PROBS,
        "advantages": keys.ADVANTAGES,
    },
    "ppo": {"target_tokens": None, "logprobs": SAMPLER_LOG_PROBS, "advantages": keys.ADVANTAGES},
}
#: Each loss's ``loss_fn_config`` keys and their defaults (Tinker's).
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


@attrs.frozen
class DataBatch:
    """``data`` as the engine's batch, and each datum's token count (its outputs' length)."""

    batch: TensorDict
    lengths: list[int]


def check_loss(loss_fn: str, loss_fn_config: Mapping[str, Any] | None) -> dict[str, float]:
    """The loss's settings: ``loss_fn_config`` over its defaults; an unknown loss or key is refused."""
    if loss_fn not in LOSS_INPUTS:
        raise ValueError(
            f"loss_fn={loss_fn!r} is not a loss this API computes{did_you_mean(loss_fn, LOSS_INPUTS)}: use one "
            f"of {sorted(LOSS_INPUTS)}, or forward_backward_custom for your own"
        )
    settings = dict(LOSS_CONFIG[loss_fn])
    for key, value in (loss_fn_config or {}).items():
        if key not in settings:
            known = f"its keys are {sorted(settings)}" if settings else "it takes none"
            raise ValueError(f"loss_fn_config[{key!r}]: {loss_fn!r} has no such setting ({known})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"loss_fn_config[{key!r}]={value!r}: must be a number")
        settings[key] = float(value)
    return settings


def _tokens(model_input: Any, where: str) -> list[int]:
    if not isinstance(model_input, ModelInput):
        raise TypeError(
            f"{where}.model_input is a {type(model_input).__name__}: build it with ModelInput.from_ints"
        )
    try:
        tokens = model_input.to_ints()
    except ValueError as error:
        raise ValueError(f"{where}.model_input: {error}") from None
    if not tokens:
        raise ValueError(f"{where}.model_input has no tokens: a datum needs at least one input token")
    return tokens


def _per_token(datum: Datum, key: str, length: int, where: str) -> torch.Tensor:
    value: TensorData = datum.loss_fn_inputs[key]
    tensor = value.to_torch()
    if tuple(tensor.shape) != (length,):
        raise ValueError(
            f"{where}.loss_fn_inputs[{key!r}] has shape {list(tensor.shape)} but {where}.model_input has "
            f"{length} tokens: each loss_fn_input holds one value per input token, shape [{length}] "
            "(target_tokens[i] is the token predicted after reading input tokens 0..i)"
        )
    return tensor


def build_batch(data: Sequence[Datum], inputs: Mapping[str, str | None], vocab_size: int) -> DataBatch:
    """``data`` as one batch of the engine's contract (see the module docstring), with each key of
    ``inputs`` (``loss_fn_inputs`` name to batch key) required of every datum and no other allowed.
    Errors name the datum, the key and the fix."""
    if not data:
        raise ValueError("no data: forward_backward needs at least one Datum")
    rows: list[tuple[list[int], dict[str, torch.Tensor]]] = []
    for index, datum in enumerate(data):
        where = f"data[{index}]"
        if not isinstance(datum, Datum):
            raise TypeError(f"{where} is a {type(datum).__name__}: build it with verl_core.service.Datum")
        tokens = _tokens(datum.model_input, where)
        missing = [key for key in inputs if key not in datum.loss_fn_inputs]
        if missing:
            raise ValueError(f"{where}.loss_fn_inputs lacks {missing}: this loss needs {sorted(inputs)}")
        unknown = [key for key in datum.loss_fn_inputs if key not in inputs]
        if unknown:
            raise ValueError(
                f"{where}.loss_fn_inputs has {unknown}{did_you_mean(unknown[0], inputs)}, which this loss does "
                f"not read: it takes exactly {sorted(inputs)}"
            )
        values = {key: _per_token(datum, key, len(tokens), where) for key in inputs}
        targets = values["target_tokens"]
        bad = [t for t in [*tokens, *targets.tolist()] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{where} has token id {bad[0]}, outside the model's vocabulary of {vocab_size} (ids 0..{vocab_size - 1})"
            )
        rows.append((tokens, values))

    count, length = len(rows), max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros(count, length + 1, dtype=torch.int64)
    attention_mask = torch.zeros(count, length + 1, dtype=torch.int64)
    targets = torch.zeros(count, length, dtype=torch.int64)
    columns = {column: torch.zeros(count, length) for column in inputs.values() if column is not None}
    for row, (tokens, values) in enumerate(rows):
        n = len(tokens)
        input_ids[row, :n] = torch.tensor(tokens)
        input_ids[row, n] = values["target_tokens"][-1]
        attention_mask[row, : n + 1] = 1
        targets[row, :n] = values["target_tokens"]
        for key, column in inputs.items():
            if column is not None:
                columns[column][row, :n] = values[key].float()
    response_mask = attention_mask[:, 1:].clone()
    tensors = {
        keys.INPUT_IDS: input_ids,
        keys.ATTENTION_MASK: attention_mask,
        keys.POSITION_IDS: (attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
        keys.RESPONSES: input_ids[:, 1:].clone(),
        keys.RESPONSE_MASK: response_mask,
        **columns,
    }
    if not torch.equal(targets, input_ids[:, 1:] * response_mask):
        # Targets other than the next input token: the engine scores them as candidates.
        tensors[keys.CANDIDATE_IDS] = targets.unsqueeze(-1)
    return DataBatch(TensorDict(tensors, batch_size=[count]), [len(tokens) for tokens, _ in rows])


def target_log_probs(output: Mapping[str, torch.Tensor], batch: TensorDict) -> torch.Tensor:
    """``[B, R]``: each position's target log-prob, from the engine's outputs for ``batch``."""
    if keys.CANDIDATE_IDS not in batch.keys():
        return output[keys.LOG_PROBS]
    if keys.CANDIDATE_LOG_PROBS not in output:
        raise ValueError(
            "these data have target_tokens that are not the next input token, which needs an engine backend "
            "declaring top_k_log_probs (candidate log-probs: ddp, fsdp, ulysses); with this backend, give "
            "target_tokens[i] = model_input token i + 1 (the sequence shifted by one)"
        )
    return output[keys.CANDIDATE_LOG_PROBS][..., 0]


def elementwise_loss(
    loss_fn: str, settings: Mapping[str, float], log_probs: torch.Tensor, batch: TensorDict
) -> torch.Tensor:
    """``[B, R]``: each position's term of the loss (0 on padding); the loss is their sum."""
    mask = batch[keys.RESPONSE_MASK].to(log_probs.dtype)
    if loss_fn == "cross_entropy":
        return -batch[TARGET_WEIGHTS] * log_probs * mask
    ratio = torch.exp(log_probs - batch[SAMPLER_LOG_PROBS])
    advantages = batch[keys.ADVANTAGES]
    if loss_fn == "importance_sampling":
        return -ratio * advantages * mask
    clipped = ratio.clamp(settings["clip_low_threshold"], settings["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages) * mask


def engine_loss(
    loss_fn: str, settings: Mapping[str, float]
) -> Callable[[Mapping[str, torch.Tensor], TensorDict, Any], tuple[torch.Tensor, dict[str, float]]]:
    """The engine's ``LossFn`` for ``loss_fn``: each micro-batch's sum of ``elementwise_loss``, times
    the step's DP size (the engine averages gradients over DP ranks; the loss is a sum)."""

    def loss(output: Mapping[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any):
        log_probs = target_log_probs(output, micro_batch)
        total = elementwise_loss(loss_fn, settings, log_probs, micro_batch).sum()
        return total * get_global_counts(micro_batch).dp_size, {}

    return loss


def loss_outputs(
    loss_fn: str | None, settings: Mapping[str, float], outputs: TensorDict, built: DataBatch
) -> list[dict[str, TensorData]]:
    """Per datum: ``logprobs`` of its targets and, for a built-in loss, its ``elementwise_loss``."""
    log_probs = target_log_probs(outputs, built.batch).detach().float().cpu()
    terms = None if loss_fn is None else elementwise_loss(loss_fn, settings, log_probs, built.batch.cpu())
    results = []
    for row, n in enumerate(built.lengths):
        result = {"logprobs": TensorData.from_torch(log_probs[row, :n])}
        if terms is not None:
            result["elementwise_loss"] = TensorData.from_torch(terms[row, :n])
        results.append(result)
    return results
