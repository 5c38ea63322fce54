"""The data of the Tinker-style API: what goes into ``forward_backward`` and ``sample`` and what comes out.

Each class mirrors the type of the same name in Thinking Machines' ``tinker`` client (0.38), field for
field, so that a request of its HTTP protocol translates into these objects one to one and a Tinker
user recognises them. Tensors travel as ``TensorData``: a flat list of numbers, a dtype (``int64`` or
``float32``) and a shape, optionally in sparse CSR form. Built with attrs; nothing here imports the
``tinker`` package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
import torch

#: The dtypes a ``TensorData`` carries (Tinker's ``TensorDtype``).
TensorDtype = Literal["int64", "float32"]
#: Why a sampled sequence ended: a stop token (kept as its last token), or ``max_tokens``.
StopReason = Literal["stop", "length"]
#: The loss functions ``TrainingClient.forward_backward`` computes by name (Tinker's ``LossFnType``
#: names; ``cispo``, ``dro``, ``gspo`` and ``stable_reinforce`` are Tinker's but not implemented here).
LossFnType = Literal["cross_entropy", "importance_sampling", "ppo"]

_NUMPY_DTYPES = {"int64": np.int64, "float32": np.float32}
_TORCH_DTYPES = {"int64": torch.int64, "float32": torch.float32}
#: The dtype a plain list of numbers gets under each ``loss_fn_inputs`` key (as the tinker client).
KEY_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
}


def _wire_dtype(dtype: Any) -> TensorDtype:
    """``int64`` for integer numpy or torch dtypes, ``float32`` for floating ones."""
    floating = dtype.is_floating_point if isinstance(dtype, torch.dtype) else np.dtype(dtype).kind == "f"
    return "float32" if floating else "int64"


@attrs.frozen
class TensorData:
    """A tensor on the wire: ``data`` flattened, its ``dtype`` and ``shape`` (``None``: one dimension).

    With ``sparse_crow_indices`` and ``sparse_col_indices`` set it is a sparse CSR matrix: ``data``
    holds only the listed values, ``shape`` the dense shape, and every other entry is the pad value
    given to ``to_torch`` (0 by default).
    """

    data: list[int] | list[float]
    dtype: TensorDtype = attrs.field(validator=attrs.validators.in_(("int64", "float32")))
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        tensor = tensor.detach().cpu()
        dtype = _wire_dtype(tensor.dtype)
        return cls(
            data=tensor.to(_TORCH_DTYPES[dtype]).flatten().tolist(), dtype=dtype, shape=list(tensor.shape)
        )

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _wire_dtype(array.dtype)
        return cls(
            data=array.astype(_NUMPY_DTYPES[dtype]).flatten().tolist(), dtype=dtype, shape=list(array.shape)
        )

    def to_torch(self, pad_value: int = 0) -> torch.Tensor:
        """The dense tensor (a sparse one with ``pad_value`` in every entry it does not list)."""
        values = torch.tensor(self.data, dtype=_TORCH_DTYPES[self.dtype])
        if self.sparse_crow_indices is None:
            return values if self.shape is None else values.reshape(self.shape)
        if self.sparse_col_indices is None or self.shape is None or len(self.shape) != 2:
            raise ValueError(
                "a sparse TensorData needs sparse_col_indices with sparse_crow_indices and a 2-D shape"
            )
        dense = torch.full(self.shape, pad_value, dtype=values.dtype)
        crow = self.sparse_crow_indices
        rows = torch.repeat_interleave(torch.arange(self.shape[0]), torch.tensor(crow).diff())
        dense[rows, torch.tensor(self.sparse_col_indices, dtype=torch.int64)] = values
        return dense

    def to_numpy(self, pad_value: int = 0) -> np.ndarray:
        return self.to_torch(pad_value).numpy()

    def tolist(self, pad_value: int = 0) -> list[Any]:
        return self.to_torch(pad_value).tolist()


def to_tensor_data(key: str, value: Any) -> TensorData:
    """``value`` (a ``TensorData``, a torch tensor, a numpy array or a list of numbers) as ``TensorData``;
    a list gets the dtype of ``key`` (``KEY_DTYPES``), float32 for keys it does not know."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        array = np.asarray(value)
        if array.dtype.kind not in "iuf" and len(value) > 0:
            raise ValueError(f"loss_fn_inputs[{key!r}] must be a rectangular array of numbers, got {value!r}")
        dtype = KEY_DTYPES.get(key, "float32")
        return TensorData(
            data=array.astype(_NUMPY_DTYPES[dtype]).flatten().tolist(), dtype=dtype, shape=list(array.shape)
        )
    raise TypeError(
        f"loss_fn_inputs[{key!r}] is a {type(value).__name__}: give a TensorData, a torch tensor, a numpy "
        "array or a list of numbers"
    )


@attrs.frozen
class EncodedTextChunk:
    """Token ids, a chunk of a ``ModelInput``."""

    tokens: list[int] = attrs.field(converter=list)
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@attrs.frozen
class ModelInput:
    """The tokens a model reads, as chunks (only ``EncodedTextChunk`` here: images are Tinker's)."""

    chunks: list[EncodedTextChunk] = attrs.field(converter=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(token) for token in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """Every chunk's tokens, in order."""
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise ValueError(
                    f"ModelInput holds a {type(chunk).__name__}: only EncodedTextChunk (token ids) is supported"
                )
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[token]))


def _loss_fn_inputs(value: Mapping[str, Any]) -> dict[str, TensorData]:
    return {key: to_tensor_data(key, item) for key, item in value.items()}


@attrs.frozen
class Datum:
    """One training sequence: ``model_input`` (``N`` tokens) and the loss's inputs, each of shape ``(N,)``
    with Tinker's alignment: position ``i`` of every input is about the token predicted after reading
    ``model_input``'s tokens ``0..i`` (``target_tokens[i]``, usually the sequence shifted by one)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = attrs.field(factory=dict, converter=_loss_fn_inputs)


@attrs.frozen
class AdamParams:
    """One optimiser step's AdamW settings (Tinker's defaults: no weight decay, no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    #: Decoupled weight decay, as ``torch.optim.AdamW``.
    weight_decay: float = 0.0
    #: Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip_norm: float = 0.0


@attrs.frozen
class ForwardBackwardOutput:
    """``loss_fn_outputs``: one dict per datum (``logprobs`` of its target tokens, ``elementwise_loss``
    for the built-in losses); ``metrics``: ``loss:sum`` (the batch's loss) and the loss's own."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class OptimStepResponse:
    """``metrics``: ``grad_norm`` (before clipping) and ``learning_rate`` of the step."""

    metrics: dict[str, float] | None = None


@attrs.frozen
class SaveWeightsResponse:
    """``path``: a ``tinker://<model_id>/weights/<name>`` path that ``load_state`` takes."""

    path: str


@attrs.frozen
class SaveWeightsForSamplerResponse:
    """``path``: a ``tinker://<model_id>/sampler_weights/<name>`` path that ``create_sampling_client`` takes."""

    path: str


@attrs.frozen
class LoadWeightsResponse:
    path: str | None = None


@attrs.frozen
class SamplingParams:
    """How ``SamplingClient.sample`` samples. ``stop``: ``None`` stops at the model's EOS token, a list
    of token ids at any of them (``[]``: only at ``max_tokens``); the stop token ends the sequence.
    ``top_k=-1`` and ``top_p=1`` sample from the whole distribution; ``temperature=0`` is greedy."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@attrs.frozen
class SampledSequence:
    """One sample: its ``tokens`` (the stop token included), their ``logprobs`` and its ``stop_reason``."""

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None


@attrs.frozen
class SampleResponse:
    """``sequences``: ``num_samples`` samples; ``prompt_logprobs`` when asked for: one per prompt
    token, ``None`` for the first (nothing predicts it)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@attrs.frozen
class SupportedModel:
    model_name: str | None = None


@attrs.frozen
class GetServerCapabilitiesResponse:
    """The base models a ``ServiceClient`` trains and samples."""

    supported_models: list[SupportedModel]


@attrs.frozen
class ModelData:
    model_name: str | None = None


@attrs.frozen
class GetInfoResponse:
    """A training client's model: its id, base model and LoRA rank (``None``: full fine-tuning)."""

    model_id: str
    model_data: ModelData
    is_lora: bool | None = None
    lora_rank: int | None = None
