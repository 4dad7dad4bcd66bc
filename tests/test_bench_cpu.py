"""The benchmarks' CPU accounting (bench/cpu.py): a process tree's CPU lands in its group, per
request, and what no group claims is counted elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu import Groups, median_usage, take_reading, usage_between

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")

# Waits for a line on stdin, burns 0.4 s of its own CPU, says so, then waits to be closed.
BURN = (
    "import sys, time\n"
    "sys.stdin.readline()\n"
    "start = time.process_time()\n"
    "while time.process_time() - start < 0.4: pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_grandchilds_cpu_counts_in_its_trees_group() -> None:
    # The group's root is a shell; the CPU is burnt by its child, so only a walk of the tree
    # finds it ("; true" keeps the shell from exec-ing python in its place).
    shell = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "$BURN"; true'],
        env={"BURN": BURN},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shell.stdin is not None and shell.stdout is not None
    try:
        groups = Groups(trees={"burner": [shell.pid]}, names={"nothing": "no-such-command"})
        before = take_reading(groups)
        shell.stdin.write("go\n")
        shell.stdin.flush()
        assert shell.stdout.readline().strip() == "burnt"
        after = take_reading(groups)
    finally:
        shell.stdin.close()
        shell.wait(timeout=10)
    usage = usage_between(before, after, requests=10)
    # 0.4 s over 10 requests: 40 ms each, give or take the kernel's 10 ms accounting ticks.
    assert 35 <= usage["ms_per_request"]["burner"] <= 60, usage
    assert usage["ms_per_request"]["nothing"] == 0
    assert usage["ms_per_request_total"] >= usage["ms_per_request"]["burner"]
    assert set(usage["ms_per_request"]) == {"burner", "nothing", "elsewhere"}


def test_rounds_combine_by_their_median() -> None:
    def round_(web: float) -> dict[str, object]:
        return {
            "ms_per_request": {"web": web, "elsewhere": 0.5},
            "ms_per_request_total": web + 0.5,
            "machine_busy_cores": 1.9,
        }

    combined = median_usage([round_(5.0), round_(9.0), round_(6.0)])
    assert combined is not None
    assert combined["ms_per_request"] == {"web": 6.0, "elsewhere": 0.5}
    assert combined["ms_per_request_total"] == 6.5
    assert median_usage([]) is None
