"""The rollout's forward passes: ``HFDecoder`` for any causal LM, ``LeanDecoder`` for Llama-architecture
ones (Llama, Qwen2). Both prefill left-padded prompts, keep the rows they are told to (``select``)
and feed one token per row per ``step``, returning the logits of each row's next token.

``HFDecoder`` calls the model's own forward with a ``DynamicCache`` and the attention mask grown by
one column per step.

Both can also hand out the keys and values of their one row's first positions (``kv_prefix``: a
``KVPrefix``, a copy) and start a one-row cache from such a prefix, running only the tokens after it
(``extend``): the rollout's prefix cache (``verl_core.rollout.prefix_cache``) serves a conversation's
next turn that way. ``HFDecoder`` does where every layer of its cache is a plain ``DynamicLayer``.

On CPU most of a Hugging Face decoding step is spent outside its matrix products: module calls, the
attention mask rebuilt every step, a cache that grows by concatenation. This computes the same forward
pass from the model's own parameters with none of that: a preallocated KV cache written in place, the
rotary cos/sin looked up from a table the model's own rotary embedding computed, fused ``rms_norm``,
and one SDPA call per layer.

Its matrix products (``Projection``) take one of the decoder's paths (``DecoderPath``): the weights'
dtype, their layout (``Packing``: as they are, or on a CPU a copy laid out for MKL's float32 or
oneDNN's float32/bfloat16/float16 kernels, remade whenever a weight changes, so a weight update is seen
by the next step), and q/k/v and gate/up computed as one product each (fused) or not. ``packing="auto"``
chooses the layout from the device and what torch reports this CPU's kernels support
(``default_packing``; for float32 MKL's on an Intel CPU, oneDNN's on others), for weights large enough
to pay for a copy; fused by default only where the copy is oneDNN's, which is then the fused weight at
no memory cost. A forced path the machine cannot run is refused, saying why (``packing_problem``).
What each choice gained, on which CPU: docs/benchmarks.md ("The decoder's paths").

``LeanDecoder.for_model(model)`` returns ``None`` for a model it does not cover (another
architecture, sliding-window layers, a rotary scaling that depends on the sequence length, biases
in the MLP): ``HFRollout`` then decodes with the model's own forward. Logits match that forward to
float rounding on every path (tests/test_rollout_decoder.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from verl_core.rollout.config import PACKED_DTYPE_NAMES, PACKINGS, Packing, packing_dtype_problem

#: Architectures whose layers are all ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with SwiGLU, RMSNorm,
#: rotary attention with grouped KV heads, and QKV biases at most (Qwen2's).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
#: Rotary variants whose cos/sin depend on the position only (not on the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: The weight dtypes each packed layout (``Packing``) serves.
PACKED_DTYPES: dict[Packing, tuple[torch.dtype, ...]] = {
    packing: tuple(getattr(torch, name) for name in names) for packing, names in PACKED_DTYPE_NAMES.items()
}
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class DecoderPath:
    """Which products a ``LeanDecoder`` computes: its weights' ``dtype``, their layout (``packing``) and
    whether q/k/v and gate/up are one product each (``fused``)."""

    dtype: torch.dtype
    packing: Packing
    fused: bool

    def __str__(self) -> str:
        return f"{_dtype_name(self.dtype)}-{self.packing}-{'fused' if self.fused else 'separate'}"


def decoder_paths() -> list[DecoderPath]:
    """Every path: each dtype with each layout that serves it, fused and separate."""
    return [
        DecoderPath(dtype, packing, fused)
        for dtype in DTYPES
        for packing in PACKINGS
        if packing == "plain" or dtype in PACKED_DTYPES[packing]
        for fused in (True, False)
    ]


@dataclasses.dataclass(frozen=True)
class KVPrefix:
    """The keys and values of one sequence's first ``length`` positions, one ``[1, kv_heads, length,
    head_dim]`` tensor of each per layer: what a decoder's ``extend`` continues from."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def first(self, length: int) -> KVPrefix:
        """The first ``length`` positions (views)."""
        if not 0 < length <= self.length:
            raise ValueError(f"KVPrefix.first({length}): the prefix holds {self.length} positions")
        return KVPrefix(*(tuple(t[:, :, :length] for t in tensors) for tensors in (self.keys, self.values)))


def decoder_for(
    model: torch.nn.Module, lean: bool, packing: Packing | Literal["auto"] = "auto", fuse: bool | None = None
) -> HFDecoder | LeanDecoder:
    """``LeanDecoder`` (with ``packing`` and ``fuse``) when ``lean`` and it covers ``model``, else
    ``HFDecoder``."""
    return (LeanDecoder.for_model(model, packing=packing, fuse=fuse) if lean else None) or HFDecoder(model)


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

    def extend(self, prefix: KVPrefix, input_ids: torch.Tensor, capacity: int) -> torch.Tensor:
        """Start a one-row cache from ``prefix`` and run ``input_ids`` ``[1, T]`` after it (positions
        ``prefix.length`` on); return the logits ``[1, V]`` of the next token."""
        self.cache = DynamicCache()
        for layer, (keys, values) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
            self.cache.update(keys, values, layer)  # a copy: DynamicLayer concatenates
        start, device = prefix.length, input_ids.device
        self.attention_mask = torch.ones(1, start + input_ids.shape[1], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + input_ids.shape[1], device=device)[None]
        return self._logits(input_ids, positions, logits_to_keep=1)

    def kv_prefix(self, length: int) -> KVPrefix | None:
        """A copy of the first ``length`` cached positions of the one row decoded, or ``None`` where the
        model's cache layers are not plain ``DynamicLayer`` s (sliding-window, quantised, ...)."""
        layers = getattr(self.cache, "layers", None)
        if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
            return None
        _check_prefix(length, self.attention_mask, layers[0].keys.shape[-2])
        return KVPrefix(
            tuple(layer.keys[:, :, :length].clone() for layer in layers),
            tuple(layer.values[:, :, :length].clone() for layer in layers),
        )

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
    """Prefill, then one token per row per step, over a KV cache of fixed capacity.

    ``packing``: the weights' layout, ``auto`` (``default_packing`` for the model's dtype and device,
    for weights of at least ``PACKED_MIN_ELEMENTS``; smaller ones stay plain) or a ``Packing`` forced on
    every weight (a ``ValueError`` saying why where this machine cannot: ``packing_problem``).
    ``fuse``: q/k/v and gate/up as one product each; ``None``: where oneDNN-packed. ``path`` is the
    path taken (by every weight when forced; by the large ones under ``auto``).
    """

    def __init__(
        self, model: torch.nn.Module, fuse: bool | None = None, packing: Packing | Literal["auto"] = "auto"
    ):
        self.model = model
        self.layers = list(model.model.layers)
        weight = model.lm_head.weight
        if packing == "auto":
            chosen, min_elements = default_packing(weight.dtype, weight.device), PACKED_MIN_ELEMENTS
        else:
            problem = packing_problem(packing, weight.dtype, weight.device)
            if problem:
                raise ValueError(f"LeanDecoder(packing={packing!r}): {problem}")
            chosen, min_elements = packing, 0
        self.path = DecoderPath(weight.dtype, chosen, chosen == "onednn" if fuse is None else fuse)

        def group(linears: list[torch.nn.Linear]) -> Projection:
            return Projection.of(linears, chosen, fuse, min_elements)

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
        self._allocate(batch, capacity, device)
        self.key_mask[:, :width] = attention_mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # A padding query may see nothing but itself: an all-masked row would make NaNs.
        mask = (causal & self.key_mask[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)
        self.length = width
        hidden = self._forward(input_ids, positions, 0, mask[:, None])
        return self._logits(hidden[:, -1])

    def extend(self, prefix: KVPrefix, input_ids: torch.Tensor, capacity: int) -> torch.Tensor:
        """Start a one-row cache of ``capacity`` positions from ``prefix`` and run ``input_ids``
        ``[1, T]`` after it (positions ``prefix.length`` on); return the logits ``[1, V]`` of the next
        token, as ``prefill`` of the whole sequence would."""
        start, tokens = prefix.length, input_ids.shape[1]
        end, device = start + tokens, input_ids.device
        self._allocate(1, capacity, device)
        for cache, cached in zip((*self.keys, *self.values), (*prefix.keys, *prefix.values), strict=True):
            cache[:, :, :start] = cached
        self.key_mask[:, :end] = True
        # Query i (position start + i) sees the prefix and the new tokens up to itself.
        mask = torch.ones(tokens, end, dtype=torch.bool, device=device).tril(diagonal=start)
        self.length = end
        positions = torch.arange(start, end, device=device)[None]
        return self._logits(self._forward(input_ids, positions, start, mask[None, None])[:, -1])

    def kv_prefix(self, length: int) -> KVPrefix:
        """A copy of the first ``length`` cached positions of the one row decoded (unpadded)."""
        _check_prefix(length, self.key_mask, self.length)
        return KVPrefix(
            tuple(keys[:, :, :length].clone() for keys in self.keys),
            tuple(values[:, :, :length].clone() for values in self.values),
        )

    def _allocate(self, batch: int, capacity: int, device: torch.device) -> None:
        """An empty cache of ``batch`` rows and ``capacity`` positions, and the rotary tables for them."""
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

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cache rows ``rows`` (in that order; a row may repeat)."""
        # index_select: on the CPU faster than advanced indexing for these copies (docs/benchmarks.md).
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


#: The smallest weight (elements) ``auto`` packs: below it the copy (and the padding of rows that
#: finished) costs more than its products gain; the demo's models' weights are below it, SmolLM2-135M's
#: above (docs/benchmarks.md, "The decoder's paths").
PACKED_MIN_ELEMENTS = 300_000
#: The float32 products that use MKL's packed weights: decoding steps (one token per row) of 3 to 64
#: rows. One or two rows read the weights at the bandwidth's pace plainly; more rows, and prefills,
#: are compute-bound, and the plain product serves them as well (docs/benchmarks.md).
MKL_PACKED_ROWS = range(3, 65)


class Projection:
    """The matrix products of one or more linear layers that read the same input (q, k and v; gate and
    up): ``[..., in]`` -> one ``[..., out_i]`` per layer, from copies of their weights laid out for
    this device's kernels.

    - ``fuse``: the layers' weights side by side, one product instead of several.
    - ``packing`` (a CPU's): ``onednn``, bfloat16/float16 weights in oneDNN's blocked layout, for any
      number of rows; ``mkl``, float32 weights in MKL's packed layout, made for the number of rows of
      a decoding step (``MKL_PACKED_ROWS``; other products are plain): a plain float32 product of a
      few rows spends much of its time re-laying-out the weight, every call. A packed copy serves
      products of up to as many rows as it was made for (fewer are padded up to it, as rows finish);
      it is remade for more rows, or for a quarter as many (making one costs about two decoding steps).

    A copy is remade when a source weight changes (a weight update writes in place: its version
    counter moves), so the decoder always computes with the model's current weights.
    """

    def __init__(self, linears: list[torch.nn.Linear], fuse: bool, packing: Packing):
        self.linears = linears
        self.fused = fuse and len(linears) > 1
        self.packing = packing
        self.sizes = [linear.weight.shape[0] for linear in linears]
        self.sources = [
            tensor for linear in linears for tensor in (linear.weight, linear.bias) if tensor is not None
        ]
        #: Whether the products read copies (fused or packed) that must follow the weights.
        self.copies = self.fused or packing != "plain"
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
    def of(
        cls, linears: list[torch.nn.Linear], packing: Packing, fuse: bool | None, min_elements: int = 0
    ) -> Projection:
        """The projection of ``linears`` in ``packing`` when the first weight has at least
        ``min_elements`` (else plain); fused as ``fuse`` says (``None``: when oneDNN-packed, whose copy
        the fused weight then is, at no memory cost)."""
        if linears[0].weight.numel() < min_elements:
            packing = "plain"
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
            outs = [_plain_linear(x, w, b) for w, b in self._products]
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
        if self.fused:
            products = [_fused_weight(self.linears)]
        else:
            products = [(linear.weight, linear.bias) for linear in self.linears]
        if self.packing == "onednn":
            products = [(torch.ops.mkldnn._reorder_linear_weight(w, None), b) for w, b in products]
        self._products = products
        self._packed, self._packed_rows = [], 0


def _fused_weight(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of ``linears`` one above the other, and their biases (zeros for a layer without)."""
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return weight, None
    sizes = [linear.weight.shape[0] for linear in linears]
    return weight, torch.cat(
        [weight.new_zeros(n) if b is None else b for b, n in zip(biases, sizes, strict=True)]
    )


#: The products of each layout, by name (a test replaces one to show the comparison sees it).
_plain_linear = F.linear


def _mkl_linear(*args) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear.default(*args)


def _mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight.default(weight, rows)


def _onednn_linear(*args) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(*args)


def default_packing(dtype: torch.dtype, device: torch.device | str = "cpu") -> Packing:
    """The layout ``auto`` chooses for ``dtype`` weights on ``device``: the packed one that serves the
    dtype where this machine can compute it (``packing_problem``) and gains there, else ``plain`` (a
    GPU's kernels read the weights as they are; a CPU whose oneDNN has no kernels for the dtype, such as
    bfloat16 on one with AVX2 only). float32 takes MKL's layout on an Intel CPU (``mkl_packs_fast``) and
    oneDNN's on others. Decided from what torch reports."""
    for packing, dtypes in PACKED_DTYPES.items():
        if packing == "mkl" and not mkl_packs_fast():
            continue
        if dtype in dtypes and packing_problem(packing, dtype, device) is None:
            return packing
    return "plain"


def mkl_packs_fast() -> bool:
    """Whether torch reports an Intel CPU, whose MKL packed float32 kernels beat plain products at a
    decoding step's rows (and oneDNN's there). MKL takes generic code paths on other vendors' CPUs,
    oneDNN picks its kernels by instruction set: on an AMD EPYC with AVX-512 MKL's packed layout decoded
    SmolLM2-135M 21% slower than plain products, oneDNN's float32 products of a 16-row step ran 2.5x
    faster than plain ones (docs/benchmarks.md, "The decoder's paths")."""
    try:
        name = str(torch.cpu.get_capabilities().get("cpu_name", ""))
    except (AttributeError, RuntimeError):  # a torch or platform that does not say
        return False
    return "intel" in name.lower()


def packing_problem(packing: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
    """Why ``packing`` cannot lay out ``dtype`` weights on ``device`` on this machine (``None``: it can),
    in words a user can act on."""
    if packing not in PACKINGS:
        return f"{packing!r} is not a weight layout: use auto, {', '.join(PACKINGS)}"
    if packing == "plain":
        return None
    problem = packing_dtype_problem(packing, _dtype_name(dtype))
    if problem:
        return problem
    if torch.device(device).type != "cpu":
        return (
            f"{packing} lays out weights for a CPU's kernels, and these are on {torch.device(device).type}: "
            "use plain or auto (a GPU's kernels read the weights as they are)"
        )
    if packing == "mkl":
        if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
            return None
        return f"this torch ({torch.__version__}) was built without MKL: use plain or auto"
    if not torch.backends.mkldnn.is_available():
        return f"this torch ({torch.__version__}) was built without oneDNN: use plain or auto"
    if _onednn_supports(dtype):
        return None
    return (
        f"this CPU's oneDNN has no {_dtype_name(dtype)} kernels ({ONEDNN_NEEDS[dtype]}); "
        f"torch reports {cpu_features()}: use plain or auto"
    )


#: What oneDNN needs of an x86 CPU to compute each dtype (its ``has_data_type_support``).
ONEDNN_NEEDS = {
    torch.bfloat16: "on x86 it needs AVX-512, with AVX512-BF16 or AMX to be fast, or AVX2-VNNI-2",
    torch.float16: "on x86 it needs AVX-512 FP16 or AVX2-VNNI-2",
}
#: The CPU features that decide the layouts, as torch names them (``torch.cpu.get_capabilities``).
CPU_FEATURES = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_bf16", "amx_fp16")


def _onednn_supports(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN has kernels for ``dtype`` products on this CPU (float32's run on every
    CPU torch runs on)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def cpu_features() -> str:
    """This CPU as torch sees it, for messages: ``AMD EPYC: avx2, avx512_f, avx512_bf16 (no avx512_fp16,
    ...)``, or torch's vector capability where it cannot list features."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:  # an older torch
        return f"vector capability {torch.backends.cpu.get_cpu_capability()}"
    found = capabilities()
    name = found.get("cpu_name") or found.get("architecture", "this CPU")
    has = [feature for feature in CPU_FEATURES if found.get(feature)]
    lacks = [feature for feature in CPU_FEATURES if not found.get(feature)]
    listed = ", ".join(has) or "none of " + ", ".join(CPU_FEATURES)
    return f"{name}: {listed}" + (f" (no {', '.join(lacks)})" if has and lacks else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_prefix(length: int, mask: torch.Tensor, cached: int) -> None:
    """A prefix is taken from a cache of one row without padding (a request's), within what it holds:
    ``mask`` is the cache's attention or key mask, ``cached`` its positions."""
    if mask.shape[0] != 1 or not 0 < length <= cached or not bool(mask[0, :length].all()):
        raise ValueError(
            f"kv_prefix({length}): the cache holds {mask.shape[0]} row(s) of {cached} positions; a prefix "
            "is taken from one unpadded row, within its positions"
        )


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
