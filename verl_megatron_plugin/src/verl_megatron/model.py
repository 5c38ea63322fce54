"""megatron-core ``GPTModel`` chunks for one pipeline rank, from a Hugging Face config.

``build_model_chunks`` returns this rank's chunks (one, or ``virtual_pipeline_model_parallel_size``
with the interleaved schedule), each a ``GPTModel`` holding its stage's layers, the embedding on the
first stage, the final norm and head on the last. The ``value`` role replaces the LM head with
``ValueHead`` (one scalar per token, replicated over the TP ranks, as Hugging Face's token
classification head ``score``). Needs megatron-core and ``parallel_state`` initialised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from verl_megatron.config import MegatronConfig

ACTIVATIONS = {"silu": torch.nn.functional.silu}


class ValueHead(torch.nn.Module):
    """``score``: hidden -> 1 with a bias, called like megatron-core's output layer (returning
    ``(output, bias)``); the same on every TP rank, whose hidden states are whole."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, **kwargs: Any):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _weights_from_checkpoint(weight: torch.Tensor) -> None:
    """Leaves ``weight`` as allocated: ``_load_hf_state`` fills every parameter."""


def transformer_config(
    model: Mapping[str, Mapping[str, Any]],
    options: MegatronConfig,
    dtype: torch.dtype,
    transformer_engine: bool,
    gloo: bool = False,
    recompute: bool = False,
) -> TransformerConfig:
    """``TransformerConfig`` for ``model`` (``hf_config.megatron_model_config``'s result) laid out by
    ``options``. Fusions that need transformer-engine or apex kernels are off without them; ``gloo``:
    the pipeline stages talk over gloo (the CPU); ``recompute``: ``model.gradient_checkpointing``, as
    megatron-core's full recomputation of every layer."""
    values = dict(model["transformer"])
    values["activation_func"] = ACTIVATIONS[values.pop("activation")]
    return TransformerConfig(
        **values,
        tensor_model_parallel_size=options.tensor_model_parallel_size,
        pipeline_model_parallel_size=options.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=options.virtual_pipeline_model_parallel_size,
        sequence_parallel=options.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights come from the Hugging Face checkpoint: initialisation only tags the parameters with
        # their TP layout (megatron-core does that in its init path, which ``perform_initialization=False``
        # skips), and draws nothing.
        perform_initialization=True,
        init_method=_weights_from_checkpoint,
        output_layer_init_method=_weights_from_checkpoint,
        use_cpu_initialization=False,
        # Micro-batches differ in length (and in size under token-budget batching): stages exchange
        # their shapes before each activation.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the one that admits variable lengths (no MoE is mapped)
        masked_softmax_fusion=transformer_engine,
        bias_activation_fusion=transformer_engine,
        bias_dropout_fusion=transformer_engine,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Batched p2p (one group of isend/irecv) relies on NCCL's pairing; gloo pairs messages between two
        # ranks in posting order, which swaps activations and gradients when a stage's previous and next
        # stage are the same rank (2 stages, interleaved). Megatron's unbatched path orders them by rank
        # parity, which pairs them right on both.
        batch_p2p_comm=not gloo,
        **(
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if recompute
            else {}
        ),
    )


def layer_spec(transformer_engine: bool):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def build_model_chunks(
    model: Mapping[str, Mapping[str, Any]],
    config: TransformerConfig,
    role: str,
    transformer_engine: bool,
    device: torch.device,
) -> list[GPTModel]:
    """This pipeline rank's ``GPTModel`` chunks, on ``device``, weights uninitialised."""
    gpt = model["gpt"]
    spec = layer_spec(transformer_engine)
    virtual = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(virtual or 1):
        stage = vp_stage if virtual else None
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=gpt["vocab_size"],
            max_sequence_length=gpt["max_sequence_length"],
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=post_process,
            share_embeddings_and_output_weights=gpt["share_embeddings_and_output_weights"] and role == "lm",
            position_embedding_type=gpt["position_embedding_type"],
            rotary_percent=gpt["rotary_percent"],
            rotary_base=gpt["rotary_base"],
            vp_stage=stage,
        )
        if post_process and role == "value":
            chunk.output_layer = ValueHead(config.hidden_size, config.params_dtype, device)
        chunks.append(chunk.to(device))
    return chunks


def global_layer_index(chunk: GPTModel, local_index: int) -> int:
    """The Hugging Face index of this chunk's ``decoder.layers.{local_index}``."""
    return chunk.decoder.layers[local_index].layer_number - 1
