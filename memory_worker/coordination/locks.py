"""One consolidation per chat at a time, and no lost trigger (promise 3; docs/design.md, the fold):
a trigger during a run marks the chat pending, and the run re-judges once more.

"Acquire, or else mark pending" and "release, or else clear pending and keep the lock for one
more run" are each a single atomic step (a Lua script in Redis, a mutex in-process): a trigger
that lands between a run's last check and its release can never be lost, which is how
check-then-release designs drop reruns.

The lock's TTL is short and its holder renews it while it works (``renew``, a compare-and-set
on the token; memory_worker.coordination.lease), so a dead holder's lock lapses within one TTL.

The lock only saves work. Correctness rests on the fold's conditional UPDATE.
"""

import threading
import time
from enum import Enum
from typing import Protocol

import redis


class Release(Enum):
    RELEASED = "released"
    RERUN = "rerun"  # a trigger arrived during the run: we still hold the lock, run once more
    LOST = "lost"  # the TTL expired and someone else may hold it now


class ChatLock(Protocol):
    ttl_seconds: float

    def acquire_or_mark_pending(
        self, chat_id: int, token: str, *, manual: bool = False
    ) -> bool: ...
    def try_acquire(self, chat_id: int, token: str) -> bool: ...
    def release_or_rerun(self, chat_id: int, token: str) -> Release: ...
    def release(self, chat_id: int, token: str) -> bool: ...
    def renew(self, chat_id: int, token: str) -> bool: ...
    def mark_pending(self, chat_id: int) -> None: ...
    def is_pending(self, chat_id: int) -> bool: ...
    def pending_chats(self) -> list[int]: ...
    def clear_pending(self, chat_id: int) -> None: ...
    def take_pending(self, chat_id: int, *, only_if_free: bool = False) -> bool: ...
    def mark_manual(self, chat_id: int) -> None: ...
    def take_manual(self, chat_id: int) -> bool: ...
    def is_held(self, chat_id: int) -> bool: ...


# A manual request that met a held lock: the holder's rerun for the pending mark it also left
# folds as a manual one (decide_manual), not by the policy's own triggers.
MANUAL_PENDING_SET = "chatmem:pending:manual"


PENDING_SET = "chatmem:pending"

# KEYS[1] lock, KEYS[2] pending set, KEYS[3] manual pending set; ARGV: token, ttl ms, chat
# id, "1" for a manual request (its mark also says so, in the same step)
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- this run reads the state after acquiring, so it covers every earlier trigger
  redis.call('SREM', KEYS[2], ARGV[3])
  return 1
end
redis.call('SADD', KEYS[2], ARGV[3])
if ARGV[4] == '1' then
  redis.call('SADD', KEYS[3], ARGV[3])
end
return 0
"""

# 2 = rerun (pending cleared, lock kept and refreshed), 1 = released,
# 0 = not ours (expired, or taken by another run)
_RELEASE_OR_RERUN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if redis.call('SREM', KEYS[2], ARGV[3]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 2
end
redis.call('DEL', KEYS[1])
return 1
"""

# Test-and-clear of the pending mark (1 = it was set), only while no run holds the lock when
# ARGV[2] is "1": that run serves the mark itself when it releases.
_TAKE_PENDING = """
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
return redis.call('SREM', KEYS[2], ARGV[1])
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# A full TTL from now, only while the token is still ours: an expired lock is never revived
# (another run may have taken it since), and the holder learns that it lost it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisChatLock:
    def __init__(self, client: "redis.Redis", ttl_seconds: float) -> None:
        self._client = client
        self.ttl_seconds = ttl_seconds
        self._ttl_ms = int(ttl_seconds * 1000)
        self._acquire = client.register_script(_ACQUIRE)
        self._release_or_rerun = client.register_script(_RELEASE_OR_RERUN)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._take_pending = client.register_script(_TAKE_PENDING)

    @staticmethod
    def key(chat_id: int) -> str:
        return f"chatmem:lock:chat:{chat_id}"

    def acquire_or_mark_pending(self, chat_id: int, token: str, *, manual: bool = False) -> bool:
        keys = [self.key(chat_id), PENDING_SET, MANUAL_PENDING_SET]
        args: list[str | int] = [token, self._ttl_ms, chat_id, "1" if manual else "0"]
        return bool(self._acquire(keys=keys, args=args))

    def try_acquire(self, chat_id: int, token: str) -> bool:
        """Take the lock if free, leaving the pending set alone: for a holder that does not
        re-judge the chat (a turn's own fold), which must neither serve nor add a rerun."""
        return bool(self._client.set(self.key(chat_id), token, nx=True, px=self._ttl_ms))

    def release_or_rerun(self, chat_id: int, token: str) -> Release:
        keys = [self.key(chat_id), PENDING_SET]
        result = int(self._release_or_rerun(keys=keys, args=[token, self._ttl_ms, chat_id]))
        return {2: Release.RERUN, 1: Release.RELEASED}.get(result, Release.LOST)

    def release(self, chat_id: int, token: str) -> bool:
        return bool(self._release(keys=[self.key(chat_id)], args=[token]))

    def renew(self, chat_id: int, token: str) -> bool:
        """Whether the lock is still ours (then it lives one more TTL from now)."""
        return bool(self._renew(keys=[self.key(chat_id)], args=[token, self._ttl_ms]))

    def mark_pending(self, chat_id: int) -> None:
        self._client.sadd(PENDING_SET, str(chat_id))

    def is_pending(self, chat_id: int) -> bool:
        return bool(self._client.sismember(PENDING_SET, str(chat_id)))

    def pending_chats(self) -> list[int]:
        return sorted(int(member) for member in self._client.smembers(PENDING_SET))

    def clear_pending(self, chat_id: int) -> None:
        self._client.srem(PENDING_SET, str(chat_id))

    def take_pending(self, chat_id: int, *, only_if_free: bool = False) -> bool:
        """Clear the pending mark; whether it was set (then the caller asks for the rerun: the
        one who clears it, so it is asked for once). ``only_if_free``: not while a run holds
        the lock."""
        keys = [self.key(chat_id), PENDING_SET]
        return bool(self._take_pending(keys=keys, args=[chat_id, "1" if only_if_free else "0"]))

    def mark_manual(self, chat_id: int) -> None:
        self._client.sadd(MANUAL_PENDING_SET, str(chat_id))

    def take_manual(self, chat_id: int) -> bool:
        return bool(self._client.srem(MANUAL_PENDING_SET, str(chat_id)))

    def is_held(self, chat_id: int) -> bool:
        return bool(self._client.exists(self.key(chat_id)))

    def holder(self, chat_id: int) -> str | None:
        value = self._client.get(self.key(chat_id))
        return value.decode() if isinstance(value, bytes) else value


class LocalChatLock:
    """The same contract inside one process, for the embedded mode (no Redis)."""

    def __init__(self, ttl_seconds: float) -> None:
        self._mutex = threading.Lock()
        self._holders: dict[int, tuple[str, float]] = {}
        self._pending: set[int] = set()
        self._manual: set[int] = set()
        self.ttl_seconds = ttl_seconds
        self._ttl = ttl_seconds

    def _held_by_other(self, chat_id: int, token: str) -> bool:
        holder = self._holders.get(chat_id)
        return holder is not None and holder[0] != token and holder[1] > time.monotonic()

    def acquire_or_mark_pending(self, chat_id: int, token: str, *, manual: bool = False) -> bool:
        with self._mutex:
            if self._held_by_other(chat_id, token):
                self._pending.add(chat_id)
                if manual:
                    self._manual.add(chat_id)
                return False
            self._holders[chat_id] = (token, time.monotonic() + self._ttl)
            self._pending.discard(chat_id)
            return True

    def try_acquire(self, chat_id: int, token: str) -> bool:
        with self._mutex:
            if self._held_by_other(chat_id, token):
                return False
            self._holders[chat_id] = (token, time.monotonic() + self._ttl)
            return True

    def release_or_rerun(self, chat_id: int, token: str) -> Release:
        with self._mutex:
            holder = self._holders.get(chat_id)
            if holder is None or holder[0] != token:
                return Release.LOST
            if chat_id in self._pending:
                self._pending.discard(chat_id)
                self._holders[chat_id] = (token, time.monotonic() + self._ttl)
                return Release.RERUN
            del self._holders[chat_id]
            return Release.RELEASED

    def release(self, chat_id: int, token: str) -> bool:
        with self._mutex:
            holder = self._holders.get(chat_id)
            if holder is None or holder[0] != token:
                return False
            del self._holders[chat_id]
            return True

    def renew(self, chat_id: int, token: str) -> bool:
        with self._mutex:
            holder = self._holders.get(chat_id)
            if holder is None or holder[0] != token or holder[1] <= time.monotonic():
                return False  # as in Redis: an expired lock is gone, whoever holds it next
            self._holders[chat_id] = (token, time.monotonic() + self._ttl)
            return True

    def mark_pending(self, chat_id: int) -> None:
        with self._mutex:
            self._pending.add(chat_id)

    def is_pending(self, chat_id: int) -> bool:
        with self._mutex:
            return chat_id in self._pending

    def pending_chats(self) -> list[int]:
        with self._mutex:
            return sorted(self._pending)

    def clear_pending(self, chat_id: int) -> None:
        with self._mutex:
            self._pending.discard(chat_id)

    def take_pending(self, chat_id: int, *, only_if_free: bool = False) -> bool:
        with self._mutex:
            if only_if_free and self._held_by_other(chat_id, ""):
                return False
            taken = chat_id in self._pending
            self._pending.discard(chat_id)
            return taken

    def mark_manual(self, chat_id: int) -> None:
        with self._mutex:
            self._manual.add(chat_id)

    def take_manual(self, chat_id: int) -> bool:
        with self._mutex:
            taken = chat_id in self._manual
            self._manual.discard(chat_id)
            return taken

    def is_held(self, chat_id: int) -> bool:
        with self._mutex:
            holder = self._holders.get(chat_id)
            return holder is not None and holder[1] > time.monotonic()
