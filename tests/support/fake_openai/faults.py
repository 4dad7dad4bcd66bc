"""Requests recorded, and the faults planned per kind (probabilistic or queued)."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.support.fake_openai.replies import section_lines
from tests.support.fake_openai.wire import (
    CONTEXT_FAULTS,
    END_NEW_TURNS_MARKER,
    FAULT_NAMES,
    KINDS,
    NEW_TURNS_MARKER,
    NO_FAULT,
    request_texts,
)

# --------------------------------------------------------------------------------------------
# Recording and fault plans
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it. Also readable as a mapping: ``record["body"]``."""

    kind: str  # "chat" | "summarize"
    path: str
    body: dict[str, Any]
    headers: dict[str, str]  # header names lower-cased
    received_at: float  # time.monotonic()
    fault: str | None  # injected fault name, "unauthorized" for a failed auth check, or None
    number: int  # 1-based position among requests of the same kind (the "#n" in chat replies)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    @property
    def text(self) -> str:
        """All the request's text joined, for ``"..." in record.text`` assertions."""
        return "\n".join(request_texts(self.body))


@dataclass
class FaultConfig:
    rate: float
    faults: list[str]
    rng: random.Random


@dataclass
class FaultPlan:
    """Which fault (if any) the next request of a kind gets. Queued faults win over random ones,
    and kind-specific settings win over "any"."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    queues: dict[str, deque[str]] = field(default_factory=lambda: {k: deque() for k in KINDS})
    configs: dict[str, FaultConfig] = field(default_factory=dict)
    # Summarize requests holding any of these strings: refused by the content filter, always.
    refused_markers: list[str] = field(default_factory=list)
    # Summarize requests holding any of these strings: over the model's window, always, answered
    # with ``too_large_fault`` (OpenAI's or llama.cpp's error).
    too_large_markers: list[str] = field(default_factory=list)
    too_large_fault: str = "context_length_exceeded"

    def set(self, kind: str, rate: float, faults: Iterable[str], seed: int | None) -> None:
        names = validate_faults(kind, faults)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be within [0, 1], got {rate}")
        with self.lock:
            self.configs[kind] = FaultConfig(rate, names, random.Random(seed))

    def queue(self, kind: str, faults: Iterable[str]) -> None:
        names = validate_faults(kind, faults)
        with self.lock:
            self.queues[kind].extend(names)

    def clear(self, kind: str | None = None) -> None:
        with self.lock:
            for key in KINDS if kind is None else (kind,):
                self.queues[key].clear()
                self.configs.pop(key, None)
            if kind in (None, "summarize", "any"):
                self.refused_markers.clear()
                self.too_large_markers.clear()

    def refuse(self, markers: Iterable[str]) -> None:
        with self.lock:
            self.refused_markers.extend(markers)

    def too_large(self, markers: Iterable[str], fault: str) -> None:
        if fault not in CONTEXT_FAULTS:
            raise ValueError(f"fault must be one of {CONTEXT_FAULTS}, got {fault!r}")
        with self.lock:
            self.too_large_markers.extend(markers)
            self.too_large_fault = fault

    def draw(self, kind: str, body: dict[str, Any] | None = None) -> str | None:
        # Before the queues: a marked request consumes no queued fault.
        if kind == "summarize" and body is not None:
            if self._holds(body, self.refused_markers):
                return "content_filter"
            if self._holds(body, self.too_large_markers, new_turns_only=True):
                return self.too_large_fault
        fault = self._draw(kind)
        return None if fault == NO_FAULT else fault

    def _holds(self, body: dict[str, Any], found: list[str], new_turns_only: bool = False) -> bool:
        with self.lock:
            markers = list(found)
        texts = request_texts(body)
        if new_turns_only:
            # The large message itself, not a summary that quotes it: folded, it is small.
            lines = [line for text in texts for line in text.splitlines()]
            texts = section_lines(lines, NEW_TURNS_MARKER, END_NEW_TURNS_MARKER)
        return any(marker in text for text in texts for marker in markers)

    def _draw(self, kind: str) -> str | None:
        with self.lock:
            for key in (kind, "any"):
                if self.queues[key]:
                    return self.queues[key].popleft()
            for key in (kind, "any"):
                config = self.configs.get(key)
                if config and config.faults and config.rng.random() < config.rate:
                    return config.rng.choice(config.faults)
        return None


def validate_faults(kind: str, faults: Iterable[str]) -> list[str]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    names = [str(name) for name in faults]
    unknown = [name for name in names if name not in (*FAULT_NAMES, NO_FAULT)]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {FAULT_NAMES} and {NO_FAULT!r}")
    return names


class Recorder:
    """Thread-safe request log and counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._records: list[RecordedRequest] = []
            self._numbers = {"chat": 0, "summarize": 0}
            self._faults: dict[str, int] = {}
            self._tool_calls = 0
            # Requests still being answered are not forgotten: in_flight stays accurate.
            self._max_in_flight = self._in_flight

    def record(
        self, kind: str, path: str, body: dict[str, Any], headers: dict[str, str], fault: str | None
    ) -> RecordedRequest:
        with self._lock:
            self._numbers[kind] += 1
            if fault:
                self._faults[fault] = self._faults.get(fault, 0) + 1
            record = RecordedRequest(
                kind, path, body, headers, time.monotonic(), fault, self._numbers[kind]
            )
            self._records.append(record)
            return record

    def next_tool_call_id(self) -> str:
        with self._lock:
            self._tool_calls += 1
            return f"call_{self._tool_calls}"

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def records(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._records)

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {
                "total": len(self._records),
                "chat": self._numbers["chat"],
                "summarize": self._numbers["summarize"],
                "faults": dict(self._faults),
                "in_flight": self._in_flight,
                "max_in_flight": self._max_in_flight,
            }
