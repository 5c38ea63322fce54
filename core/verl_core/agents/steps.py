"""Environments' steps, many conversations at once: each ``step`` (synchronous user code) runs in a
daemon thread of its own, at most ``rollout.agent.environment_threads`` at a time, and one that does
not return within ``rollout.agent.step_timeout_s`` ends the run with an error naming its conversation.

Daemon threads, not a thread pool (``asyncio.to_thread``'s included): a pool's worker stuck in a step
that never returns would hold the process's exit, as a tool call would (``ToolEnvironment`` runs each
call in a thread of its own for the same reason). The built-in ``tools`` environment is not timed
here: each of its calls is, by ``rollout.agent.tool_timeout_s``, and answered with an error message
when it runs late, so that nothing the model writes ends the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from verl_core.agents.environment import StepResult, ToolEnvironment
from verl_core.errors import AgentError

T = TypeVar("T")

#: The config keys of the bounds, for messages.
THREADS_KEY = "rollout.agent.environment_threads"
STEP_TIMEOUT_KEY = "rollout.agent.step_timeout_s"


class EnvironmentSteps:
    """Runs environments' ``step`` calls in daemon threads: at most ``threads`` at once, each within
    ``timeout_s`` seconds (``ToolEnvironment``'s excepted, see the module docstring). ``where`` names
    the step's conversation in errors; an environment that raises, returns something else than a
    ``StepResult`` or runs late is an ``AgentError`` naming it (the run's other steps are left to end
    in their threads)."""

    def __init__(self, threads: int, timeout_s: float):
        self.threads = threads
        self.timeout_s = timeout_s
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def step(self, environment: Any, model_text: str, where: str) -> StepResult:
        """``environment.step(model_text)`` in its own thread, once a slot is free."""
        async with self._free_slots():
            step = _Step(environment, model_text, asyncio.get_running_loop())
            step.start()
            timeout = None if isinstance(environment, ToolEnvironment) else self.timeout_s
            try:
                await asyncio.wait_for(step.finished, timeout)
            except asyncio.TimeoutError:
                raise AgentError(
                    f"{type(environment).__name__}.step did not return within {STEP_TIMEOUT_KEY}="
                    f"{self.timeout_s:g} s, at {where}: make step return (a timeout of its own around what "
                    "it waits for), or raise the key"
                ) from None
        if step.error is not None:
            raise AgentError(
                f"{type(environment).__name__}.step raised {type(step.error).__name__}: {step.error}, at "
                f"{where} (the cause is below)"
            ) from step.error
        if not isinstance(step.result, StepResult):
            raise AgentError(
                f"{type(environment).__name__}.step returned {type(step.result).__name__}, not a "
                f"verl_core.agents.StepResult(observation, done, reward), at {where}"
            )
        return step.result

    def step_all(self, steps: Sequence[tuple[Any, str, str]]) -> list[StepResult]:
        """``step`` of each ``(environment, model_text, where)`` at once, from synchronous code; the
        results in order."""
        return run_blocking(gather_all([self.step(*step) for step in steps]))

    def _free_slots(self) -> asyncio.Semaphore:
        # An asyncio semaphore belongs to one event loop: each loop that steps gets its own.
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self.threads), loop
        return self._slots


class _Step(threading.Thread):
    """One ``step`` call in a daemon thread: its result or whatever it raised (any ``BaseException``:
    a ``sys.exit()`` in an environment is its failure, reported in the driver), and ``finished``, a
    future of ``loop`` resolved when it returns."""

    def __init__(self, environment: Any, model_text: str, loop: asyncio.AbstractEventLoop):
        super().__init__(name=f"verl-core {type(environment).__name__}.step", daemon=True)
        self.environment, self.model_text, self.loop = environment, model_text, loop
        self.finished: asyncio.Future[None] = loop.create_future()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.environment.step(self.model_text)
        except BaseException as error:  # noqa: BLE001 - raised in the driver, naming the conversation
            self.error = error
        finally:
            try:
                self.loop.call_soon_threadsafe(self._resolve)
            except RuntimeError:  # the loop is closed: nothing waits for this step any more
                pass

    def _resolve(self) -> None:
        if not self.finished.done():  # cancelled by a timeout, or by the end of the run
            self.finished.set_result(None)


async def gather_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Await all at once; the results in order. On the first failure the others are cancelled (no
    request stays in flight for a run that has failed) before it is raised."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def run_blocking(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end from synchronous code, in an event loop of its own."""

    async def main() -> T:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    # Called from a running event loop (a notebook's), where asyncio.run refuses: a thread has none.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verl-core steps") as pool:
        return pool.submit(asyncio.run, main()).result()
