"""Bucketed weight sync (rollout contract 2): the engine's weights as a stream of flat byte buffers of
about a configured size, each checked on arrival.

``weight_buckets(params, bucket_bytes)`` packs an engine's ``get_per_tensor_param()`` stream (full
tensors under Hugging Face names, in order) into ``WeightBucket`` s lazily: it holds one bucket being
filled at a time, and a tensor larger than a bucket travels alone in one of its own size. Each bucket
carries its tensors' names, shapes, dtypes and byte offsets, its position in the stream (``index``,
``final`` on the last one) and a CRC-32 of its bytes. A serving engine in another process (or on
another node) receives buckets over whatever transport it has; an in-process rollout receives them as
they are.

``unpack_buckets(buckets)`` is the receiving side: it checks every bucket as it arrives (the checksum,
the index following the one before, no name twice) and yields the tensors of each (views of its
buffer: a rollout copies what it keeps), raising ``RolloutError`` for a corrupt bucket, a gap, a
bucket after the final one, or a stream that ends before its final bucket.
``BaseRollout.update_weights_from_buckets`` feeds it to ``update_weights``, so that a failed stream
fails that update, which leaves the rollout refusing to generate until a complete one arrives.

CRC-32 (``zlib.crc32``) ran at ~1.4 GB/s on this repository's CPU machine, a sum-based hash in torch at
~0.2 GB/s (it widens every word): it is computed on the CPU, so a bucket on an accelerator is copied to
the host for it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import attrs
import torch

from verl_core.errors import RolloutError

#: Every tensor starts at a multiple of this many bytes in a bucket, so that its bytes can be viewed as
#: its dtype in place (the widest element is 8 bytes).
ALIGNMENT = 16
#: The names of a bucket a message lists before "...".
NAMES_SHOWN = 4


@attrs.frozen(eq=False)
class WeightBucket:
    """Consecutive tensors of a weight stream in one flat byte buffer.

    ``names``, ``shapes``, ``dtypes`` and ``offsets`` (bytes into ``buffer``) describe each tensor, in
    stream order; ``buffer`` is a 1-D ``torch.uint8`` tensor; ``checksum`` the CRC-32 of its bytes;
    ``index`` the bucket's position in its stream (from 0); ``final`` is true on the stream's last bucket.
    """

    index: int
    final: bool
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    buffer: torch.Tensor
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each tensor, as views of ``buffer`` (no copy)."""
        for name, shape, dtype, offset in zip(
            self.names, self.shapes, self.dtypes, self.offsets, strict=True
        ):
            size = _nbytes(shape, dtype)
            yield name, self.buffer[offset : offset + size].view(dtype).view(shape)

    def describe(self) -> str:
        """``bucket 3 (model.layers.1.mlp.up_proj.weight, ... 5 tensors, 1.2 MB)``: how messages name it."""
        shown = ", ".join(self.names[:NAMES_SHOWN]) + (", ..." if len(self.names) > NAMES_SHOWN else "")
        return f"bucket {self.index} ({shown}: {len(self.names)} tensors, {self.nbytes / 1e6:.3g} MB)"


def checksum(buffer: torch.Tensor) -> int:
    """The CRC-32 of ``buffer``'s bytes (a 1-D ``torch.uint8`` tensor, on any device)."""
    host = buffer.detach().to("cpu").contiguous()
    return zlib.crc32(host.numpy()) if host.numel() else 0


def weight_buckets(params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Pack ``params`` (``(name, full tensor)`` in stream order, as ``get_per_tensor_param`` yields them)
    into buckets of at most ``bucket_bytes`` (a tensor larger than that fills a bucket alone), lazily:
    the next tensor is read only once the current bucket is handed on, so that about one bucket is held
    at a time. Each bucket's buffer is on the device of its first tensor."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"weight_buckets: bucket_bytes={bucket_bytes!r}: expected an int >= 1")
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0
    index = 0
    for name, tensor in params:
        size = _aligned(tensor.numel() * tensor.element_size())
        if pending and used + size > bucket_bytes:
            yield _pack(pending, index, final=False)
            pending, used, index = [], 0, index + 1
        pending.append((name, tensor))
        used += size
    yield _pack(pending, index, final=True)


def _pack(tensors: list[tuple[str, torch.Tensor]], index: int, final: bool) -> WeightBucket:
    offsets, end = [], 0
    for _, tensor in tensors:
        offsets.append(end)
        end += _aligned(tensor.numel() * tensor.element_size())
    device = tensors[0][1].device if tensors else torch.device("cpu")
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for (_, tensor), offset in zip(tensors, offsets, strict=True):
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
    return WeightBucket(
        index=index,
        final=final,
        names=tuple(name for name, _ in tensors),
        shapes=tuple(tuple(tensor.shape) for _, tensor in tensors),
        dtypes=tuple(tensor.dtype for _, tensor in tensors),
        offsets=tuple(offsets),
        buffer=buffer,
        checksum=checksum(buffer),
    )


def unpack_buckets(buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a bucket stream, each bucket checked before any of its tensors is yielded; raises
    ``RolloutError`` naming the bucket for a checksum that does not match its bytes, an index that does
    not follow the last one (a bucket lost, repeated or out of order), a name already received, a
    bucket after the final one, and a stream that ends before its final bucket."""
    seen: set[str] = set()
    expected = 0
    final = None
    for bucket in buckets:
        if final is not None:
            raise RolloutError(
                f"weight update: {bucket.describe()} arrived after the final {final.describe()}: the stream "
                "is not one update"
            )
        if bucket.index != expected:
            what = (
                f"bucket {expected} is missing"
                if bucket.index > expected
                else "a bucket arrived twice or late"
            )
            raise RolloutError(
                f"weight update: {bucket.describe()} arrived after {expected} bucket(s): {what}; the rollout keeps "
                "refusing to generate until a complete stream arrives"
            )
        actual = checksum(bucket.buffer)
        if actual != bucket.checksum:
            raise RolloutError(
                f"weight update: {bucket.describe()} is corrupt: its bytes have CRC-32 {actual:#010x}, it was "
                f"sent with {bucket.checksum:#010x}; the rollout keeps refusing to generate until a complete "
                "stream arrives"
            )
        _check_layout(bucket)
        again = [name for name in bucket.names if name in seen]
        if again:
            raise RolloutError(
                f"weight update: {bucket.describe()} holds {again[0]!r}, which an earlier bucket already sent"
            )
        seen.update(bucket.names)
        yield from bucket.tensors()
        expected += 1
        if bucket.final:
            final = bucket
    if final is None:
        raise RolloutError(
            f"weight update: the bucket stream ended after {expected} bucket(s) without its final one: a "
            "truncated stream; the rollout keeps refusing to generate until a complete stream arrives"
        )


def _check_layout(bucket: WeightBucket) -> None:
    """The tensors a bucket describes lie inside its buffer, one after the other, aligned."""
    counts = {len(bucket.names), len(bucket.shapes), len(bucket.dtypes), len(bucket.offsets)}
    if len(counts) != 1:
        raise RolloutError(f"weight update: {bucket.describe()} describes its tensors inconsistently")
    end = 0
    for name, shape, dtype, offset in zip(
        bucket.names, bucket.shapes, bucket.dtypes, bucket.offsets, strict=True
    ):
        if offset < end or offset % ALIGNMENT:
            raise RolloutError(
                f"weight update: {bucket.describe()}: {name!r} at byte {offset} overlaps or is unaligned"
            )
        end = offset + _nbytes(shape, dtype)
    if end > bucket.nbytes:
        raise RolloutError(
            f"weight update: {bucket.describe()} describes {end} bytes of tensors in a buffer of {bucket.nbytes}"
        )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT
