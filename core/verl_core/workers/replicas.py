"""Rollout replicas: the rollout in processes of its own (``rollout.placement=separate``).

Colocated, the rollout lives in the actor's processes: it generates while their engines wait, and takes
the weights in memory. Separate, each of ``rollout.replicas`` processes holds a rollout alone (a Ray
actor asking for ``rollout.replica_resources``; with ``trainer.workers=in_process``, a worker in the
driver's process), so that generation can run while the actor trains (``async_training``).

A generation's prompts are split over the replicas as over DP ranks (``Actor.generate``: contiguous
shares, each seeded by ``derive_seed("rollout", seed, replica)``), so that ``n`` replicas generate
what ``n`` colocated DP ranks do, token for token. The weights travel as the checked buckets of rollout
contract 2 (``verl_core.rollout.buckets``): the actor's output rank packs them (``publish_weights``) and
the run's weight transport (``verl_core.rollout.transport``, ``rollout.weight_transport``) carries them:
by default under Ray each bucket goes into Ray's object store once, on the actor's node, and every
replica fetches it from there (across nodes, Ray's object transfer); in process the buckets are handed
over as they are. Each replica checks every bucket (``update_weights_from_buckets``) and records the
policy version it holds.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch
from tensordict import TensorDict

from verl_core.data.batch import RESPONSE_MASK, ROLLOUT_POLICY_VERSIONS, concat_batches, responses_batch
from verl_core.engine.topology import Topology
from verl_core.hookspecs import Kind
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.requests import FinishReason, RolloutRequest, RolloutResponse
from verl_core.rollout.transport import BaseWeightTransport
from verl_core.seeds import derive_seed
from verl_core.workers.dispatch import contiguous_shards
from verl_core.workers.group import WorkerGroup

#: How many requests a replica's Ray actor serves at once (each waits in a thread of its own).
REQUEST_CONCURRENCY = 256
#: How often partial rollouts look for newer weights while requests are in flight, in seconds.
RESUMABLE_POLL_S = 0.05
#: The weights of one policy version on their way to the replicas: a weight transport's handle
#: (``BaseWeightTransport.publish``).
PublishedWeights = Any


def load_transport(config: Any, registry: Any) -> BaseWeightTransport:
    """The weight transport the run uses (``RunConfig.weight_transport``), in this process."""
    entry = registry.entry(Kind.WEIGHT_TRANSPORTS, config.weight_transport, where="rollout.weight_transport")
    return entry.load("transport")()


def replica_device(config: Any) -> str:
    """A replica computes on CUDA where it asks for a GPU (Ray makes it the only visible one)."""
    return "cuda" if config.rollout.replica_resources.get("GPU", 0) > 0 else "cpu"


class RolloutReplicaWorker:
    """One replica: a rollout of ``rollout.backend`` alone in its process, and the policy version of
    its weights (``None`` until a version arrives: the weights it loaded from ``actor.engine.model``).

    Requests (rollout contract 2) are served by the rollout's ``generate_request`` on one event loop
    of the replica's own, so that requests sent at once from several threads (a Ray actor serving
    ``REQUEST_CONCURRENCY`` calls at a time) are in flight together: a backend with continuous
    batching batches them, the built-in one serves them in turn."""

    def __init__(self, config: Any, registry: Any = None):
        from verl_core.plugins.registry import registry_or_installed

        registry = registry_or_installed(registry)
        entry = registry.entry(Kind.ROLLOUT_BACKENDS, config.rollout.backend, where="rollout.backend")
        self.rollout = entry.load("rollout")(
            config.rollout_model, config.rollout.options, device=replica_device(config), config_path="rollout"
        )
        self.transport = load_transport(config, registry)
        self.version: int | None = None

    def initialize(self) -> Topology:
        self.rollout.initialize()
        self._requests = asyncio.new_event_loop()
        threading.Thread(target=self._requests.run_forever, name="rollout-requests", daemon=True).start()
        return Topology(dp_rank=0, dp_size=1, is_output_rank=True)

    def generate_request(self, request: RolloutRequest) -> RolloutResponse:
        """One request, on the replica's event loop (see the class docstring)."""
        return asyncio.run_coroutine_threadsafe(
            self.rollout.generate_request(request), self._requests
        ).result()

    def abort(self, request_id: str) -> None:
        asyncio.run_coroutine_threadsafe(self.rollout.abort(request_id), self._requests).result()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        return self.rollout.generate(prompts, sampling, seed)

    def update_weights(self, published: PublishedWeights, version: int) -> int:
        """Take the weights of policy ``version``; the version now held."""
        self.rollout.update_weights_from_buckets(self.transport.receive(published))
        self.version = version
        return version


class RolloutReplicas:
    """The driver's handle on the replicas: one worker group per replica (a replica is independent of
    the others: no collective joins them), called side by side from a thread each. Every call to one
    replica holds its lock, so that the generation thread of an asynchronous run and the trainer's
    own calls (validation) take turns on it."""

    def __init__(self, groups: Sequence[WorkerGroup]):
        self.groups = list(groups)
        self._locks = [threading.Lock() for _ in self.groups]
        self._pool = ThreadPoolExecutor(max_workers=len(self.groups), thread_name_prefix="rollout-replica")
        #: The policy version the replicas hold (``None``: the weights they loaded).
        self.version: int | None = None
        self._each(RolloutReplicaWorker.initialize)

    def __len__(self) -> int:
        return len(self.groups)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        """One response per prompt, as ``Actor.generate`` on as many DP ranks as there are replicas."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        shares = {
            replica: ([prompts[i] for i in shard.tolist()], sampling, derive_seed("rollout", seed, replica))
            for replica, shard in enumerate(contiguous_shards(len(prompts), len(self.groups)))
            if len(shard)  # fewer prompts than replicas: the last ones have none
        }
        return concat_batches(self._each(RolloutReplicaWorker.generate, shares), sampling.pad_token_id)

    def replica_for(self, session: str) -> int:
        """The replica that serves every request of ``session`` (a conversation): the same one each
        turn, so that its prefix cache holds the conversation; the sessions spread evenly."""
        return zlib.crc32(session.encode()) % len(self.groups)

    async def generate_request(self, request: RolloutRequest, session: str) -> RolloutResponse:
        """``request`` on the replica of ``session`` (``replica_for``); requests in flight together are
        served together (``RolloutReplicaWorker``). A ``submit`` for ``AgentLoop.run_requests``."""
        replica = self.replica_for(session)
        return await self.groups[replica].call_async(RolloutReplicaWorker.generate_request, request)

    async def abort(self, request_id: str, session: str) -> None:
        """Abort ``request_id``, in flight on the replica of ``session``."""
        await self.groups[self.replica_for(session)].call_async(RolloutReplicaWorker.abort, request_id)

    async def generate_resumable(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        seed: int,
        newer: Callable[[], tuple[int, PublishedWeights] | None],
    ) -> TensorDict:
        """One response per prompt, each a request (partial rollouts, ``async_training.partial_rollout``):
        whenever ``newer()`` offers newer weights while requests are in flight, every request in flight
        is aborted, the replicas take the weights, and the requests resume from their partial responses
        (``RolloutRequest.resume_from``). The batch contract of ``generate``, plus
        ``ROLLOUT_POLICY_VERSIONS``: each token's policy version (a resumed response has the versions its
        parts were generated with)."""
        ids = [f"{seed}-{index}" for index in range(len(prompts))]
        requests = [
            RolloutRequest(
                tuple(prompt), sampling, seed=derive_seed("rollout", seed, index), request_id=ids[index]
            )
            for index, prompt in enumerate(prompts)
        ]
        versions: list[list[tuple[int, int]]] = [
            [(0, self.version or 0)] for _ in prompts
        ]  # (from token, version)
        finished: dict[int, RolloutResponse] = {}
        while len(finished) < len(requests):
            flying = {
                index: asyncio.ensure_future(self.generate_request(requests[index], ids[index]))
                for index in range(len(requests))
                if index not in finished
            }
            offer = None
            while offer is None and not all(task.done() for task in flying.values()):
                await asyncio.wait(
                    flying.values(), timeout=RESUMABLE_POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                offer = newer() if not all(task.done() for task in flying.values()) else None
            if offer is not None:
                await asyncio.gather(
                    *(self.abort(ids[i], ids[i]) for i, task in flying.items() if not task.done())
                )
            for index, task in flying.items():
                response = await task
                if response.finish_reason is FinishReason.ABORTED:
                    requests[index] = attrs.evolve(requests[index], resume_from=response)
                else:
                    finished[index] = response
            if offer is not None:
                version, published = offer
                await asyncio.to_thread(self.update_weights, published, version)
                for index in range(len(requests)):
                    if index not in finished:
                        versions[index].append((len(requests[index].generated), version))
        return tagged_responses_batch(
            prompts, [finished[index] for index in range(len(requests))], versions, sampling.pad_token_id
        )

    def update_weights(self, published: PublishedWeights, version: int) -> None:
        """Every replica takes the weights of policy ``version``."""
        self._each(
            RolloutReplicaWorker.update_weights, dict.fromkeys(range(len(self.groups)), (published, version))
        )
        self.version = version

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _each(self, method: Any, args: Mapping[int, tuple[Any, ...]] | None = None) -> list[Any]:
        """``method`` on the replicas ``args`` names (``args[i]`` for replica ``i``; by default every
        replica, without arguments), side by side; the results in replica order. A failure raises its
        ``WorkerError``, which names the replica."""
        args = dict.fromkeys(range(len(self.groups)), ()) if args is None else args

        def call(replica: int) -> Any:
            with self._locks[replica]:
                (result,) = self.groups[replica].call(method, *args[replica])
            return result

        futures = [self._pool.submit(call, replica) for replica in sorted(args)]
        return [future.result() for future in futures]


def tagged_responses_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[RolloutResponse],
    versions: Sequence[Sequence[tuple[int, int]]],
    pad_token_id: int,
) -> TensorDict:
    """The batch contract of ``prompts`` and their ``responses``, with ``ROLLOUT_POLICY_VERSIONS`` (each
    response's ``versions``: ``(first token, version)`` in order)."""
    batch = responses_batch(
        prompts,
        [response.token_ids for response in responses],
        [response.log_probs for response in responses],
        pad_token_id,
    )
    tagged = torch.zeros_like(batch[RESPONSE_MASK])
    for row, parts in enumerate(versions):
        for start, version in parts:
            tagged[row, start:] = version
    batch[ROLLOUT_POLICY_VERSIONS] = tagged
    return batch
