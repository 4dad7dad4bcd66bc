"""The apps' import graph, read from the source (every import, at module level or inside a
function), and the two rules docs/design.md states: no cycle, and no import of a higher layer."""

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

APPS = ("chatmem_project", "conversations", "memory_worker")

# Bottom to top; a module may import its own layer or a lower one. A module's layer is given by
# the longest entry matching it, so a new module lands in its package's layer unless named.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "chatmem_project.settings",
            "chatmem_project.env",
            "chatmem_project.database",
            "chatmem_project.boot",
            "chatmem_project.logs",
            "chatmem_project.request_id",
            "chatmem_project.gc_tuning",
            "memory_worker.knobs",
            "memory_worker.engine.policy",
            "memory_worker.engine.state",
            "memory_worker.engine.presets",
            "memory_worker.engine.turn_groups",
            "conversations.chat_model",  # plain Python, loaded before the apps
            "memory_worker.summaries.retention",
            "memory_worker.summaries.guard",
            "memory_worker.pinned",
            "memory_worker.engine.isolation",
        ),
    ),
    (
        "data",
        (
            "conversations",  # the package itself (empty)
            "conversations.models",
            "conversations.rows",
            "conversations.agent_rules",
            "conversations.variants",
            "memory_worker",  # the package itself (empty)
            "memory_worker.coordination.runtime",
            "memory_worker.coordination.request_redis",
            "memory_worker.coordination.locks",
            "memory_worker.coordination.lease",
            "memory_worker.folding.snapshot",
        ),
    ),
    ("memory", ("memory_worker.",)),
    ("conversation services", ("conversations.",)),
    (
        "entry points",
        (
            "conversations.api",
            "conversations.admin",
            "conversations.agent_admin",
            "conversations.pin_admin",
            "conversations.management",
            "conversations.apps",
            "memory_worker.tasks",
            "memory_worker.apps",
            "chatmem_project",
        ),
    ),
)

# Imports inside a function that are not there to dodge a cycle: Django imports an app's checks
# and signal receivers in AppConfig.ready(), once the models are loaded; the Celery app module
# loads with the settings (chatmem_project/__init__.py), before the apps, so its signal
# receivers import what needs them when they run.
FUNCTION_IMPORTS_ALLOWED = {
    ("conversations.apps", "ready"),
    ("memory_worker.apps", "ready"),
    ("chatmem_project.celery", "serve_worker_metrics"),
    ("chatmem_project.celery", "freeze_startup_objects"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    function: str | None  # the enclosing function, for an import inside one


def layer_of(module: str) -> int:
    """Index into LAYERS by the longest matching entry: "a.b." matches a.b's submodules, "a.b"
    matches a.b and its submodules; -1 if none matches."""
    best, best_length = -1, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith("."):
                matches = module.startswith(entry)
            else:
                matches = module == entry or module.startswith(entry + ".")
            if matches and len(entry) > best_length:
                best, best_length = index, len(entry)
    return best


def module_files(root: Path) -> dict[str, Path]:
    modules = {}
    for app in APPS:
        for path in sorted((root / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports(root: Path) -> list[Import]:
    modules = module_files(root)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, function in _import_nodes(tree, None):
            for name in _imported_names(node, package, modules):
                if name != module:
                    found.append(Import(module, name, node.lineno, function))
    return found


def _import_nodes(
    node: ast.AST, function: str | None
) -> Iterator[tuple[ast.Import | ast.ImportFrom, str | None]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, function
        inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else None
        yield from _import_nodes(child, function or inner)


def _imported_names(
    node: ast.Import | ast.ImportFrom, package: str, modules: Iterable[str]
) -> list[str]:
    """The app modules an import statement names: ``from package import module`` depends on
    that module (its package is loading either way), ``from module import name`` on the module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    submodules = [f"{base}.{alias.name}" for alias in node.names]
    named = [name for name in submodules if name in modules]
    if len(named) < len(submodules) and base in modules:
        named.append(base)
    return named


def cycles(edges: Iterable[Import]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def upward(edges: Iterable[Import]) -> list[Import]:
    return [edge for edge in edges if layer_of(edge.importer) < layer_of(edge.imported)]


def function_imports(edges: Iterable[Import]) -> list[Import]:
    return [
        edge
        for edge in edges
        if edge.function is not None
        and (edge.importer, edge.function) not in FUNCTION_IMPORTS_ALLOWED
    ]


def problems(root: Path) -> list[str]:
    edges = imports(root)
    found = ["import cycle: " + " <-> ".join(component) for component in cycles(edges)]
    found += [
        f"upward import: {e.importer}:{e.line} ({LAYERS[layer_of(e.importer)][0]}) imports "
        f"{e.imported} ({LAYERS[layer_of(e.imported)][0]})"
        for e in upward(edges)
    ]
    found += [
        f"import inside a function: {e.importer}:{e.line} ({e.function}) imports {e.imported}"
        for e in function_imports(edges)
    ]
    return found
