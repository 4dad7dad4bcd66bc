"""A held chat lock kept alive by its holder (docs/design.md, the fold): the lock's TTL is short, so
a holder that dies (kill -9, out of memory, a node drained) frees its chat within one TTL.

The holder renews at its natural points (``renew``, before each summarizer call) and, because
one summarizer call can outlast the TTL, a daemon thread renews every third of the TTL in
between. The thread stops when the holder stops it or at ``until`` (the holder's hard time
limit), whichever comes first: it dies with its process, and never keeps a stuck fold's lock
past the time that fold could still be alive. A renewal that finds the lock gone marks the
lease lost, and the holder starts no further summarizer call; the fenced commit keeps the data
right whatever the lock does."""

import logging
import threading
import time
from types import TracebackType
from typing import Protocol

import redis

from memory_worker.coordination.locks import ChatLock, Release

log = logging.getLogger("chatmem.fold")


class Renewable(Protocol):
    """What a fold keeps while it works (a chat's lock, a turn's slot), renewed before each
    summarizer chunk: ``renew`` says whether it is still the fold's."""

    def renew(self) -> bool: ...


class Lease:
    def __init__(self, lock: ChatLock, chat_id: int, token: str, *, until: float) -> None:
        """``until``: ``time.monotonic()`` after which nothing renews the lock any more."""
        self._lock = lock
        self._chat_id = chat_id
        self._token = token
        self._until = until
        self._interval = lock.ttl_seconds / 3
        self._stopped = threading.Event()
        self._lost = threading.Event()
        # Held by a renewal and by the holder's release: no renewal falls between the release
        # and the lease learning of it (a released lock is not a lost one).
        self._guard = threading.Lock()
        self._released = False
        self._thread = threading.Thread(
            target=self._beat, name=f"chatmem-lease-{chat_id}", daemon=True
        )

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def renewing(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> "Lease":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        # A renewal in flight ends within the Redis client's socket timeout; not waited for
        # longer (it only extends a lock that the caller releases next, or that expires).
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def release_or_rerun(self) -> Release:
        """The holder's ``release_or_rerun`` of its lock, inside the lease: released, the lease
        renews no more (a renewal would find the lock gone and call it lost)."""
        with self._guard:
            release = self._lock.release_or_rerun(self._chat_id, self._token)
            self._released = release is not Release.RERUN
        return release

    def renew(self) -> bool:
        """Renew now; whether the lock is still held. Unknown (the lock store unreachable)
        counts as held: the lock only saves work, and the fence decides."""
        if self._lost.is_set():
            return False
        if time.monotonic() >= self._until:
            return True  # past the holder's time limit: left to expire, not renewed
        with self._guard:
            if self._released:
                return False  # its holder released it: nothing was lost
            return self._renew()

    def _renew(self) -> bool:
        try:
            held = self._lock.renew(self._chat_id, self._token)
        except redis.RedisError:
            log.warning(
                "could not renew the chat's lock; trying again",
                extra={"event": "lock_renewal_failed", "chat_id": self._chat_id},
            )
            return True
        if not held:
            self._lost.set()
            if self._stopped.is_set():
                return held  # a renewal that outlived its run's release: nothing was lost
            log.warning(
                "the chat's lock was lost during its run; no further summarizer call",
                extra={"event": "lock_lost", "chat_id": self._chat_id},
            )
        return held

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval):
            if time.monotonic() >= self._until or not self.renew():
                return

    def __enter__(self) -> "Lease":
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
