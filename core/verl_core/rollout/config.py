"""The options of core's built-in ``hf`` rollout (``rollout.hf`` in a run config).

Light on purpose (attrs only, no torch): the config loader structures these options while a config
loads, before any rollout is built.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Literal

import attrs

from verl_core.config.validators import non_negative

#: How ``LeanDecoder`` lays out the weights its products read: as they are (``plain``), MKL's packed
#: float32 layout (``mkl``), oneDNN's blocked float32/bfloat16/float16 layout (``onednn``).
Packing = Literal["plain", "mkl", "onednn"]
PACKINGS: tuple[Packing, ...] = typing.get_args(Packing)
#: The weight dtypes each packed layout serves, by name (no torch here).
PACKED_DTYPE_NAMES: dict[Packing, tuple[str, ...]] = {
    "mkl": ("float32",),
    "onednn": ("float32", "bfloat16", "float16"),
}


def packing_dtype_problem(packing: str, dtype: str, where: str = "") -> str | None:
    """Why the layout ``packing`` cannot serve ``dtype`` weights (``None``: it can, or is not packed);
    ``where``: the key the dtype comes from."""
    served = PACKED_DTYPE_NAMES.get(packing)
    if served is None or dtype in served:
        return None
    choices = [name for name, dtypes in PACKED_DTYPE_NAMES.items() if dtype in dtypes] + ["plain"]
    return (
        f"{packing} lays out {' and '.join(served)} weights, and these are {dtype}{where}: "
        f"use {', '.join(choices)} or auto"
    )


@attrs.define
class HFRolloutConfig:
    """How the built-in rollout decodes with its own copy of a Hugging Face causal LM."""

    #: Sequences decoded together on each rank; 0 decodes a rank's whole share at once. Lower it to
    #: bound the KV cache's memory (it grows with sequences x (prompt + response) tokens).
    max_batch_size: int = attrs.field(default=0, validator=non_negative)
    #: The attention kernel of the rollout's model (``sdpa`` or ``eager``).
    attn_implementation: str = "sdpa"
    #: Decode Llama-architecture models (Llama, Qwen2) with ``verl_core.rollout.decoder.LeanDecoder``
    #: (the same logits, a fraction of the Python overhead per step; ``sdpa`` only); false, or another
    #: architecture, decodes with the model's own forward pass.
    lean_decoder: bool = True
    #: With ``lean_decoder``, the layout of the weights its products read (``decoder.Packing``).
    #: ``auto``: on a CPU, a second copy of each weight of at least 300k elements
    #: (``PACKED_MIN_ELEMENTS``) laid out for MKL's float32 kernels on an Intel CPU, oneDNN's float32
    #: kernels on others, oneDNN's bfloat16/float16 kernels where torch reports this CPU has them, else
    #: the weights as they are (``decoder.default_packing``); ``plain``: no copy (saves its memory: as
    #: much again as those weights); ``mkl`` (float32) or ``onednn`` (float32, bfloat16, float16): every
    #: weight in that layout, refused at start-up, saying why, where the rollout's dtype or this CPU has
    #: no such kernels.
    weight_packing: Literal["auto", "plain", "mkl", "onednn"] = "auto"
    #: With ``lean_decoder``, compute q/k/v and gate/up as one product each. ``auto``: where the weights
    #: are oneDNN-packed (the packed copy is then the fused weight, at no memory cost); ``true`` keeps a
    #: fused copy of the other weights too.
    fused_projections: Literal["auto", True, False] = "auto"
    #: Requests whose KV caches are kept after they finish, the least recently used dropped first, so
    #: that a request whose prompt begins as one of theirs did (a conversation's next turn) prefills only
    #: the tokens after that prefix (``verl_core.rollout.prefix_cache``); 0 keeps none. At least the
    #: conversations in flight at once (served in turn, fewer evict each other before their next turn);
    #: the default holds a step of the examples' size (16 prompts x 8 responses) on one replica. Each
    #: costs its tokens' keys and values (per token: 2 x layers x KV heads x head size x the dtype's
    #: bytes) until a weight update or ``sleep()`` frees them.
    prefix_cache_sequences: int = attrs.field(default=128, validator=non_negative)

    def check_model(self, dtype: str, dtype_key: str) -> Iterator[tuple[str, str]]:
        """The rules between these options and the model the rollout loads, in ``dtype`` (from the
        config key ``dtype_key``): a forced weight layout must serve it. Called by the run config's
        rules; the CPU's part is the rollout's to check, on the machine it runs on."""
        problem = packing_dtype_problem(self.weight_packing, dtype, f" ({dtype_key})")
        if problem:
            yield "weight_packing", problem

    def ignored(self) -> Iterator[tuple[str, str]]:
        if self.lean_decoder and self.attn_implementation == "sdpa":
            return
        why = "lean_decoder is false" if not self.lean_decoder else "attn_implementation is not sdpa"
        for key, default in (("weight_packing", "auto"), ("fused_projections", "auto")):
            if getattr(self, key) != default:
                yield key, f"ignored: {why}, so the model's own forward decodes (LeanDecoder's paths only)"
