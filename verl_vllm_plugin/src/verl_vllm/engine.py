"""The rollout's vLLM engine, in the calling process: built without disturbing the caller (the training
engine colocated with it), and stepped by whichever caller needs progress, one at a time.

vLLM's ``AsyncLLM`` runs its engine core in another process; a colocated rollout keeps it in this one
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its worker live in the actor's process,
which loads the trained weights into the model in place). ``EngineDriver`` drives that ``LLMEngine``
through ``add_request`` / ``step`` / ``abort_request``: every request in flight (a batch call's rows,
``generate_request`` s from any event loop) is decoded together, each engine step's outputs routed to
the request they belong to. ``LLMEngine`` is not thread-safe: a lock makes every use of it (a step,
an added or aborted request, a weight load) one at a time.

vLLM also changes process-wide state while it builds an engine in process: it seeds the global RNGs,
replaces ``torch.set_num_threads`` with a function that does nothing (CPU), edits ``os.environ``
(``LD_PRELOAD``, thread settings for its own subprocesses), ``gc.freeze()`` s the heap, takes an
existing default process group as its own world and destroys the default group when it shuts down.
``caller_state_kept`` puts the first four back after it is built, ``rng_kept`` keeps the caller's RNG
through every step (vLLM's CPU sampler draws from the global generator), and ``shut_down`` keeps a
default group that was the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import random
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from verl_core.errors import RolloutError

#: Environment the engine is built under (and the caller's restored after): the engine core and its
#: worker in this process, and no model hub (the model is a local folder).
ENGINE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
#: vLLM's own way of sizing a CPU engine's KV cache (GiB); it would override ``kv_cache_megabytes``.
LEGACY_KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


#: The vLLM modules the rollout uses, imported before anything else of vLLM (``import_vllm``).
VLLM_MODULES = (
    "vllm.platforms",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.inputs",
    "vllm.sampling_params",
    "vllm.v1.sample.sampler",
    "vllm.model_executor.model_loader.reload",
)


def import_vllm(modules: Sequence[str] = VLLM_MODULES) -> None:
    """Import ``modules`` in a thread of their own. A vLLM module keeps the traceback of an import it
    caught (``vllm.multimodal.media.audio``: torchcodec's ``ModuleNotFoundError``), and with it every
    frame that was importing it, for good: imported from a rollout's own call, those frames would keep
    the rollout, and its engine, alive. A thread's frames reach no caller's."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return
    failed: list[BaseException] = []

    def load() -> None:
        try:
            for name in missing:
                importlib.import_module(name)
        except BaseException as error:  # raised again in the caller's thread
            failed.append(error)

    thread = threading.Thread(target=load, name="verl-vllm-import")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def process_rank() -> int:
    """This process's rank in the caller's process group (0 without one): errors name it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# -- the caller's state ---------------------------------------------------------------------------


@contextlib.contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """The caller's torch RNG (the CPU's and ``device`` 's) is as it was once the block ends."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def caller_state_kept(device: torch.device, environment: dict[str, str]) -> Iterator[None]:
    """Run the block (an engine being built) under ``environment`` added to ``os.environ``, then give the
    caller back its RNGs (torch, ``random``, numpy), its ``os.environ``, ``torch.set_num_threads`` and
    an unfrozen heap (if it was)."""
    saved_environment = dict(os.environ)
    saved_random = random.getstate()
    numpy = sys.modules.get("numpy")
    saved_numpy = numpy.random.get_state() if numpy is not None else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    frozen = gc.get_freeze_count()
    os.environ.update(environment)
    try:
        with rng_kept(device):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
        random.setstate(saved_random)
        if saved_numpy is not None:
            numpy.random.set_state(saved_numpy)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if not frozen and gc.get_freeze_count():
            gc.unfreeze()


def build_engine(engine_args: Any) -> Any:
    """An in-process ``LLMEngine`` from ``engine_args`` (a ``vllm.EngineArgs``); run it under
    ``caller_state_kept(device, ENGINE_ENVIRONMENT)``."""
    os.environ.pop(LEGACY_KV_CACHE_VARIABLE, None)
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args)


@contextlib.contextmanager
def default_group_kept() -> Iterator[None]:
    """vLLM's shutdown destroys its own process groups and then the default one; within the block it
    leaves the default group alone (one the caller made, which vLLM took as its world)."""
    from vllm.distributed import parallel_state

    destroy = parallel_state.destroy_distributed_environment

    def destroy_vllm_groups() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_groups
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = destroy


def shut_down(engine: Any, caller_group: bool) -> None:
    """Shut ``engine`` down (its worker, its KV cache, vLLM's process groups); the default process group
    survives when it was the caller's (``caller_group``)."""
    client = engine.engine_core
    with default_group_kept() if caller_group else contextlib.nullcontext():
        client.shutdown()
    gc.collect()


# -- requests in flight -----------------------------------------------------------------------------


@attrs.define(eq=False)
class Flight:
    """One request in the engine: the tokens and log-probs it has generated so far, and how it ended.
    An asynchronous caller waits on ``future`` (resolved in its own event loop)."""

    request_id: str
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    tokens: list[int] = attrs.field(factory=list)
    log_probs: list[float] = attrs.field(factory=list)
    #: Prompt tokens the engine found in its prefix cache (prefilled by an earlier request).
    cached_tokens: int | None = None
    done: bool = False
    aborted: bool = False
    error: BaseException | None = None

    def receive(self, output: Any) -> None:
        """One engine step's ``RequestOutput`` (a delta): its new tokens and their log-probs."""
        if self.cached_tokens is None:
            self.cached_tokens = output.num_cached_tokens
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        entries = completion.logprobs
        if tokens and (entries is None or len(entries) != len(tokens)):
            raise RolloutError(
                f"request {self.request_id!r}: vLLM returned {len(tokens)} token(s) with "
                f"{0 if entries is None else len(entries)} log-prob entries"
            )
        self.tokens += tokens
        self.log_probs += [entry[token].logprob for token, entry in zip(tokens, entries or (), strict=True)]
        if output.finished:
            self.finish()

    def finish(self, aborted: bool = False, error: BaseException | None = None) -> None:
        self.done, self.aborted, self.error = True, aborted, error
        if self.future is not None:
            with contextlib.suppress(RuntimeError):  # its event loop closed: nobody waits any more
                self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.future.done():  # a cancelled waiter
            self.future.set_result(None)


class EngineDriver:
    """Steps one ``LLMEngine`` for everyone who has requests in it (see the module docstring)."""

    def __init__(self, engine: Any, device: torch.device, rank: int):
        self.engine = engine
        self.device = device
        self.rank = rank
        #: The threads the engine was built with: vLLM's CPU attention plans each step for the threads
        #: of the thread that steps it, and a step from a thread with another count fails.
        self.threads = torch.get_num_threads()
        #: Held for every use of the engine.
        self.lock = threading.RLock()
        self.flights: dict[str, Flight] = {}
        #: Set once a step raised: the engine is dead, every later use raises it again.
        self.failure: RolloutError | None = None
        self.last_request: str | None = None
        #: Per event loop, the task stepping the engine while that loop's requests are in flight.
        self._steppers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}

    def alive(self) -> None:
        if self.failure is not None:
            raise RolloutError(str(self.failure)) from self.failure.__cause__

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: Any,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Flight:
        """Add one request; with ``loop``, its flight resolves a future in that event loop."""
        from vllm.inputs import TokensPrompt

        with self.lock:
            self.alive()
            if request_id in self.flights:
                raise RolloutError(
                    f"generate_request: request_id {request_id!r} is already in flight: request ids must be "
                    "unique among the requests in flight (leave it out for a fresh one)"
                )
            flight = Flight(request_id, loop, loop.create_future() if loop is not None else None)
            self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
            self.flights[request_id] = flight
            self.last_request = request_id
            return flight

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests now (those not in flight are ignored): each keeps what it generated."""
        with self.lock:
            flights = [
                self.flights.pop(request_id) for request_id in request_ids if request_id in self.flights
            ]
            if flights and self.failure is None:
                self.engine.abort_request([flight.request_id for flight in flights])
            for flight in flights:
                flight.finish(aborted=True)

    def abort_all(self) -> None:
        self.abort(list(self.flights))

    def step(self) -> None:
        """One engine step, its outputs routed to their flights. A step that raises kills the engine:
        every flight ends with the ``RolloutError`` (naming this rank and the last request sent), which
        is raised here and by every later use."""
        with self.lock:
            self.alive()
            if not self.flights:
                return
            threads = torch.get_num_threads()
            try:
                if threads != self.threads:
                    torch.set_num_threads(self.threads)
                with rng_kept(self.device):
                    outputs = self.engine.step()
            except Exception as error:
                self.failure = RolloutError(
                    f"the vLLM engine on rank {self.rank} died while generating (the last request sent: "
                    f"{self.last_request!r}; {len(self.flights)} in flight): {type(error).__name__}: {error}. "
                    "The rollout cannot generate any more: restart the run (from its last checkpoint)"
                )
                self.failure.__cause__ = error
                flights, self.flights = list(self.flights.values()), {}
                for flight in flights:
                    flight.finish(error=self.failure)
                raise self.failure from error
            finally:
                if threads != self.threads:
                    torch.set_num_threads(threads)
            for output in outputs:
                flight = self.flights.get(output.request_id)
                if flight is None:  # aborted meanwhile
                    continue
                flight.receive(output)
                if flight.done:
                    del self.flights[output.request_id]

    def run(self, flights: Sequence[Flight]) -> None:
        """Step until every one of ``flights`` is done (in this thread: a batch call)."""
        while not all(flight.done for flight in flights):
            self.step()
        for flight in flights:
            if flight.error is not None:
                raise flight.error

    async def wait(self, flight: Flight) -> None:
        """Until ``flight`` is done, in its event loop: a task of that loop steps the engine in a worker
        thread while any of the loop's requests are in flight (other callers may step it meanwhile)."""
        loop = asyncio.get_running_loop()
        stepper = self._steppers.get(loop)
        if stepper is None or stepper.done():
            self._steppers[loop] = loop.create_task(self._step_while_waiting(loop))
        await flight.future
        if flight.error is not None:
            raise flight.error

    async def _step_while_waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while any(flight.loop is loop for flight in list(self.flights.values())):
                try:
                    await asyncio.to_thread(self.step)
                except RolloutError:  # the engine died: its flights carry the error
                    return
        finally:
            if self._steppers.get(loop) is asyncio.current_task():
                del self._steppers[loop]
