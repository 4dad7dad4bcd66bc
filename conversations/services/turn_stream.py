"""A streamed turn's event channel: the turn runs on a thread of its own and hands its events
(deltas, then done or failed) to whoever serves the response, a thread or an event loop.

The turn runs on its own thread, not in the response generator, because the server closes the
generator when the client disconnects (WSGI: close() -> GeneratorExit at the pending yield; ASGI:
the task is cancelled). A turn the server accepted must still complete and be stored
(docs/design.md, the turn, step 6), so nothing the turn does may depend on the client still
reading."""

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from conversations.services.turn_store import TurnRequest, TurnResult


@dataclass(frozen=True)
class TurnDelta:
    content: str


@dataclass(frozen=True)
class TurnDone:
    result: TurnResult


@dataclass(frozen=True)
class TurnFailed:
    """The turn failed and stored nothing; ``error`` is a ModelError, ContextOverBound, or
    anything unexpected (already logged)."""

    error: Exception


TurnEvent = TurnDelta | TurnDone | TurnFailed


class TurnEvents:
    """The events of one streamed turn, from the turn's thread to its reader.

    Unbounded on purpose: the turn's thread must never block on a slow or vanished reader, so a
    client that stops reading cannot stall the model stream or keep the turn slot. A reply is a
    few thousand deltas at most. Readable from a thread (``get``) or an event loop (``aget``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[TurnEvent] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._wakeups: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def put(self, event: TurnEvent) -> None:
        self._queue.put(event)
        with self._lock:
            wakeups = list(self._wakeups)
        for loop, ready in wakeups:
            with contextlib.suppress(RuntimeError):  # that loop is closed: its reader is gone
                loop.call_soon_threadsafe(ready.set)

    def put_delta(self, content: str) -> None:
        self.put(TurnDelta(content))

    def get(self, timeout: float) -> TurnEvent | None:
        """The next event, or None when none came within ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    async def aget(self, timeout: float) -> TurnEvent | None:
        """``get`` for an event loop, without holding a thread while waiting."""
        ready = asyncio.Event()
        entry = (asyncio.get_running_loop(), ready)
        with self._lock:
            self._wakeups.append(entry)
        try:
            # Registered before looking: an event put after this look also sets `ready`.
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), timeout)
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            return None
        finally:
            with self._lock:
                self._wakeups.remove(entry)

    def iter_events(self, heartbeat: float) -> Iterator[TurnEvent | None]:
        """Events until the last one (done or failed); None every ``heartbeat`` seconds without
        one, so the reader can keep the connection alive (and notice a vanished client)."""
        while True:
            event = self.get(heartbeat)
            yield event
            if isinstance(event, TurnDone | TurnFailed):
                return

    async def aiter_events(self, heartbeat: float) -> AsyncIterator[TurnEvent | None]:
        while True:
            event = await self.aget(heartbeat)
            yield event
            if isinstance(event, TurnDone | TurnFailed):
                return


@dataclass(frozen=True)
class StreamedTurn:
    """A turn accepted for streaming: its slot is claimed and its thread is running."""

    request: TurnRequest
    events: TurnEvents
    thread: threading.Thread


def start_turn_thread(name: str, run: Callable[..., object], *args: object) -> threading.Thread:
    """``run(*args)`` on a thread of its own, started."""
    thread = threading.Thread(
        # The copied context carries the request id into the turn's log lines.
        target=contextvars.copy_context().run,
        args=(run, *args),
        name=name,
        # Not a daemon: a graceful shutdown waits for accepted turns to be stored.
        daemon=False,
    )
    thread.start()
    return thread
