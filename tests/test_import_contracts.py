"""The import contracts (pyproject.toml, ``[tool.importlinter]``; ``lint-imports`` in CI) fail
when they should: each planted violation breaks its contract, a module added to memory_worker
is behind the door from the start, and the pure engine's list of forbidden packages covers
every package chatmem depends on."""

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from tests.support import import_graph

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def contracts() -> dict[str, dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_planted_violations_break_their_contracts(tmp_path: Path) -> None:
    for app in import_graph.APPS:
        shutil.copytree(
            ROOT / app, tmp_path / app, ignore=shutil.ignore_patterns("__pycache__", "*.tiktoken")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    # The web app past the door, into a module that exists and into one added later.
    plant(
        tmp_path,
        "conversations.services.turns",
        "from memory_worker.folding import snapshot  # noqa",
    )
    (tmp_path / "memory_worker" / "brand_new.py").write_text("")
    plant(tmp_path, "conversations.api.views", "from memory_worker import brand_new  # noqa")
    # The engine importing Django and the rest of memory.
    plant(tmp_path, "memory_worker.engine.presets", "import django  # noqa")
    plant(tmp_path, "memory_worker.engine.turn_groups", "from memory_worker import knobs  # noqa")
    # Memory reaching into the web services; the data layer into memory.
    plant(
        tmp_path,
        "memory_worker.coordination.locks",
        "from conversations.services import chats  # noqa",
    )
    plant(tmp_path, "conversations.rows", "from memory_worker import memory  # noqa")
    # A cycle.
    plant(
        tmp_path,
        "memory_worker.coordination.lease",
        "from memory_worker.scheduling import runs  # noqa",
    )

    run = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    for contract in contracts().values():
        assert f"{contract['name']} BROKEN" in output, output
    for link in (
        "conversations.services.turns -> memory_worker.folding.snapshot",
        "conversations.api.views -> memory_worker.brand_new",
        "memory_worker.engine.presets -> django",
        "memory_worker.engine.turn_groups -> memory_worker.knobs",
        "memory_worker.coordination.locks -> conversations.services.chats",
        "conversations.rows -> memory_worker.memory",
    ):
        assert re.search(rf"^-\s+{re.escape(link)} \(l\.\d+\)$", output, re.MULTILINE), output
    cycles = output.split("No cycles are allowed in memory_worker.", 1)[1]
    assert "- .coordination -> .scheduling" in cycles, output


def test_the_web_app_may_import_exactly_the_door_and_the_pure_engine() -> None:
    one_door, pure_engine = contracts()["one-door"], contracts()["pure-engine"]
    allowed = {
        expression.split(" -> ")[1]
        for expression in one_door["ignore_imports"]
        if expression.startswith("conversations.** -> ")
    }
    assert allowed == {"memory_worker.memory", *(f"{m}.**" for m in pure_engine["source_modules"])}
    # The same engine is type-checked with mypy --strict in CI.
    ci = (ROOT / ".ci" / "run").read_text()
    for module in pure_engine["source_modules"]:
        assert re.search(rf"mypy --strict .* {module.replace('.', '/')}/?$", ci, re.M)


def test_the_pure_engine_may_import_no_package_chatmem_depends_on() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra, extra_requirements in project["optional-dependencies"].items():
        # The test tools and the peers bench.peers measures are not chatmem's dependencies.
        if extra not in ("test", "peers"):
            requirements += extra_requirements
    packages: dict[str, set[str]] = {}
    for package, distributions in importlib.metadata.packages_distributions().items():
        for distribution in distributions:
            packages.setdefault(normalized(distribution), set()).add(package)
    names = {normalized(re.split(r"[\[<>=~!; ]", line, maxsplit=1)[0]) for line in requirements}
    imported = {
        package
        for name in names
        for package in packages.get(name, ())
        if not package.startswith("_")
    }
    assert imported, packages
    forbidden = set(contracts()["pure-engine"]["forbidden_modules"])
    assert imported <= forbidden, sorted(imported - forbidden)


def normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()
