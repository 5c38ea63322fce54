"""Worker groups: one process per engine rank, called together, results materialised.

``WorkerGroup`` is what the roles' typed front ends (``verl_core.workers.roles``) call: ``call`` runs
one method of the rank's worker on every rank with the same arguments, ``call_each`` with one set of
arguments per rank (the method by reference, ``ActorWorker.update``: readers and IDEs can follow it);
both return every rank's result, already collected, so nothing the trainer holds is a future.
``InProcessWorkerGroup`` runs a single rank in this process (no Ray, no ``torch.distributed``): for
embedding core in another RL stack and for fast tests. ``verl_core.workers.ray_group`` provides the
Ray implementation, one actor per rank forming a ``torch.distributed`` group.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from verl_core.errors import VerlCoreError


class WorkerError(VerlCoreError):
    """A rank of a worker group failed or died; the message names the role and the rank."""


class WorkerGroup(abc.ABC):
    """The ranks of one role (``actor``, ``critic``), called in lockstep."""

    role: str
    world_size: int

    @abc.abstractmethod
    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``method(worker, *args, **kwargs)`` on every rank; every rank's result, in rank order."""

    @abc.abstractmethod
    def call_each(self, method: Callable[..., Any], args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``method(worker, *args_per_rank[rank])`` on every rank; every rank's result, in rank order."""

    async def call_async(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(worker, *args)`` on rank 0 (a group of one rank: a rollout replica), awaited without
        blocking the event loop, while other calls of the group may run (the rank serves several at
        once where its group allows it)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve calls asynchronously")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the ranks."""


class InProcessWorkerGroup(WorkerGroup):
    """One rank, in this process: ``make_worker()`` builds the worker here."""

    world_size = 1

    def __init__(self, role: str, make_worker: Callable[[], Any]):
        self.role = role
        self.worker = make_worker()

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [method(self.worker, *args, **kwargs)]

    def call_each(self, method: Callable[..., Any], args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        (args,) = args_per_rank
        return [method(self.worker, *args)]

    async def call_async(self, method: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(method, self.worker, *args)

    def shutdown(self) -> None:
        self.worker = None
