"""docs/benchmarks.md is written by `python -m bench.report` from bench/results/*.json: the
committed page is what the command writes, it stays short, every figure names the results file
and the command that measured it and the date, and a figure is read from its file, not written in
the code. No database, no service: the report reads JSON only."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
DATE = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC$")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def table_rows(text: str) -> list[dict[str, str]]:
    """Every data row of every table on the page, as {header: cell}."""
    rows: list[dict[str, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("| ---"):
            headers = split(line)
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                cells = split(row)
                assert len(cells) == len(headers), row
                rows.append(dict(zip(headers, cells, strict=True)))
    return rows


def split(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip()[1:-1])]


def commands(text: str) -> dict[str, str]:
    found = re.findall(r"^- `([\w.-]+\.json)`: `(python -m bench\.[^`]+)`", text, re.MULTILINE)
    return dict(found)


def row_for(text: str, goal: str, name: str) -> dict[str, str]:
    rows = table_rows(text)
    matches = [r for r in rows if goal in r.get("goal", "") and f"`{name}`" in r["file"]]
    assert len(matches) == 1, (goal, name, matches)
    return matches[0]


def test_the_committed_page_is_what_the_command_writes() -> None:
    assert page() == report.render(RESULTS), "run `python -m bench.report` and commit the page"
    assert report.main(["--check"]) == 0


def test_check_fails_on_a_page_that_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "benchmarks.md"
    stale.write_text(page().replace("| met |", "| **not met** |", 1), encoding="utf-8")
    assert report.main(["--check", "--page", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert report.main(["--page", str(stale)]) == 0  # writing it makes it current
    assert report.main(["--check", "--page", str(stale)]) == 0


def test_the_page_is_at_most_200_lines() -> None:
    assert len(page().splitlines()) <= 200


def test_every_figure_row_names_existing_files_with_their_command_and_date() -> None:
    text = page()
    named = set(re.findall(r"`([\w.-]+\.json)`", text))
    assert named and all((RESULTS / name).is_file() for name in named), named
    listed = commands(text)
    rows = table_rows(text)
    assert len(rows) > 30
    for row in rows:
        files = re.findall(r"`([\w.-]+\.json)`", row["file"])
        dates = row["date"].split("; ")
        assert files and len(dates) <= len(files), row
        assert all(DATE.match(date) for date in dates), row
        for name in files:
            assert listed[name].endswith(f"--out bench/results/{name}"), name
            assert json.loads((RESULTS / name).read_text())["date"] in dates, row
        if "verdict" in row:
            assert row["verdict"].split(" (")[0] in {"met", "**not met**", "no goal"}, row
    for path in re.findall(r"tests/test_\w+\.py", text):
        assert (ROOT / path).is_file(), path


def test_a_figure_and_its_verdict_are_read_from_the_results_file(tmp_path: Path) -> None:
    goal = "≥ 150 turns/s at concurrency 16"
    before = row_for(report.render(RESULTS), goal, "throughput.json")
    assert before["measured"].startswith("403.1 ") and before["verdict"] == "met"

    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / "throughput.json"
    doc = json.loads(path.read_text())
    doc["chatmem"]["turns_per_second_median"] = 123.4
    path.write_text(json.dumps(doc))
    after = row_for(report.render(results), goal, "throughput.json")
    assert after["measured"].startswith("123.4 ") and after["verdict"] == "**not met**"


def test_a_retention_verdict_follows_the_kept_share(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / "retention-crowded-offline.json"
    doc = json.loads(path.read_text())
    doc["results"][0]["kept"]["fact"][-1] = 0.875  # facts need 90 %
    path.write_text(json.dumps(doc))
    rows = [r for r in table_rows(report.render(results)) if "crowded-offline" in r["file"]]
    assert [(r["fact"], r["verdict"]) for r in rows] == [("87.5 % / 100 %", "**not met**")]


def test_a_missing_results_file_is_reported_not_guessed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "workers.json").unlink()
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--page", str(out)]) == 2
    assert "workers.json" in capsys.readouterr().err and not out.exists()


def test_the_report_imports_the_standard_library_only() -> None:
    imported: set[str] = set()
    for module in ("report", "report_goals", "report_sections"):
        tree = ast.parse((ROOT / "bench" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module, "no relative import"
                if not node.module.startswith("bench.report"):
                    imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
