"""The apps' dependencies run one way (docs/design.md, the map): no import cycle, no import of a
higher layer, no import inside a function to get round either."""

import shutil
from pathlib import Path

from tests.support import import_graph

ROOT = Path(__file__).resolve().parent.parent


def test_the_apps_have_no_cycle_no_upward_import_and_no_import_inside_a_function() -> None:
    assert import_graph.problems(ROOT) == []


def copy_of_the_apps(tmp_path: Path) -> Path:
    for app in import_graph.APPS:
        shutil.copytree(ROOT / app, tmp_path / app)
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_a_planted_cycle_fails_the_check(tmp_path: Path) -> None:
    root = copy_of_the_apps(tmp_path)
    plant(root, "conversations.chat_model.text", "from conversations.chat_model import tokens")
    plant(root, "conversations.chat_model.tokens", "from conversations.chat_model import text")
    found = import_graph.problems(root)
    assert (
        "import cycle: conversations.chat_model.text <-> conversations.chat_model.tokens" in found
    )


def test_an_import_inside_a_function_counts_as_an_edge(tmp_path: Path) -> None:
    root = copy_of_the_apps(tmp_path)
    plant(
        root,
        "memory_worker.folding.snapshot",
        "def dodge():\n    from conversations.services import chats  # noqa",
    )
    found = import_graph.problems(root)
    assert any(
        problem.startswith("upward import: memory_worker.folding.snapshot:")
        and problem.endswith("imports conversations.services.chats (conversation services)")
        for problem in found
    ), found
    assert any(
        problem.startswith("import inside a function: memory_worker.folding.snapshot:")
        and "(dodge) imports conversations.services.chats" in problem
        for problem in found
    ), found


def test_the_worker_side_may_not_import_the_web_services(tmp_path: Path) -> None:
    root = copy_of_the_apps(tmp_path)
    plant(root, "memory_worker.coordination.locks", "from conversations.api import views  # noqa")
    found = import_graph.problems(root)
    assert any(p.startswith("upward import: memory_worker.coordination.locks:") for p in found), (
        found
    )
