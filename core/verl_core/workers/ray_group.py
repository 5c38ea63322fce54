"""``RayWorkerGroup``: one Ray actor per engine rank, forming a ``torch.distributed`` group.

With no address ``ray.init()`` starts a local cluster (kept on loopback, without the dashboard and
without Ray's API-server process); with ``trainer.ray_address`` the group joins an existing cluster,
checked reachable first so that a wrong address is an error within seconds, not a hang. Rank 0
opens the rendezvous store's socket on its node's address only (loopback on a local cluster) and
every rank joins the group (gloo on CPU, NCCL on GPU) with a bounded timeout and builds its worker.

Calls wait for every rank and surface the first failure at once: an exception in a rank becomes a
``WorkerError`` naming the role and the rank (the original chained), and so does a rank whose
process died, or one that stopped answering: while the driver waits, it asks each busy rank whether
it is alive (a call served by a thread of its own, so a rank busy computing still answers); a rank
silent for half of ``liveness_timeout_s`` is named in a warning, and one silent for all of it (a
stopped or hung process) ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from verl_core.config.run import LOCAL_OBJECT_STORE_MEGABYTES
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
#: How often a local cluster's start is tried before the run fails.
LOCAL_START_ATTEMPTS = 2
#: The default of ``trainer.worker_timeout_s``: a rank that does not answer a liveness check for
#: this long is reported (Ray's own health check declares a node dead after about as long).
LIVENESS_TIMEOUT_S = 30.0
#: The least a rank gets to answer while it sets up: importing torch (loading its libraries) and
#: reading a model's weights can hold Python's global lock for many seconds at a time on a busy node.
SETUP_LIVENESS_TIMEOUT_S = 120.0
#: How often the driver checks on the ranks it waits for, and the most often it asks one.
POLL_S = 1.0
PING_INTERVAL_S = 5.0
#: The concurrency group that answers liveness checks beside the rank's work.
LIVENESS_GROUP = "liveness"


def ensure_ray(address: str | None, object_store_megabytes: int = LOCAL_OBJECT_STORE_MEGABYTES) -> Any:
    """Ray, initialised: a local cluster (with an object store of ``object_store_megabytes``), or the
    one at ``address`` (``host:port`` or ``ray://...``). A cluster already initialised is kept as it is.

    The caller's SIGTERM handler survives ``ray.init`` (which installs its own, and a native one
    that dumps a stack trace and aborts), so that a stop request ends the run the caller's way.
    """
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ray

    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        return ray
    with _keep_sigterm_handler():
        if address is None:
            _start_local_cluster(ray, object_store_megabytes << 20)
        else:
            ray.init(address=address, log_to_driver=True)
    return ray


def _start_local_cluster(ray: Any, object_store_bytes: int) -> None:
    """``ray.init`` of a local cluster, tried twice: on a machine whose cores are all busy, Ray's own
    processes can miss the deadlines of their first RPCs (``Failed to get node info: ... Deadline
    Exceeded``), and a second start, after the first one's processes are shut down, gets through."""
    for attempt in range(LOCAL_START_ATTEMPTS):
        try:
            with _without_api_server(ray):
                ray.init(
                    include_dashboard=False,
                    object_store_memory=object_store_bytes,
                    _temp_dir="/tmp/verl_ray",
                    log_to_driver=True,
                )
            return
        except Exception as error:  # Ray raises plain Exception and RuntimeError subclasses alike
            ray.shutdown()
            if attempt + 1 == LOCAL_START_ATTEMPTS:
                raise WorkerError(
                    f"could not start a local Ray cluster ({LOCAL_START_ATTEMPTS} attempts): {error}. "
                    "Is the machine overloaded, or /tmp/verl_ray full? Ray's logs are in "
                    "/tmp/verl_ray/session_latest/logs"
                ) from error
            print(f"verl-core: starting Ray failed ({error}); trying once more", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        # Re-installing it also replaces the native handler Ray's core worker put underneath.
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _without_api_server(ray: Any) -> Iterator[None]:
    """``ray.init`` without the API-server process, which a local cluster started without the
    dashboard does not use: with the dashboard off it only hosts Ray's usage-stats module, which
    queries the cloud metadata addresses (169.254.169.254, metadata.google.internal) even with usage
    stats disabled, and ``ray.init`` waits seconds for it to come up. Ray treats an API server that
    failed to start as absent (no dashboard URL); the job and state APIs are served by the
    dashboard, which is off anyway."""
    services = getattr(ray, "_private", None) and getattr(ray._private, "services", None)
    original = getattr(services, "start_api_server", None)
    if original is None:  # another Ray: start it as Ray does
        yield
        return

    def start_api_server(include_dashboard: Any, *args: Any, **kwargs: Any) -> Any:
        if include_dashboard is False:
            return None, None
        return original(include_dashboard, *args, **kwargs)

    services.start_api_server = start_api_server
    try:
        yield
    finally:
        services.start_api_server = original


def start_together(groups: Sequence[RayWorkerGroup]) -> None:
    """Bring up ``groups`` (made with ``wait=False``) side by side: each group's ranks set up as soon
    as its processes are up, whatever the other groups are doing; return when every group is ready.
    A group that fails raises (its ``WorkerError``) and the callers release them all."""
    for group in groups:
        group._begin_setup()
    for group in groups:
        group._finish_setup()


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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name.startswith("lo")), None)


def _keep_collectives_on(host: str) -> None:
    """On a loopback rendezvous (a local cluster), gloo's and NCCL's own sockets on loopback too:
    by default they bind to the address the machine's hostname resolves to, or to the first network
    interface. Variables the user set are left alone."""
    if not is_loopback(host):
        return
    interface = _loopback_interface()
    if interface is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, interface)


def rank_demand(device: str, resources: Mapping[str, float] | None = None) -> dict[str, float]:
    """The Ray resources one rank asks for: ``resources`` where given (``CPU``, ``GPU``, custom ones),
    else one GPU on CUDA (Ray then makes that GPU the rank's only visible one, cuda:0) and no CPU (ranks
    share a node's cores, as ``torch.set_num_threads(1)`` in each assumes)."""
    if resources is not None:
        return {name: float(amount) for name, amount in resources.items() if amount}
    return {"GPU": 1.0} if device.startswith("cuda") else {}


def rank_options(device: str, resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``ray.remote`` options for ``rank_demand``."""
    demand = dict(rank_demand(device, resources))
    options: dict[str, Any] = {"num_cpus": demand.pop("CPU", 0.0), "num_gpus": demand.pop("GPU", 0.0)}
    if demand:
        options["resources"] = demand
    return options


class _Rank:
    """The Ray actor of one rank (decorated with ``ray.remote`` when the group is made)."""

    def __init__(self, role: str, rank: int, world_size: int):
        self.role, self.rank, self.world_size = role, rank, world_size
        self.worker: Any = None
        self._listener: socket.socket | None = None
        # Stopping is the driver's business: a SIGTERM (a whole process group stopped by a scheduler)
        # ends the rank quietly, without the stack dump of Ray's native handler reaching the console.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def start(self) -> tuple[int, str, str, int | None]:
        """This rank's process id, node address and Ray node id; rank 0 also opens the rendezvous
        store's socket on that address alone (not on every interface, as the store would) and returns
        its port."""
        import ray

        host = ray.util.get_node_ip_address()
        port = None
        if self.rank == 0:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, 0), family=family, backlog=128)
            port = self._listener.getsockname()[1]
        return os.getpid(), host, ray.get_runtime_context().get_node_id(), port

    def alive(self) -> int:
        """Answered by the liveness thread while the rank works: its process id."""
        return os.getpid()

    def setup(self, host: str, port: int, make_worker: Callable[[], Any], device: str) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # ranks share the machine's cores: oversubscription is ~100x slower
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.rank == 0:
            listen_fd = self._listener.detach()  # the store owns the socket from here on
            self._listener = None
            store = dist.TCPStore(
                host, port, self.world_size, is_master=True, timeout=timeout, master_listen_fd=listen_fd
            )
        else:
            store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        _keep_collectives_on(host)
        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        self.worker = make_worker()

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return method(self.worker, *args, **kwargs)


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors of ``role``, each building its worker with ``make_worker()``.

    ``liveness_timeout_s`` bounds how long a rank may go without answering a liveness check while the
    driver waits for it (``trainer.worker_timeout_s``); 0 waits as long as the rank takes. ``resources``
    are the Ray resources each rank asks for (``rank_demand``); ``max_concurrency`` the calls a rank
    serves at once (each in a thread of its own; the default, one, runs them in turn).

    The group is ready when the constructor returns. With ``wait=False`` the ranks' processes are only
    asked for; ``start_together`` then brings several groups up side by side (their processes start,
    import and build their workers at the same time rather than one group after the other)."""

    def __init__(
        self,
        role: str,
        make_worker: Callable[[], Any],
        world_size: int,
        address: str | None = None,
        device: str = "cpu",
        liveness_timeout_s: float = LIVENESS_TIMEOUT_S,
        wait: bool = True,
        resources: Mapping[str, float] | None = None,
        max_concurrency: int = 1,
    ):
        ray = ensure_ray(address)
        self.role, self.world_size = role, world_size
        self.liveness_timeout_s = liveness_timeout_s
        remote = ray.remote(
            max_restarts=0,
            max_concurrency=max_concurrency,
            concurrency_groups={LIVENESS_GROUP: 1},
            **rank_options(device, resources),
        )(_Rank)
        self.actors = [remote.remote(role, rank, world_size) for rank in range(world_size)]
        #: Each rank's process id and node address, once it started.
        self.processes: list[tuple[int, str]] = []
        #: Each rank's Ray node id, once it started.
        self.nodes: list[str] = []
        self._pings: dict[int, Any] = {}  # rank: its unanswered liveness check
        self._last_ping: dict[int, float] = {}  # rank: when it was last asked
        self._heard: dict[int, float] = {}  # rank: when it last answered
        self._warned: set[int] = set()  # the ranks a warning named as silent
        self._starting = [actor.start.remote() for actor in self.actors]
        self._setting_up: list[Any] = []
        self._make_worker, self._device = make_worker, device
        if wait:
            start_together([self])

    def _begin_setup(self) -> None:
        """Wait for the ranks' processes; ask each to join the process group and build its worker."""
        started = self._wait(self._starting, liveness_timeout_s=0)
        self.processes = [(pid, host) for pid, host, _, _ in started]
        self.nodes = [node for _, _, node, _ in started]
        _, host, _, port = started[0]
        make_worker, device = self._make_worker, self._device
        self._setting_up = [actor.setup.remote(host, port, make_worker, device) for actor in self.actors]

    def _finish_setup(self) -> None:
        timeout_s = self.liveness_timeout_s
        self._wait(
            self._setting_up, liveness_timeout_s=max(timeout_s, SETUP_LIVENESS_TIMEOUT_S) if timeout_s else 0
        )
        self._starting = self._setting_up = []

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def call_each(self, method: Callable[..., Any], args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self._wait(
            [actor.call.remote(method, *args) for actor, args in zip(self.actors, args_per_rank, strict=True)]
        )

    async def call_async(self, method: Callable[..., Any], *args: Any) -> Any:
        """See ``WorkerGroup.call_async``; failures are ``_wait``'s ``WorkerError`` s, naming the rank,
        and so is a rank silent for ``liveness_timeout_s`` meanwhile (``_check_liveness``)."""
        future = self.actors[0].call.remote(method, *args)
        result = asyncio.wrap_future(future.future())
        waiting_since = time.monotonic()
        while not result.done():
            await asyncio.wait({result}, timeout=POLL_S)
            if not result.done() and self.liveness_timeout_s > 0:
                self._check_liveness([0], self.liveness_timeout_s, waiting_since)
        if result.exception() is not None:
            self._wait([future], liveness_timeout_s=0)  # raises the failure as a WorkerError
        return result.result()

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        self.actors = []

    def describe(self, rank: int, process: bool = False) -> str:
        """``actor rank 1 (pid 4242 on 127.0.0.1)``, what a message names a rank by; with ``process``,
        ``actor rank 1's process (pid 4242 on 127.0.0.1)``."""
        where = (
            f" (pid {self.processes[rank][0]} on {self.processes[rank][1]})"
            if rank < len(self.processes)
            else ""
        )
        return f"{self.role} rank {rank}'s process{where}" if process else f"{self.role} rank {rank}{where}"

    def _wait(self, futures: list[Any], liveness_timeout_s: float | None = None) -> list[Any]:
        """Every future's value, in order (one per rank); the first rank to fail raises at once (the
        others may be waiting for it in a collective), as does a rank that has not answered a liveness
        check for ``liveness_timeout_s`` (default: the group's; 0: not checked)."""
        timeout_s = self.liveness_timeout_s if liveness_timeout_s is None else liveness_timeout_s
        import ray
        from ray.exceptions import RayActorError, RayTaskError, UnserializableException

        rank_of = {future: rank for rank, future in enumerate(futures)}
        pending = list(futures)
        waiting_since = time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for future in ready:
                try:
                    ray.get(future)
                except RayTaskError as error:
                    cause = error.cause if isinstance(error.cause, BaseException) else error
                    raise WorkerError(f"{self.describe(rank_of[future])} failed: {cause}") from cause
                except UnserializableException as error:  # an exception that cannot be unpickled here
                    raise WorkerError(f"{self.describe(rank_of[future])} failed: {error}") from None
                except RayActorError as error:
                    raise WorkerError(
                        f"{self.describe(rank_of[future], process=True)} died ({type(error).__name__})"
                        f"{self._node_gone(rank_of[future])}; the run stops here, the last checkpoint is intact: "
                        "fix the cause and run again to resume"
                    ) from error
            if pending and timeout_s > 0:
                self._check_liveness(sorted(rank_of[future] for future in pending), timeout_s, waiting_since)
        return ray.get(futures)

    def _node_gone(self, rank: int) -> str:
        """``: its node ... is gone`` when the Ray node of ``rank`` is no longer alive (a lost machine),
        else nothing."""
        import ray

        if rank >= len(self.nodes):
            return ""
        try:
            alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        except Exception:  # the cluster itself is unreachable: say nothing more than Ray did
            return ""
        node = self.nodes[rank]
        if node in alive:
            return ""
        return f": its node {self.processes[rank][1]} (Ray node {node[:8]}) is gone from the cluster"

    def _check_liveness(self, ranks: list[int], timeout_s: float, waiting_since: float) -> None:
        """Ask each rank in ``ranks`` whether it is alive (at most every ``PING_INTERVAL_S``). A rank
        silent (a question outstanding, no answer since the last one or since the wait began) for half
        of ``timeout_s`` is named in a warning on stderr; for all of it, the wait raises."""
        import ray

        now = time.monotonic()
        outstanding = [self._pings[rank] for rank in ranks if rank in self._pings]
        answered = (
            set(ray.wait(outstanding, num_returns=len(outstanding), timeout=0)[0]) if outstanding else set()
        )
        interval = min(PING_INTERVAL_S, timeout_s / 4)
        for rank in ranks:
            heard = max(self._heard.get(rank, waiting_since), waiting_since)
            if rank in self._pings and self._pings[rank] in answered:  # a dead rank's failed answer too:
                del self._pings[rank]  # its call reports the death
                self._heard[rank] = heard = now
                if rank in self._warned:
                    self._warned.discard(rank)
                    print(f"verl-core: {self.describe(rank)} answers again", file=sys.stderr, flush=True)
            silent = now - heard
            limit = f"trainer.worker_timeout_s={self.liveness_timeout_s:g}"
            if timeout_s != self.liveness_timeout_s:
                limit = f"{timeout_s:g} s while it sets up"
            if rank in self._pings and silent >= timeout_s:
                raise WorkerError(
                    f"{self.describe(rank)} has not answered for {silent:.0f} s ({limit}): its process is "
                    "stopped or hung (a SIGSTOP or Ctrl-Z, a debugger, swapping, native code holding Python's "
                    "lock); the run stops here, the last checkpoint is intact. If the rank is only slow "
                    "to answer, raise trainer.worker_timeout_s (0 waits for ever)"
                )
            if rank in self._pings and silent >= timeout_s / 2 and rank not in self._warned:
                self._warned.add(rank)
                print(
                    f"verl-core: warning: {self.describe(rank)} has not answered for {silent:.0f} s (stopped? "
                    f"hung?); the run stops if it has not answered after {timeout_s:g} s ({limit})",
                    file=sys.stderr,
                    flush=True,
                )
            if rank not in self._pings and now - self._last_ping.get(rank, -interval) >= interval:
                self._pings[rank] = self.actors[rank].alive.options(concurrency_group=LIVENESS_GROUP).remote()
                self._last_ping[rank] = now
