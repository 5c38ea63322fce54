"""Hugging Face models for engines: load one for a role, run it on a micro-batch, export it.

Roles (``verl_core.descriptors.MODEL_ROLES``): ``lm`` is a causal LM whose outputs are per-token
log-probs of the response (policy, reference); ``value`` is a token-classification model with one
label, a scalar per token (the critic, as in verl), initialised from the same causal-LM checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedModel,
)
from transformers.modeling_utils import slice_logits_to_keep

from verl_core.config.engine import ModelConfig
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES, VALUES
from verl_core.deprecation import moved_names
from verl_core.descriptors import MODEL_ROLES
from verl_core.distributed import barrier
from verl_core.engine.base import forward_options
from verl_core.engine.checkpoint import atomic_directory
from verl_core.engine.logprob import chunked_log_probs_and_entropy, log_probs_and_entropy
from verl_core.engine.packing import pack_sequences, prompt_groups
from verl_core.engine.seed import seeded
from verl_core.engine.varlen import attn_implementation_for, packed_model_inputs, shares_prompts
from verl_core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: Every Hugging Face model directory has it: what makes an earlier export replaceable.
HF_CONFIG_FILE = "config.json"

LOG_PROBS = "log_probs"
ENTROPY = "entropy"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Files of a model directory that describe the tokenizer; copied along with an export so that the
#: exported directory is usable on its own (by the rollout, by ``from_pretrained`` + tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def check_model_dir(path: str, where: str = "model.path") -> Path:
    """``path`` as a local Hugging Face model directory, or a ``ConfigError`` at ``where`` saying what
    it is instead (missing, a file, a hub id, a folder without ``config.json``) and how to fix it.

    Models load from local folders only: nothing here reaches the network.
    """
    directory = Path(path).expanduser()
    if directory.is_dir():
        if (directory / HF_CONFIG_FILE).is_file():
            return directory
        problem = (
            f"{path!r} is a folder without {HF_CONFIG_FILE}, so it is not a Hugging Face model: point it at "
            "the folder that save_pretrained() wrote (the one holding config.json and the weights)"
        )
    elif directory.exists():
        problem = f"{path!r} is a file; give the model's folder (the one holding {HF_CONFIG_FILE})"
    else:
        problem = f"{path!r} does not exist (relative paths are relative to {Path.cwd()})"
        if _looks_like_hub_id(path):
            problem += (
                "; if it is a Hugging Face hub id: models load from local folders only (never from the "
                f"network), so download it first, e.g. `hf download {path} --local-dir "
                f"models/{path.split('/')[-1]}`, and give that folder"
            )
    raise ConfigError([(where, problem)])


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def load_hf_model(
    config: ModelConfig,
    role: str = "lm",
    seed: int = 0,
    where: str = "model",
    packing: bool = False,
    on_meta: bool = False,
) -> PreTrainedModel:
    """Load ``config.path`` (a local folder) for ``role`` on CPU, in ``config.dtype``, in train mode.

    With ``packing`` (the engine runs ``forward_micro_batch(..., packing=True)``) an ``sdpa`` model
    gets ``verl_core.engine.varlen``'s attention, which keeps packed attention as cheap as padded.
    With ``on_meta`` only the architecture is built, on the meta device, without reading the weights:
    for a rank that receives them from another (its buffers are meta tensors too, to be filled).

    Weights the checkpoint lacks (the value head of a critic built from a causal LM) are initialised
    from ``seed``, identically on every rank. ``where`` is the config path of ``config`` for errors
    (``actor.engine.model``).
    """
    if role not in MODEL_ROLES:
        raise ValueError(f"role={role!r}: expected one of {MODEL_ROLES}")
    if config.dtype not in DTYPES:
        raise ConfigError([(f"{where}.dtype", f"{config.dtype!r}: expected one of {sorted(DTYPES)}")])
    path = str(check_model_dir(config.path, f"{where}.path"))
    hf_config = AutoConfig.from_pretrained(
        path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    if role == "value":
        hf_config.num_labels = 1
        # The head's dropout would make values differ between train and eval passes.
        hf_config.classifier_dropout = 0.0
    model_class = AutoModelForCausalLM if role == "lm" else AutoModelForTokenClassification
    common = {
        "dtype": DTYPES[config.dtype],
        "attn_implementation": attn_implementation_for(config.attn_implementation, packing),
        "trust_remote_code": config.trust_remote_code,
    }
    if on_meta:
        with torch.device("meta"):
            model = model_class.from_config(hf_config, **common)
    else:
        with seeded(seed):
            model = model_class.from_pretrained(path, config=hf_config, local_files_only=True, **common)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works under DDP/FSDP; transformers renamed the method in v5.
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})
    if config.compile_layers:
        compile_decoder_layers(model, f"{where}.compile_layers")
    model.train()
    return model


def compile_decoder_layers(model: PreTrainedModel, where: str = "model.compile_layers") -> None:
    """``torch.compile`` the forward of each decoder layer (the classes of the model's
    ``_no_split_modules``), in place. Only ``forward`` is compiled, not the module call: the hooks
    that DDP and FSDP put on the layers keep running eagerly around it."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ConfigError(
            [
                (
                    where,
                    f"{type(model).__name__} names no decoder layer classes (_no_split_modules): turn it off",
                )
            ]
        )
    for layer in layers:
        layer.forward = torch.compile(layer.forward)


def forward_micro_batch(
    model: torch.nn.Module,
    micro_batch: TensorDict,
    role: str,
    packing: bool = False,
    logits_chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``model`` (possibly wrapped, e.g. by DDP) on one micro-batch of the batch contract.

    Returns ``{"log_probs": [b, R]}`` plus ``{"entropy": [b, R]}`` when the batch's
    ``compute_entropy`` is set, for ``lm``; ``{"values": [b, R]}`` for ``value``. Response token
    ``t`` is predicted from the logits at column ``P + t - 1`` (``P = L - R``, the prompt length).
    With ``packing`` the sequences run padding-free (``pack_sequences``): the same outputs on every
    real response token, 0 on padding. With ``logits_chunk_size`` an ``lm`` micro-batch predicting
    more tokens than that computes its logits that many tokens at a time (``_lm_outputs``).
    """
    response_length = micro_batch[RESPONSES].shape[-1]
    if packing:
        return _forward_packed(model, micro_batch, role, response_length, logits_chunk_size)
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
) -> dict[str, torch.Tensor]:
    """``forward_micro_batch`` padding-free: the outputs of the real response tokens are computed
    (the LM head runs on those positions only) and scattered into ``[b, R]``, 0 on padding. Rows
    with identical prompts share one copy of it where the attention implementation allows."""
    attention_mask = micro_batch[ATTENTION_MASK]
    groups = (
        prompt_groups(micro_batch[INPUT_IDS], attention_mask, response_length)
        if shares_prompts(model)
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
    hf_model = _plain_head_model(model) if chunked else None
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


def _plain_head_model(model: torch.nn.Module) -> PreTrainedModel | None:
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


def export_hf_model(
    model: PreTrainedModel,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer_source: str | Path | None = None,
) -> None:
    """Write ``model`` (or ``state_dict``, e.g. gathered from shards) as a Hugging Face safetensors
    directory, with the tokenizer files of ``tokenizer_source`` when it has any. Call on one rank.

    The directory appears complete or not at all (a crash mid-write leaves no half-written model for
    a later run to load); an earlier export at ``path`` is replaced.
    """
    with atomic_directory(path, replaceable=HF_CONFIG_FILE) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        if tokenizer_source is not None:
            for name in TOKENIZER_FILES:
                source = Path(tokenizer_source) / name
                if source.is_file():
                    shutil.copy2(source, staging / name)


def save_hf_model_from_params(
    model: PreTrainedModel,
    params: Iterable[tuple[str, torch.Tensor]],
    path: str | Path,
    *,
    rank: int,
    group: ProcessGroup | None = None,
    tokenizer_source: str | Path | None = None,
) -> None:
    """``save_hf_model`` for any engine: a collective over ``group``, every rank returns once the
    export exists.

    Every rank iterates ``params`` (the engine's ``get_per_tensor_param()``: a collective for sharded
    engines); rank 0 keeps each full tensor on the CPU and writes ``model``'s config with that state
    dict (``export_hf_model``, atomic). ``model`` only supplies the config and the file layout (a
    meta-device model does).
    """
    keep = rank == 0
    state_dict = {}
    for name, tensor in params:
        if keep:
            state_dict[name] = tensor.detach().to("cpu")
    if keep:
        export_hf_model(model, path, state_dict=state_dict, tokenizer_source=tokenizer_source)
    barrier(group)  # no rank returns before the export exists


__getattr__ = moved_names(
    __name__,
    {"PackedSequences": "verl_core.engine.packing:PackedSequences"},
    since="0.2.0",
    removed_in="0.4.0",
)
