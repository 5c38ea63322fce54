"""Weight transports: how the trained weights travel to separate rollout replicas (``rollout.placement:
separate``), a plugin kind (``verl_weight_transports``, selected by ``rollout.weight_transport``).

The actor's output rank packs each policy version into the checked buckets of rollout contract 2
(``verl_core.rollout.buckets``) and hands them to the transport's ``publish``, which sends them and
returns a handle: something small and picklable (references, a path, a key) that the driver passes to
every replica. Each replica's ``receive(handle)`` yields the buckets back, in order, and the rollout
checks every one (``update_weights_from_buckets``), so a transport that corrupts, drops or reorders a
bucket is caught there. A handle may be received by several replicas and after newer ones were
published (an asynchronous run keeps the versions its batches still need), until the driver drops it.

Core's built-ins: ``object_store``, each bucket put once into Ray's object store (on the actor's node;
Ray moves it to the replicas' nodes), and ``memory``, the buckets themselves (in-process workers).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any

from verl_core.rollout.buckets import WeightBucket


class BaseWeightTransport(abc.ABC):
    """Base class of weight transports (see the module docstring). Constructed without arguments, once
    per process that publishes or receives."""

    #: The largest bucket the transport moves well, in MiB (``None``: any): the actor packs each
    #: version in buckets of ``rollout.update_weights_bucket_megabytes`` or this, the smaller.
    max_bucket_megabytes: int | None = None

    @abc.abstractmethod
    def publish(self, buckets: Iterable[WeightBucket]) -> Any:
        """Send one policy version's ``buckets`` (on the actor's output rank); the handle replicas
        receive them by. The buckets arrive lazily: take each before asking for the next."""

    @abc.abstractmethod
    def receive(self, handle: Any) -> Iterator[WeightBucket]:
        """The buckets ``publish`` sent under ``handle``, in order (on a replica)."""


class ObjectStoreTransport(BaseWeightTransport):
    """Each bucket put once into Ray's object store by the publishing process, which owns it; the
    handle is the list of references, and a replica fetches one bucket at a time.

    Buckets of at most 64 MiB: a larger object is slower to put and get (docs/benchmarks.md: 512 MiB
    buckets moved SmolLM2-135M's weights at 113 MB/s, 64 MiB ones at 301, 16 MiB ones at 356), and one
    larger than the store (a local cluster's is 256 MiB) is allocated outside it."""

    max_bucket_megabytes = 64

    def publish(self, buckets: Iterable[WeightBucket]) -> list[Any]:
        import ray

        return [ray.put(bucket) for bucket in buckets]

    def receive(self, handle: list[Any]) -> Iterator[WeightBucket]:
        import ray

        for reference in handle:
            yield ray.get(reference)


class MemoryTransport(BaseWeightTransport):
    """The buckets themselves: publisher and replicas share the driver's process."""

    def publish(self, buckets: Iterable[WeightBucket]) -> list[WeightBucket]:
        return list(buckets)

    def receive(self, handle: list[WeightBucket]) -> Iterator[WeightBucket]:
        yield from handle
