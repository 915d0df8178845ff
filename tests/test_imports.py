"""The package's modules import one another without a circle: a lower layer never imports a
higher one, so that any module can be read, and imported, on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fsdp_exp

PACKAGE = Path(fsdp_exp.__file__).parent


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = PACKAGE.parent) -> dict[str, bool]:
    """The package's modules that `path` imports, each with whether every import of it is
    inside a function. Every import counts: at module level, under `if TYPE_CHECKING:` (a
    circle of those is a circle a reader meets), and inside functions (an import put there
    to dodge a circle is the circle still)."""
    found: dict[str, bool] = {}
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found[name] = found.get(name, True) and id(node) in in_function
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


def import_graph() -> dict[str, dict[str, bool]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


# The only imports of the package made inside a function, each for what it saves.
IMPORTED_LATE = {
    ("fsdp_exp.estimate.predict", "fsdp_exp.estimate.trace"): "tracing's imports (0.5 s) in the tracing child only",
    ("fsdp_exp.commands", "fsdp_exp.launcher.rank_server"):
        "the command's end registered before multiprocessing's own atexit hook, which it runs",
    ("fsdp_exp.commands", "fsdp_exp.commands.experiment"): "the rank server started before torch is imported",
}


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert {"fsdp_exp.config", "fsdp_exp.tasks.train", "fsdp_exp.launcher.ray"} <= graph["fsdp_exp.options"].keys()
    assert circles({module: set(imported) for module, imported in graph.items()}) == []


def folder_of(module: str) -> str:
    """A module's layer: its folder under fsdp_exp (fsdp_exp.rank.train: fsdp_exp.rank), or
    the module itself at the top (fsdp_exp.memory)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_folders_import_one_another_without_a_circle() -> None:
    """No import runs from a lower layer back up to a higher one: rank/ imports nothing of
    checkpoint/ that imports rank/, and a launcher imports nothing of the driver or the
    tasks that use it."""
    folders: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        folders.setdefault(folder_of(module), set()).update(
            folder_of(i) for i in imported if folder_of(i) != folder_of(module))
    assert {"fsdp_exp.checkpoint", "fsdp_exp.distributed"} <= folders["fsdp_exp.rank"]
    assert circles(folders) == []
    assert not {"fsdp_exp.driver", "fsdp_exp.tasks", "fsdp_exp.commands.experiment"} & folders["fsdp_exp.launcher"]


def test_no_import_is_put_in_a_function_but_the_named_few() -> None:
    late = {(module, imported) for module, imports in import_graph().items()
            for imported, inside in imports.items() if inside}
    assert late == set(IMPORTED_LATE)


def test_an_import_inside_a_function_still_makes_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "fsdp_exp"
    package.mkdir()
    (package / "a.py").write_text("from fsdp_exp.b import helper\n")
    (package / "b.py").write_text("def helper():\n    from fsdp_exp import a\n    return a\n")
    modules = {"fsdp_exp.a", "fsdp_exp.b"}
    graph = {f"fsdp_exp.{m}": imports_of(package / f"{m}.py", modules, root=tmp_path) for m in "ab"}
    assert graph == {"fsdp_exp.a": {"fsdp_exp.b": False}, "fsdp_exp.b": {"fsdp_exp.a": True}}
    assert circles({m: set(i) for m, i in graph.items()}) == [["fsdp_exp.a", "fsdp_exp.b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_experiments_schema_imports_no_task_and_no_launcher() -> None:
    """fsdp_exp.config is what every layer imports: it must not pull the layers above it."""
    code = ("import sys, fsdp_exp.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('fsdp_exp.tasks.', 'fsdp_exp.launcher.', "
            "'fsdp_exp.rank.', 'fsdp_exp.driver'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
