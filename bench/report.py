"""docs/benchmarks.md, written from the results files in bench/results/.

    python -m bench.report          # write docs/benchmarks.md
    python -m bench.report --check  # exit 1 if docs/benchmarks.md is not what this would write

Every figure on the page is read from a results file; the goals and their thresholds are here,
and each verdict compares the one with the other. Standard library only: this reads JSON and
imports nothing of chatmem, so it runs without Django, a database or a service.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from bench.report_goals import (
    PAGE,
    RESULTS_DIR,
    TESTS,
    ReportError,
    Results,
    Section,
    command,
    machine,
)
from bench.report_sections import (
    admin_pages_section,
    cache_section,
    faults_section,
    local_model_section,
    retention_sections,
    speed_section,
    topology_section,
)

# --- the page ----------------------------------------------------------------------------------


def cells(values: list[str]) -> str:
    return "| " + " | ".join(value.replace("|", "\\|") for value in values) + " |"


def render_section(r: Results, section: Section, common: str) -> list[str]:
    lines = [f"## {section.title}", ""] + ([section.note, ""] if section.note else [])
    files: list[str] = []
    for headers, rows in section.tables:
        lines += [cells([*headers, "date", "file"]), cells(["---"] * (len(headers) + 2))]
        for row in rows:
            dates = "; ".join(dict.fromkeys(r[name]["date"] for name in row.files))
            lines.append(cells([*row.cells, dates, ", ".join(f"`{f}`" for f in row.files)]))
            files += [name for name in row.files if name not in files]
        lines.append("")
    lines.append("Commands:")
    for name in files:
        doc = r[name]
        about = [doc.get("code", {}).get("commit", ""), section.caveats.get(name, "")]
        about.insert(1, machine(doc) if machine(doc) != common else "")
        detail = "; ".join(part for part in about if part)
        lines.append(f"- `{name}`: `{command(doc, name)}`" + (f" ({detail})" if detail else ""))
    return [*lines, ""]


HEADER = (
    "The current figure for each of chatmem's measured goals, read from the results file its "
    "benchmark wrote (`bench/results/*.json`), with a verdict computed against the goal's "
    "threshold and the date of the run. `python -m bench.report` writes this page; `python -m "
    "bench.report --check` fails when the page differs from what the files say "
    "(tests/test_bench_report.py checks that). Under each table, the command that wrote each "
    "file, as the file records it with `--out` naming the file: rerun it to reproduce the row's "
    "figure, then regenerate the page."
)
MACHINE = (
    "Machine, as each file records it: {common} for {count} of the {files} files named here (any "
    "other says so beside its command); 24 GiB of memory, which the files do not record. Its "
    "speed drifted by up to about 40 % over a day, so compare ratios taken within one run, not "
    "absolute figures across runs or rows. Runs from {first} to {last}. History (earlier runs, how "
    "each figure moved, corrections) is in git: `git log -p docs/benchmarks.md` and "
    "`git log -p bench/results/`."
)


def render(results_dir: Path) -> str:
    """The page, from the results files in results_dir."""
    r = Results(results_dir)
    sections = [topology_section(r), cache_section(r), *retention_sections(r)]
    sections += [speed_section(r), faults_section(r), local_model_section(r)]
    sections.append(admin_pages_section(r))
    (common, count), *_ = Counter(machine(doc) for doc in r.values()).most_common()
    dates = sorted(doc["date"] for doc in r.values())
    fill = {"common": common, "count": count, "files": len(r)}
    lines = ["# Benchmarks", ""]
    lines += ["<!-- Written by `python -m bench.report` from bench/results/*.json: rerun a "]
    lines[-1] += "benchmark or edit bench/report.py, not this file. -->"
    lines.append("")
    lines += [HEADER, "", MACHINE.format(first=dates[0], last=dates[-1], **fill), ""]
    for section in sections:
        lines += render_section(r, section, common)
    lines += ["## Measured by tests, not by a results file", ""]
    lines += [f"- {line}" for line in TESTS] + ["", "## Other results files", ""]
    others = sorted(p.name for p in results_dir.glob("*.json") if p.name not in r)
    lines.append(
        "Earlier runs and side measurements, not on this page (what they showed is in this "
        "page's git history): " + ", ".join(f"`{name}`" for name in others) + "."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results files")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    args = parser.parse_args(argv)
    try:
        text = render(args.results)
    except (ReportError, KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        print(f"bench.report: no page from {args.results}: {error!r}", file=sys.stderr)
        return 2
    if not args.check:
        args.page.write_text(text, encoding="utf-8")
        print(f"wrote {args.page}: {text.count(chr(10))} lines")
    elif not args.page.exists() or args.page.read_text(encoding="utf-8") != text:
        print(f"{args.page} is out of date: run `python -m bench.report`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
