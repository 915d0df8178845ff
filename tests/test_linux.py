"""fsdp_exp/linux.py, the one door to the platform for a CPU's memory figures: nothing else
reads /proc, calls the C library or sets a limit, and a platform without a part of it is
said in one line and refused where a figure would be wrong."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fsdp_exp import linux
from fsdp_exp.errors import ConfigError
from fsdp_exp.memory import check_limit
from tests.conftest import REPO, names

DOOR = REPO / "fsdp_exp" / "linux.py"


def platform_reads(path: Path) -> list[str]:
    """What a module reaches of the platform by itself: ctypes, resource, /proc paths."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {m}" for m in modules if m.split(".")[0] in ("ctypes", "resource")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/proc"):
            found.append(node.value)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                and str(node.values[0].value).startswith("/proc"):
            found.append(f"f{node.values[0].value!r}...")
    return found


def test_only_the_door_reads_proc_calls_the_c_library_or_sets_a_limit() -> None:
    assert platform_reads(DOOR), "the test reads nothing: it would pass whatever the modules do"
    elsewhere = {str(p.relative_to(REPO)): reads for p in sorted((REPO / "fsdp_exp").rglob("*.py"))
                 if p != DOOR and (reads := platform_reads(p))}
    assert elsewhere == {}


def test_this_machine_has_every_part_and_a_platform_without_one_says_what_it_leaves_out(monkeypatch) -> None:
    assert linux.PROC and linux.heap_in_use_bytes() is not None and linux.missing() is None
    monkeypatch.setattr(linux, "_MALLINFO2", None)
    line = linux.missing()
    assert linux.heap_in_use_bytes() is None and "\n" not in line
    assert "mallinfo2" in line and "peak_in_use_gb" in line and "no /proc" not in line
    monkeypatch.setattr(linux, "PROC", False)
    line = linux.missing()
    assert "/proc" in line and "per-phase peaks" in line and "memory.limit_gb" in line
    status = linux.proc_status()  # without /proc: the peak resident size as getrusage has it
    assert set(status) == {"VmHWM:", "VmRSS:"} and status["VmHWM:"] > 0


def test_a_cpu_limit_without_proc_is_refused_in_one_line(monkeypatch) -> None:
    check_limit(1.0, "cpu", ranks_per_device=2)  # here it counts
    monkeypatch.setattr(linux, "PROC", False)
    with pytest.raises(ConfigError) as err:
        check_limit(1.0, "cpu", ranks_per_device=2)
    names(str(err.value), "memory.limit_gb=1.0", "Linux")
