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
layer. Its matrix products (``Projection``) read the model's weights, or on a CPU (for weights large
enough to pay for it) a copy laid out for MKL's and oneDNN's kernels that is remade whenever a weight
changes, so a weight update is seen by the next step. ``fuse`` computes q/k/v and gate/up as one
product each: by default only where it costs no memory, the oneDNN-packed (bfloat16, float16) weights,
whose packed copy is the fused one (2-7% less time per step, one call's overhead saved per fused
product); elsewhere it would copy those weights for a gain within noise (docs/benchmarks.md).

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


def decoder_for(model: torch.nn.Module, lean: bool, pack: bool = True) -> HFDecoder | LeanDecoder:
    """``LeanDecoder`` (with packed weights when ``pack``) when ``lean`` and it covers ``model``, else
    ``HFDecoder``."""
    return (LeanDecoder.for_model(model, pack=pack) if lean else None) or HFDecoder(model)


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

    def release(self) -> None:
        """Free the cache until the next ``prefill``."""
        self.cache = DynamicCache()
        self.attention_mask = torch.empty(0, 0, dtype=torch.int64)

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

    def __init__(self, model: torch.nn.Module, fuse: bool | None = None, pack: bool = True):
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
        #: The rotary tables ``[capacity, head_dim]``: cos, and sin negated in its first half (``_rotate``).
        self.cos = self.signed_sin = torch.empty(0)

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
        half = self.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
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

    def release(self) -> None:
        """Free the KV cache and the weights' copies until the next ``prefill``: between rollouts
        (while the engine trains) they would only hold memory, and a weight update outdates the
        copies anyway."""
        self.keys, self.values = [], []
        self.key_mask = torch.empty(0, 0, dtype=torch.bool)
        for projection in (*(p for layer in self.projections for p in layer), self.head):
            projection.release()

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
            for table in (self.cos, self.signed_sin)
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


#: The smallest weight (elements) worth a packed copy. Below it the copy costs more than its products
#: gain: whole rollouts (weights updated before each) of the demo's 0.5M and 4M models (widths 128 and
#: 256, weights of up to 262k elements) took 20-30% longer with every weight packed, in float32, and
#: no less time in bfloat16; SmolLM2-135M's (width 576: 332k to 885k, and the 28M head) took 5-9% less
#: (docs/benchmarks.md).
PACKED_MIN_ELEMENTS = 300_000
#: The float32 products that use MKL's packed weights: decoding steps (one token per row) of 3 to 64
#: rows. One or two rows read the weights at the bandwidth's pace plainly (SmolLM2-135M's layers, 2
#: threads: 1 row 24.5 GB/s plain, 22.2 packed; 4 rows 13.1 and 19.1; 16 rows 10.2 and 13.2); more
#: rows, and prefills, are compute-bound, and the plain product serves them as well.
MKL_PACKED_ROWS = range(3, 65)


class Projection:
    """The matrix products of one or more linear layers that read the same input (q, k and v; gate and
    up): ``[..., in]`` -> one ``[..., out_i]`` per layer, from copies of their weights laid out for
    this device's kernels.

    - ``fuse``: the layers' weights side by side, one product instead of several (``None``: when the
      weights are oneDNN-packed, whose copy the fused weight then is, at no memory cost).
    - ``pack`` on a CPU: bfloat16/float16 weights in oneDNN's blocked layout (AMX, AVX-512 BF16), for
      any number of rows; float32 weights in MKL's packed layout, made for the number of rows of a
      decoding step (``MKL_PACKED_ROWS``): a plain float32 product of a few rows spends much of its
      time re-laying-out the weight, every call. A packed copy serves products of up to as many rows
      as it was made for (fewer are padded up to it, as rows finish); it is remade for more rows, or
      for a quarter as many (making one costs about two decoding steps: 0.13 s for SmolLM2-135M).

    A copy is remade when a source weight changes (a weight update writes in place: its version
    counter moves), so the decoder always computes with the model's current weights.
    """

    def __init__(self, linears: list[torch.nn.Linear], fuse: bool, packing: str | None):
        self.linears = linears
        self.fused = fuse and len(linears) > 1
        #: ``"onednn"``, ``"mkl"`` or ``None`` (plain products).
        self.packing = packing
        self.sizes = [linear.weight.shape[0] for linear in linears]
        self.sources = [
            tensor for linear in linears for tensor in (linear.weight, linear.bias) if tensor is not None
        ]
        #: Whether the products read copies (fused or packed) that must follow the weights.
        self.copies = self.fused or packing is not None
        self._key: tuple = ()
        #: One (weight, bias) per product: the fused layers', or each layer's (the parameters
        #: themselves when nothing is copied: they always hold the current weights).
        self._products: list[tuple[torch.Tensor, torch.Tensor | None]] = (
            [] if self.copies else [(linear.weight, linear.bias) for linear in linears]
        )
        #: MKL's packed weights, one per product, and the rows they were made for.
        self._packed: list[torch.Tensor] = []
        self._packed_rows = 0

    @classmethod
    def of(cls, linears: list[torch.nn.Linear], fuse: bool | None, pack: bool) -> Projection:
        """The projection of ``linears``: fused and packed as asked where that applies (packed when the
        first weight has at least ``PACKED_MIN_ELEMENTS``; ``fuse=None``: fused when oneDNN-packed)."""
        weight = linears[0].weight
        packing = packing_for(weight) if pack and weight.numel() >= PACKED_MIN_ELEMENTS else None
        return cls(linears, packing == "onednn" if fuse is None else fuse, packing)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.copies:
            self._refresh()
        rows = x.shape[0]
        if self.packing == "onednn":
            outs = [_onednn_linear(x, w, b, "none", [], "") for w, b in self._products]
        elif self.packing == "mkl" and rows in MKL_PACKED_ROWS and (x.dim() == 2 or x.shape[-2] == 1):
            outs = self._mkl(x, rows)
        else:
            outs = [F.linear(x, w, b) for w, b in self._products]
        return outs[0].split(self.sizes, dim=-1) if self.fused else tuple(outs)

    def _mkl(self, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """Products of one token per row (a decoding step): ``x`` is ``[rows, 1, in]`` or ``[rows, in]``."""
        if rows > self._packed_rows or rows <= self._packed_rows // 4:
            self._packed = [_mkl_pack(w, rows) for w, _ in self._products]
            self._packed_rows = rows
        packed_rows = self._packed_rows
        flat = x.reshape(rows, x.shape[-1])
        if rows < packed_rows:  # the packed layout serves its own row count only
            flat = F.pad(flat, (0, 0, 0, packed_rows - rows))
        outs = [
            _mkl_linear(flat, packed, w, b, packed_rows)
            for packed, (w, b) in zip(self._packed, self._products, strict=True)
        ]
        if rows < packed_rows:
            outs = [out[:rows] for out in outs]
        return outs if x.dim() == 2 else [out.view(rows, 1, -1) for out in outs]

    def release(self) -> None:
        """Drop the copies of the weights (remade on the next call)."""
        if self.copies:
            self._key, self._products = (), []
            self._packed, self._packed_rows = [], 0

    def _refresh(self) -> None:
        """Remake the copies when a source weight was replaced or written to since they were made."""
        key = tuple((tensor.data_ptr(), tensor._version) for tensor in self.sources)
        if key != self._key:
            self._rebuild()
            self._key = key

    def _rebuild(self) -> None:
        linears = self.linears
        if self.fused:
            weight = torch.cat([linear.weight for linear in linears])
            biases = [linear.bias for linear in linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [weight.new_zeros(n) if b is None else b for b, n in zip(biases, self.sizes, strict=True)]
                )
            products = [(weight, bias)]
        else:
            products = [(linear.weight, linear.bias) for linear in linears]
        if self.packing == "onednn":
            products = [(torch.ops.mkldnn._reorder_linear_weight(w, None), b) for w, b in products]
        self._products = products
        self._packed, self._packed_rows = [], 0


def _mkl_linear(*args) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear.default(*args)


def _mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight.default(weight, rows)


def _onednn_linear(*args) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(*args)


def packing_for(weight: torch.Tensor) -> str | None:
    """The packed layout that serves ``weight`` on this machine: ``"onednn"`` for half-precision
    weights on a CPU whose oneDNN has the instructions for them, ``"mkl"`` for float32 weights on a
    CPU with MKL; ``None`` elsewhere (GPUs: their kernels read the weights as they are)."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype in (torch.bfloat16, torch.float16):
        if not torch.backends.mkldnn.is_available():
            return None
        supported = (
            torch.ops.mkldnn._is_mkldnn_bf16_supported
            if weight.dtype == torch.bfloat16
            else torch.ops.mkldnn._is_mkldnn_fp16_supported
        )
        return "onednn" if supported() else None
    if (
        weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    ):
        return "mkl"
    return None


def _heads(projected: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, T, heads * dim]`` -> ``[B, heads, T, dim]``."""
    batch, tokens, _ = projected.shape
    return projected.view(batch, tokens, heads, -1).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) * sin`` computed as
    ``x`` rolled by half its width times ``signed_sin`` (``sin`` negated in its first half): the same
    products, in 4 operators instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _rms_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    if hidden.dtype == torch.float32:  # one operator: the norm and its weight
        return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight, eps=norm.variance_epsilon)
    # In float32, then back, as the models' own RMSNorm computes it.
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)
