"""The protobuf messages of Tinker's protocol that the ``tinker`` client (0.38) will only speak in
protobuf: the ``forward_backward`` request it sends, and the ``ForwardBackwardOutput`` and
``SampleResponse`` it reads back. Encoded and decoded here by hand (the wire format is varints and
length-prefixed fields), with the field numbers of the client's ``tinker_public.proto``, so that the
server needs neither the ``tinker`` package nor ``protobuf``.

Tensors travel as raw little-endian bytes: tokens as int32, ``Tensor`` values in their dtype
(``float32`` or ``int64``), per-datum outputs batched into one ``BatchedTensor`` with byte offsets.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from verl_core.service.types import Datum, EncodedTextChunk, ModelInput, SampleResponse, TensorData

#: ``tinker_public.DType``: the proto's dtype numbers.
DTYPES = {1: "float32", 2: "int64"}
_DTYPE_NUMBERS = {name: number for number, name in DTYPES.items()}
_NUMPY = {"float32": np.dtype("<f4"), "int64": np.dtype("<i8")}
#: ``tinker_public.StopReason``.
STOP_REASONS = {"stop": 0, "length": 1}

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """A request body that is not the protobuf message it should be."""


# -- decoding -------------------------------------------------------------------------------------


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(data):
            raise WireError("truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 64 bits")


def _fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """Each ``(field number, wire type, value)`` of a message: an int for varints, bytes for the rest."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, position = _varint(data, position)
        elif kind == _FIXED64:
            value, position = data[position : position + 8], position + 8
        elif kind == _FIXED32:
            value, position = data[position : position + 4], position + 4
        elif kind == _BYTES:
            length, position = _varint(data, position)
            value, position = data[position : position + length], position + length
        else:
            raise WireError(f"field {number}: wire type {kind} is not supported")
        if position > len(data):
            raise WireError(f"field {number}: truncated")
        yield number, kind, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_ints(kind: int, value: Any) -> list[int]:
    if kind == _VARINT:
        return [_signed(value)]
    numbers, position = [], 0
    while position < len(value):
        number, position = _varint(value, position)
        numbers.append(_signed(number))
    return numbers


def _tensor(data: bytes) -> TensorData:
    dense, csr, dtype_number, shape = None, None, 0, []
    for number, kind, value in _fields(data):
        if number == 1:
            dense = value
        elif number == 2:
            csr = {n: v for n, _, v in _fields(value)}
        elif number == 3:
            dtype_number = value
        elif number == 4:
            shape += _packed_ints(kind, value)
    if dtype_number not in DTYPES:
        raise WireError(f"tensor dtype {dtype_number}: only float32 (1) and int64 (2) are supported")
    dtype = DTYPES[dtype_number]
    if csr is not None:
        return TensorData(
            data=np.frombuffer(csr.get(1, b""), _NUMPY[dtype]).tolist(),
            dtype=dtype,
            shape=shape,
            sparse_crow_indices=np.frombuffer(csr.get(2, b""), "<i8").tolist(),
            sparse_col_indices=np.frombuffer(csr.get(3, b""), "<i8").tolist(),
        )
    return TensorData(
        data=np.frombuffer(dense or b"", _NUMPY[dtype]).tolist(), dtype=dtype, shape=shape or None
    )


def _chunk(data: bytes) -> EncodedTextChunk:
    for number, _, value in _fields(data):
        if number == 1:
            tokens = {n: v for n, _, v in _fields(value)}.get(1, b"")
            return EncodedTextChunk(tokens=np.frombuffer(tokens, "<i4").tolist())
        kind = {2: "an image chunk", 3: "an audio (dmel) chunk"}.get(number, f"chunk field {number}")
        raise WireError(f"model_input holds {kind}: only encoded text (token ids) is supported")
    return EncodedTextChunk(tokens=[])


def _datum(data: bytes) -> Datum:
    chunks, inputs = [], {}
    for number, _, value in _fields(data):
        if number == 1:
            chunks.append(_chunk(value))
        elif number == 2:
            entry = {n: v for n, _, v in _fields(value)}
            inputs[entry.get(1, b"").decode()] = _tensor(entry.get(2, b""))
    return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs)


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """A ``ForwardBackwardRequest`` as ``model_id``, ``seq_id``, ``data`` (``Datum`` s), ``loss_fn``,
    ``loss_fn_config`` and ``forward_only``."""
    request: dict[str, Any] = {"data": [], "loss_fn_config": {}, "forward_only": False, "seq_id": 0}
    config_v2: dict[str, Any] = {}
    for number, _, value in _fields(body):
        if number == 1:
            request["model_id"] = value.decode()
        elif number == 2:
            request["seq_id"] = _signed(value)
        elif number == 3:
            request["data"].append(_datum(value))
        elif number == 4:
            request["loss_fn"] = value.decode()
        elif number == 5:
            entry = {n: v for n, _, v in _fields(value)}
            request["loss_fn_config"][entry.get(1, b"").decode()] = struct.unpack(
                "<d", entry.get(2, bytes(8))
            )[0]
        elif number == 6:
            request["forward_only"] = bool(value)
        elif number == 7:
            entry = {n: v for n, _, v in _fields(value)}
            inner = {n: v for n, _, v in _fields(entry.get(2, b""))}
            config_v2[entry.get(1, b"").decode()] = (
                struct.unpack("<d", inner[1])[0] if 1 in inner else inner.get(2, b"").decode()
            )
    request["loss_fn_config"].update(config_v2)
    if "model_id" not in request or "loss_fn" not in request:
        raise WireError("a forward_backward request needs model_id and loss_fn")
    return request


# -- encoding -------------------------------------------------------------------------------------


def _key(number: int, kind: int) -> bytes:
    return _encode_varint(number << 3 | kind)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _key(number, _BYTES) + _encode_varint(len(value)) + value


def _varint_field(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _encode_varint(value) if value else b""


def _packed_field(number: int, values: list[int]) -> bytes:
    return _bytes_field(number, b"".join(_encode_varint(v) for v in values)) if values else b""


def _double_entry(key: str, value: float) -> bytes:
    return _bytes_field(1, key.encode()) + _key(2, _FIXED64) + struct.pack("<d", value)


def encode_forward_backward_output(output: Any) -> bytes:
    """A ``ForwardBackwardOutput`` (ours) as the proto the client reads: one ``ArrayRecord`` holding,
    per output name, every datum's values back to back with their byte offsets."""
    outputs = list(output.loss_fn_outputs)
    record = _bytes_field(1, b"ArrayRecord") + _varint_field(3, len(outputs))
    for name in dict.fromkeys(key for item in outputs for key in item):
        arrays = [item[name] for item in outputs]
        dtype = arrays[0].dtype
        values = [np.asarray(array.tolist(), _NUMPY[dtype]).reshape(-1) for array in arrays]
        offsets = np.cumsum([0] + [value.nbytes for value in values]).astype("<i8")
        shape = arrays[0].shape or [len(arrays[0].data)]
        batched = (
            _bytes_field(1, b"".join(value.tobytes() for value in values))
            + _bytes_field(2, offsets.tobytes())
            + _varint_field(3, _DTYPE_NUMBERS[dtype])
            + _packed_field(4, list(shape[1:]))
        )
        record += _bytes_field(2, _bytes_field(1, name.encode()) + _bytes_field(2, batched))
    message = _bytes_field(1, output.loss_fn_output_type.encode()) + _bytes_field(2, record)
    for key, value in output.metrics.items():
        message += _bytes_field(3, _double_entry(key, float(value)))
    return message


def encode_sample_response(response: SampleResponse) -> bytes:
    """A ``SampleResponse`` as the proto the client reads (a prompt log-prob of ``None`` as NaN)."""
    message = b""
    for sequence in response.sequences:
        body = _varint_field(1, STOP_REASONS[sequence.stop_reason]) + _bytes_field(
            2, np.asarray(sequence.tokens, "<i4").tobytes()
        )
        if sequence.logprobs is not None:
            body += _bytes_field(3, np.asarray(sequence.logprobs, "<f4").tobytes())
        message += _bytes_field(1, body)
    if response.prompt_logprobs is not None:
        values = [math.nan if value is None else value for value in response.prompt_logprobs]
        message += _bytes_field(2, np.asarray(values, "<f4").tobytes())
    return message
