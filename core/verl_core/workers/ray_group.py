"""``RayWorkerGroup``: one Ray actor per engine rank, forming a ``torch.distributed`` group.

With no address ``ray.init()`` starts a local cluster (kept on loopback, without the dashboard); with
``trainer.ray_address`` the group joins an existing cluster, checked reachable first so that a wrong
address is an error within seconds, not a hang. Rank 0 picks the rendezvous address and port on its
own node; every rank then joins the group (gloo on CPU, NCCL on GPU) with a bounded timeout and
builds its worker. Calls wait for every rank and surface the first failure at once: an exception in
a rank becomes a ``WorkerError`` naming the role and the rank (the original chained), and a rank
whose process died too.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from verl_core.workers.group import WorkerError, WorkerGroup

#: Set before Ray is imported: sockets on loopback, no sign-in, no usage reporting.
RAY_ENVIRONMENT = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
#: How long a rank waits in a collective for the others (a dead rank fails the others after it).
COLLECTIVE_TIMEOUT_S = 120
#: How long an existing cluster may take to answer.
CONNECT_TIMEOUT_S = 10.0
#: The object store of a local cluster (the default would take 30% of the machine's memory).
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20


def ensure_ray(address: str | None) -> Any:
    """Ray, initialised: a local cluster, or the one at ``address`` (``host:port`` or ``ray://...``)."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ray

    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        return ray
    if address is None:
        ray.init(
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            _temp_dir="/tmp/verl_ray",
            log_to_driver=True,
        )
        return ray
    ray.init(address=address, log_to_driver=True)
    return ray


def _check_reachable(address: str) -> None:
    host_port = address.removeprefix("ray://").removeprefix("http://")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise WorkerError(
            f"trainer.ray_address={address!r}: expected host:port (e.g. 127.0.0.1:6379) or ray://host:port"
        )
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise WorkerError(
            f"trainer.ray_address={address!r}: no Ray cluster answers there ({error}); start one with "
            "`ray start --head`, fix the address, or unset trainer.ray_address to start a local cluster"
        ) from None


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class _Rank:
    """The Ray actor of one rank (decorated with ``ray.remote`` when the group is made)."""

    def __init__(self, role: str, rank: int, world_size: int):
        self.role, self.rank, self.world_size = role, rank, world_size
        self.worker: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def setup(self, host: str, port: int, make_worker: Callable[[], Any], device: str) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # ranks share the machine's cores: oversubscription is ~100x slower
        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.worker = make_worker()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors of ``role``, each building its worker with ``make_worker()``."""

    def __init__(
        self,
        role: str,
        make_worker: Callable[[], Any],
        world_size: int,
        address: str | None = None,
        device: str = "cpu",
    ):
        ray = ensure_ray(address)
        self.role, self.world_size = role, world_size
        # One GPU per rank on CUDA: Ray then makes that GPU the rank's only visible one (cuda:0).
        gpus = 1 if device.startswith("cuda") else 0
        remote = ray.remote(num_cpus=0, num_gpus=gpus, max_restarts=0)(_Rank)
        self.actors = [remote.remote(role, rank, world_size) for rank in range(world_size)]
        host, port = self._wait([self.actors[0].rendezvous_address.remote()])[0]
        self._wait([actor.setup.remote(host, port, make_worker, device) for actor in self.actors])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def call_each(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self._wait(
            [actor.call.remote(method, *args) for actor, args in zip(self.actors, args_per_rank, strict=True)]
        )

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def _wait(self, futures: list[Any]) -> list[Any]:
        """Every future's value, in order; the first rank to fail raises at once (the others may be
        waiting for it in a collective)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {future: rank for rank, future in enumerate(futures)}
        pending = list(futures)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for future in ready:
                try:
                    ray.get(future)
                except RayTaskError as error:
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    raise WorkerError(f"{self.role} rank {rank_of[future]} failed: {cause}") from cause
                except RayActorError as error:
                    raise WorkerError(
                        f"{self.role} rank {rank_of[future]}'s process died ({type(error).__name__}); the run "
                        "stops here, the last checkpoint is intact: fix the cause and run again to resume"
                    ) from error
        return ray.get(futures)
