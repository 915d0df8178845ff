"""The package's modules import one another without a circle: a lower layer never imports a
higher one, so that any module can be read, and imported, on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fsdp_exp

PACKAGE = Path(fsdp_exp.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_module_level(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports outside its functions (type-only imports
    under `if TYPE_CHECKING:` included: a circle of those is a circle a reader meets)."""
    found = set()
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                continue
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != this:
                    found.add(name)

    visit(ast.parse(path.read_text()).body)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_at_module_level(p, modules) for p in paths}


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert graph["fsdp_exp.options"] >= {"fsdp_exp.config", "fsdp_exp.tasks.train", "fsdp_exp.launch.ray"}
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_experiments_schema_imports_no_task_and_no_launcher() -> None:
    """fsdp_exp.config is what every layer imports: it must not pull the layers above it."""
    code = ("import sys, fsdp_exp.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('fsdp_exp.tasks.', 'fsdp_exp.launch.', "
            "'fsdp_exp.rank.', 'fsdp_exp.driver'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # the max_batch package's __init__ imports nothing: only its settings come with the schema
    assert result.stdout.strip() == "['fsdp_exp.tasks.max_batch', 'fsdp_exp.tasks.max_batch.settings']", result.stdout
