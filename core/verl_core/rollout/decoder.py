"""The rollout's forward passes: ``HFDecoder`` for any causal LM, ``LeanDecoder`` for Llama-architecture
ones (Llama, Qwen2). Both prefill left-padded prompts, keep the rows they are told to (``select``)
and feed one token per row per ``step``, returning the logits of each row's next token.

``HFDecoder`` calls the model's own forward with a ``DynamicCache`` and the attention mask grown by
one column per step.

On CPU most of a Hugging Face decoding step is spent outside its matrix products: module calls, the
attention mask rebuilt every step, a cache that grows by concatenation (measured on the demo's 4M
model: about 0.19 of 0.23 s per GRPO rollout). This computes the same forward pass from the model's
own parameters with none of that: a preallocated KV cache written in place, the rotary cos/sin looked
up from a table the model's own rotary embedding computed, fused ``rms_norm``, and one SDPA call per
layer. Nothing is copied from the model, so a weight update is seen by the next step.

``LeanDecoder.for_model(model)`` returns ``None`` for a model it does not cover (another
architecture, sliding-window layers, a rotary scaling that depends on the sequence length, biases
in the MLP): ``HFRollout`` then decodes with the model's own forward. Logits match that forward to
float rounding (tests/test_rollout_decoder.py).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache

#: Architectures whose layers are all ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with SwiGLU, RMSNorm,
#: rotary attention with grouped KV heads, and QKV biases at most (Qwen2's).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
#: Rotary variants whose cos/sin depend on the position only (not on the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def decoder_for(model: torch.nn.Module, lean: bool) -> HFDecoder | LeanDecoder:
    """``LeanDecoder`` when ``lean`` and it covers ``model``, else ``HFDecoder``."""
    return (LeanDecoder.for_model(model) if lean else None) or HFDecoder(model)


class HFDecoder:
    """Decoding with the model's own forward pass and a ``DynamicCache``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # transformers 5.2x renamed ``past_key_values`` to ``cache``; older releases know only the former.
        parameters = inspect.signature(type(model).forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.cache = DynamicCache()
        self.attention_mask = torch.empty(0, 0, dtype=torch.int64)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int) -> torch.Tensor:
        self.cache = DynamicCache()
        self.attention_mask = attention_mask
        return self._logits(input_ids, (attention_mask.cumsum(dim=-1) - 1).clamp(min=0), logits_to_keep=1)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask[rows]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=-1)
        return self._logits(tokens[:, None], positions[:, None])

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, **extra) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids,
            attention_mask=self.attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_argument: self.cache},
            **extra,
        )
        return output.logits[:, -1]


class LeanDecoder:
    """Prefill, then one token per row per step, over a KV cache of fixed capacity."""

    def __init__(self, model: torch.nn.Module, fuse: bool = True, pack: bool = True):
        self.model = model
        self.layers = list(model.model.layers)
        group = functools.partial(Projection.of, fuse=fuse, pack=pack)
        #: Per layer: q/k/v, the attention's output, gate/up, down.
        self.projections = [
            (
                group([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                group([layer.self_attn.o_proj]),
                group([layer.mlp.gate_proj, layer.mlp.up_proj]),
                group([layer.mlp.down_proj]),
            )
            for layer in self.layers
        ]
        self.head = group([model.lm_head])
        attention = self.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        #: ``[B, capacity]``: which cache positions hold a real token (prompts are left-padded).
        self.key_mask = torch.empty(0, 0, dtype=torch.bool)
        self.length = 0
        self.cos = self.sin = torch.empty(0)

    @classmethod
    def for_model(cls, model: torch.nn.Module, **options) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` when this module does not cover its architecture."""
        config = model.config
        inner = getattr(model, "model", None)
        if config.model_type not in SUPPORTED_MODEL_TYPES or inner is None or not hasattr(model, "lm_head"):
            return None
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
            return None
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return None  # sliding-window layers
        if getattr(inner.rotary_emb, "rope_type", None) not in STATIC_ROPE_TYPES:
            return None
        if getattr(config, "pretraining_tp", 1) != 1:
            return None
        return cls(model, **options)

    # -- the cache -------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int) -> torch.Tensor:
        """Run the left-padded prompts ``[B, P]``, keep their keys and values in a cache of
        ``capacity`` positions; return the logits ``[B, V]`` that predict each row's next token."""
        batch, width = input_ids.shape
        device = input_ids.device
        positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        table = torch.arange(capacity, device=device)[None]
        dtype_of = self.model.model.embed_tokens.weight[:0]  # the rotary embedding reads its dtype only
        cos, sin = self.model.model.rotary_emb(dtype_of, table)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, head_dim]
        dtype = self.cos.dtype
        self.keys = [
            torch.zeros(batch, self.kv_heads, capacity, self.head_dim, device=device, dtype=dtype)
            for _ in self.layers
        ]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.key_mask[:, :width] = attention_mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # A padding query may see nothing but itself: an all-masked row would make NaNs.
        mask = (causal & self.key_mask[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)
        self.length = width
        hidden = self._forward(input_ids, positions, 0, mask[:, None])
        return self._logits(hidden[:, -1])

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cache rows ``rows`` (in that order; a row may repeat)."""
        # index_select: on the CPU about 3x faster than advanced indexing for these copies.
        self.keys = [keys.index_select(0, rows) for keys in self.keys]
        self.values = [values.index_select(0, rows) for values in self.values]
        self.key_mask = self.key_mask.index_select(0, rows)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token ``[B]`` per row at ``positions`` ``[B]``; return the next logits ``[B, V]``."""
        start = self.length
        if start >= self.key_mask.shape[1]:
            raise RuntimeError(f"the KV cache holds {start} positions: no room for another token")
        self.key_mask[:, start] = True
        self.length = start + 1
        mask = self.key_mask[:, None, None, : self.length]
        return self._logits(self._forward(tokens[:, None], positions[:, None], start, mask)[:, -1])

    # -- the forward pass ------------------------------------------------------------------------

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(input_ids)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        (logits,) = self.head(_rms_norm(hidden, self.model.model.norm))
        return logits

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states ``[B, T, hidden]`` of ``T`` new tokens written at cache columns
        ``start .. start + T``; ``mask`` ``[B, 1, T, start + T]`` says which keys each query sees."""
        hidden = self._embed(input_ids)
        batch, tokens, _ = hidden.shape
        # [B, 1, T, head_dim]
        cos, sin = (
            table.index_select(0, positions.flatten()).view(*positions.shape, 1, -1).transpose(1, 2)
            for table in (self.cos, self.sin)
        )
        end = start + tokens
        for layer, projections, keys, values in zip(
            self.layers, self.projections, self.keys, self.values, strict=True
        ):
            qkv, output, gate_up, down = projections
            normed = _rms_norm(hidden, layer.input_layernorm)
            query, key, value = qkv(normed)
            query = _heads(query, self.heads)
            keys[:, :, start:end] = _rotate(_heads(key, self.kv_heads), cos, sin)
            values[:, :, start:end] = _heads(value, self.kv_heads)
            attended = F.scaled_dot_product_attention(
                _rotate(query, cos, sin),
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.heads != self.kv_heads,
            )
            (projected,) = output(attended.transpose(1, 2).reshape(batch, tokens, -1))
            hidden = hidden + projected
            normed = _rms_norm(hidden, layer.post_attention_layernorm)
            gate, up = gate_up(normed)
            (projected,) = down(F.silu(gate) * up)
            hidden = hidden + projected
        return hidden


class Projection:
    """The matrix products of one or more linear layers that read the same input (q, k and v; gate and
    up), as one product: ``[..., in]`` -> one ``[..., out_i]`` per layer.

    Several layers (``fuse``) are computed from one copy of their weights side by side: one larger
    product instead of several small ones. With ``pack``, bfloat16 and float16 weights on a CPU are
    copied into oneDNN's blocked layout (the layout its kernels read fastest: AMX and AVX-512 BF16).
    A copy is remade when a source weight changes (a weight update writes in place: its version
    counter moves), so the decoder always computes with the model's current weights; a single
    float32 layer is used as it is.
    """

    def __init__(self, linears: list[torch.nn.Linear], packed: bool):
        self.linears = linears
        self.packed = packed
        self.sizes = [linear.weight.shape[0] for linear in linears]
        self.sources = [
            tensor for linear in linears for tensor in (linear.weight, linear.bias) if tensor is not None
        ]
        self._key: tuple = ()
        self._weight = self._bias = None

    @classmethod
    def of(cls, linears: list[torch.nn.Linear], fuse: bool, pack: bool) -> Projection | _Separate:
        """The projection of ``linears``: fused and packed as asked where that applies."""
        packed = pack and can_pack(linears[0].weight)
        return cls(linears, packed) if packed or (fuse and len(linears) > 1) else _Separate(linears)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._refresh()
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")
        else:
            out = F.linear(x, self._weight, self._bias)
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)

    def _refresh(self) -> None:
        """Remake the copy when a source weight was replaced or written to since it was made."""
        key = tuple((tensor.data_ptr(), tensor._version) for tensor in self.sources)
        if key != self._key:
            self._rebuild()
            self._key = key

    def _rebuild(self) -> None:
        linears = self.linears
        weight = torch.cat([linear.weight for linear in linears]) if len(linears) > 1 else linears[0].weight
        biases = [linear.bias for linear in linears]
        if all(bias is None for bias in biases):
            bias = None
        else:
            bias = torch.cat(
                [
                    b if b is not None else weight.new_zeros(size)
                    for b, size in zip(biases, self.sizes, strict=True)
                ]
            )
        self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        self._bias = bias


class _Separate:
    """The layers' own products, one after the other (nothing copied)."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, linear.weight, linear.bias) for linear in self.linears)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed products serve ``weight``: half-precision weights on a CPU whose oneDNN
    has the instructions for them (float32 gains nothing from packing on the CPUs measured)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    supported = (
        torch.ops.mkldnn._is_mkldnn_bf16_supported
        if weight.dtype == torch.bfloat16
        else torch.ops.mkldnn._is_mkldnn_fp16_supported
    )
    return bool(supported())


def _heads(projected: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, T, heads * dim]`` -> ``[B, heads, T, dim]``."""
    batch, tokens, _ = projected.shape
    return projected.view(batch, tokens, heads, -1).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rms_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    # In float32, then back, as the models' own RMSNorm computes it.
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)
