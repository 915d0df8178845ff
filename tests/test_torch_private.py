"""torch's private APIs are used through one door (fsdp_exp.torch_private), and the installed
torch still has each as it was read."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from fsdp_exp import torch_private
from tests.conftest import REPO

def test_every_private_use_is_where_torch_kept_it_and_takes_what_it_took() -> None:
    """Fails naming the call (and what changed) when a torch release moves or changes one."""
    assert torch_private.changed() == []


def test_a_changed_api_is_named() -> None:
    """What `changed()` reports when torch moves a name or changes a method's parameters."""
    places, parameters = dict(torch_private.PLACES), dict(torch_private.PARAMETERS)
    try:
        torch_private.PLACES["FakeStore"] = "torch.testing._internal.distributed.fake_pg.NoSuchStore"
        torch_private.PARAMETERS["MemTracker._update_snap"] = ("self", "update", "winfo")
        found = torch_private.changed()
    finally:
        torch_private.PLACES.update(places)
        torch_private.PARAMETERS.update(parameters)
    assert len(found) == 2, found
    assert found[0].startswith("FakeStore (torch.testing._internal.distributed.fake_pg.NoSuchStore): gone")
    assert found[1].startswith("MemTracker._update_snap: parameters ('self', 'u_type', 'winfo'")


def private(node: ast.AST) -> str | None:
    """The private torch name an import or attribute reaches (a part with a leading
    underscore, not a dunder), else None."""
    def hidden(parts: list[str]) -> bool:
        return any(p.startswith("_") and not p.endswith("__") for p in parts)

    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
        names = [a.name for a in node.names]
        if hidden(node.module.split(".")) or hidden(names):
            return f"from {node.module} import {', '.join(names)}"
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "torch" and hidden(alias.name.split(".")):
                return f"import {alias.name}"
    if isinstance(node, ast.Attribute):
        parts, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            parts.append(inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id == "torch" and hidden(parts):
            return "torch." + ".".join(reversed(parts))
    return None


def test_no_module_but_the_door_reaches_a_private_torch_name() -> None:
    found = []
    for path in sorted((REPO / "fsdp_exp").rglob("*.py")):
        if path.name == "torch_private.py":
            continue
        tree = ast.parse(path.read_text())
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {name}" for node in ast.walk(tree)
                  if (name := private(node)) is not None]
    assert found == []


@pytest.mark.parametrize("code, expected", [
    ("from torch.utils._python_dispatch import TorchDispatchMode", "from torch.utils._python_dispatch import"),
    ("import torch.distributed._tools", "import torch.distributed._tools"),
    ("x = torch.cuda.memory._dump_snapshot", "torch.cuda.memory._dump_snapshot"),
    ("x = torch.__version__", None),
    ("from torch.utils.flop_counter import FlopCounterMode", None),
])
def test_the_scan_sees_each_way_to_reach_one(code: str, expected: str | None) -> None:
    names = [name for node in ast.walk(ast.parse(code)) if (name := private(node))]
    if expected is None:
        assert names == []
    else:
        assert names and names[0].startswith(expected), names


def test_names_are_imported_on_first_use() -> None:
    """The memory trackers take seconds to import: the door imports nothing until asked."""
    code = ("import sys, fsdp_exp.torch_private as t; before = 'torch.distributed._tools' in sys.modules; "
            "t.FSDPMemTracker; print(before, 'torch.distributed._tools' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert shown.stdout.split() == ["False", "True"]
