"""One asyncio event loop in a daemon thread, for the adapters whose clients are asynchronous (MCP,
OpenEnv): the environments' ``step`` runs in the agent loop's threads, and each waits here for its
coroutine, for at most a given time."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """An event loop running in a daemon thread of its own (``name``), until ``stop()``."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coroutine`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """``coroutine``'s result; after ``timeout_s`` it is cancelled and ``TimeoutError`` raised."""
        future = self.submit(coroutine)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout_s:g} s") from None

    def stop(self) -> None:
        """Stop the loop and wait for its thread (what still runs on it is abandoned)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
