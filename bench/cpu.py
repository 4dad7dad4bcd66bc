"""Where the machine's CPU went during a benchmark's measured window, per process group (Linux
``/proc``): the figure behind every "a turn costs X ms of CPU in the web processes, PostgreSQL,
the workers..." in docs/benchmarks.md, measured by the benchmark itself instead of by hand.

A group is either a process the benchmark started, with all its descendants (gunicorn and its
workers, a Celery worker and its pool children), or every process of a given command name
(``postgres``, ``redis-server``). CPU time is user + system time from ``/proc/<pid>/stat``;
processes started during the window count from zero, processes that ended during it are lost
(none in a steady run). ``elsewhere`` is the machine's busy time (``/proc/stat``) not in any
group: the kernel's own threads (network softirqs), other processes.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    name: str  # the command name (comm)
    cpu_seconds: float


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def read_processes() -> dict[int, ProcessInfo]:
    """Every process's parent, name and CPU seconds so far (processes that vanish while being
    read are skipped)."""
    ticks = clock_ticks()
    found: dict[int, ProcessInfo] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and ")", so split at the last ")".
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()
        user, system = int(rest[11]), int(rest[12])
        found[int(entry.name)] = ProcessInfo(
            int(entry.name), int(rest[1]), name, (user + system) / ticks
        )
    return found


def busy_seconds() -> float:
    """The machine's CPU seconds spent not idle (all CPUs), from ``/proc/stat``."""
    values = [int(value) for value in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / clock_ticks()


def descendants(roots: Sequence[int], processes: Mapping[int, ProcessInfo]) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in processes.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found, todo = set(), [pid for pid in roots if pid in processes]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


@dataclass
class Groups:
    """``trees``: group name -> root pids (each with its descendants); ``names``: group name ->
    command name (every process of that name). A process in a tree is not counted by name."""

    trees: dict[str, list[int]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    def cpu_seconds(self, processes: Mapping[int, ProcessInfo]) -> dict[str, dict[int, float]]:
        """Per group, the CPU seconds so far of each of its processes."""
        per_group: dict[str, dict[int, float]] = {}
        claimed: set[int] = set()
        for group, roots in self.trees.items():
            pids = descendants(roots, processes) - claimed
            claimed |= pids
            per_group[group] = {pid: processes[pid].cpu_seconds for pid in pids}
        for group, name in self.names.items():
            per_group[group] = {
                pid: info.cpu_seconds
                for pid, info in processes.items()
                if info.name == name and pid not in claimed
            }
        return per_group


def service_groups(web: int, *, workers: Sequence[int] = (), model: int | None = None) -> Groups:
    """A benchmark's groups: the web server's tree, the Celery workers' trees, the fake model's,
    the benchmark process itself (its client threads; its children are claimed by the groups
    before it), and every PostgreSQL and Redis process."""
    trees = {"web": [web]}
    if workers:
        trees["celery workers"] = list(workers)
    if model is not None:
        trees["fake model"] = [model]
    trees["clients"] = [os.getpid()]
    return Groups(trees=trees, names={"postgresql": "postgres", "redis": "redis-server"})


@dataclass(frozen=True)
class Reading:
    at: float  # time.monotonic()
    busy: float
    groups: dict[str, dict[int, float]]


def take_reading(groups: Groups) -> Reading:
    return Reading(time.monotonic(), busy_seconds(), groups.cpu_seconds(read_processes()))


def usage_between(start: Reading, end: Reading, requests: int) -> dict[str, Any]:
    """CPU per group over the window: in cores (CPU seconds per second) and in milliseconds per
    request (``requests`` finished in the window)."""
    seconds = end.at - start.at
    used: dict[str, float] = {}
    for group, after in end.groups.items():
        before = start.groups.get(group, {})
        used[group] = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    used["elsewhere"] = max(end.busy - start.busy - sum(used.values()), 0.0)
    per_request = 1000 / requests if requests else 0.0
    return {
        "window_s": round(seconds, 2),
        "requests": requests,
        "machine_busy_cores": round((end.busy - start.busy) / seconds, 2),
        "cores": {group: round(value / seconds, 3) for group, value in used.items()},
        "ms_per_request": {group: round(value * per_request, 2) for group, value in used.items()},
        "ms_per_request_total": round(sum(used.values()) * per_request, 2),
    }


def median_usage(usages: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Per group, the median over rounds of the milliseconds per request (and of the total)."""
    if not usages:
        return None
    groups = usages[0]["ms_per_request"]
    return {
        "ms_per_request": {
            group: round(statistics.median(u["ms_per_request"][group] for u in usages), 2)
            for group in groups
        },
        "ms_per_request_total": round(
            statistics.median(u["ms_per_request_total"] for u in usages), 2
        ),
        "machine_busy_cores": round(statistics.median(u["machine_busy_cores"] for u in usages), 2),
    }


class WindowSampler:
    """Takes a reading ``delay`` seconds after ``start()`` and another ``length`` seconds later,
    on its own thread (the benchmark's phase blocks meanwhile). ``result(requests)`` gives the
    usage once both are taken; None where ``/proc`` is not there (not Linux)."""

    def __init__(self, groups: Groups, delay: float, length: float) -> None:
        self.groups, self.delay, self.length = groups, delay, length
        self.readings: list[Reading] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> WindowSampler:
        if (PROC / "stat").exists():
            self.thread.start()
        return self

    def _run(self) -> None:
        time.sleep(self.delay)  # the window is set by the clock: there is no event to wait for
        self.readings.append(take_reading(self.groups))
        time.sleep(self.length)
        self.readings.append(take_reading(self.groups))

    def result(self, requests: int) -> dict[str, Any] | None:
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        if len(self.readings) < 2:
            return None
        return usage_between(self.readings[0], self.readings[1], requests)
