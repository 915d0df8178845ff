"""The share of fsdp_exp's GPU-only lines the tests run (docs/gpu.md, "What a CPU proves").

No GPU runs in the tests, so a GPU-only line runs only where a test stubs torch.cuda at the
one place the code calls it. A GPU-only statement is one that runs on a GPU and never on a
CPU: under an `if` on the device the code runs on (`device.type == "cuda"`, `Device.cuda`, a
probe's `.on_gpu()`, a `torch.cuda` call), on its GPU side (the body; for a test that says
"not a GPU", the `else` and, after a body that returns, the rest of the block), and every
statement that calls into torch.cuda (but `is_available` and `device_count`, which a CPU
machine calls too, and a call in a conditional expression, `x if cuda else y`, whose line
runs on a CPU as well). Branches that refuse a GPU run on a machine without one are CPU lines.

    python bench/gpu_lines.py                       # the fast tests of every test file that names cuda
    python bench/gpu_lines.py tests/test_gpu_paths.py --missing

Prints each module's GPU-only statements and how many the tests ran, the share over all,
and with --missing the lines not run.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_exp"
ON_THE_DEVICE = re.compile(r"""["']cuda["']|Device\.cuda|torch\.cuda\.|\.on_gpu\(\)|\bis_cuda\b""")
GPU_HERE = re.compile(r"is_available|device_count|gpus == 0")  # a check that also runs where there is no GPU
NEGATIVE = re.compile(r"^\s*not\b|!=|\bnot in\b")
CPU_CALLS_TOO = re.compile(r"torch\.cuda\.(is_available|device_count)\b")
EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)

Statement = tuple[int, int]  # its first and last line


def simple_statements(stmts: list[ast.stmt]) -> list[Statement]:
    """Every statement in `stmts` and under them, a compound one by its header's lines."""
    found: list[Statement] = []
    for s in stmts:
        blocks = [getattr(s, name) for name in ("body", "orelse", "finalbody") if isinstance(getattr(s, name, None), list)]
        blocks += [h.body for h in getattr(s, "handlers", None) or []]
        if not blocks:
            found.append((s.lineno, s.end_lineno or s.lineno))
            continue
        first_inner = min(b[0].lineno for b in blocks if b)
        found.append((s.lineno, max(s.lineno, first_inner - 1)))
        for block in blocks:
            found.extend(simple_statements(block))
    return found


class Source:
    """A module's text, to read the code of a node (ast.get_source_segment splits the whole
    text at every call)."""

    def __init__(self, text: str) -> None:
        self.lines = [line.encode() for line in text.splitlines()]  # the offsets count UTF-8 bytes

    def __call__(self, node: ast.AST) -> str:
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        if first == last:
            return self.lines[first][node.col_offset:node.end_col_offset].decode()
        return b"\n".join([self.lines[first][node.col_offset:], *self.lines[first + 1:last],
                           self.lines[last][:node.end_col_offset]]).decode()


def calls_the_gpu(source: Source, s: ast.stmt) -> bool:
    """Whether the statement calls into torch.cuda, outside a conditional expression (`x if
    cuda else y` runs on a CPU too, and a line's coverage cannot tell its sides apart)."""
    guarded = {id(n) for e in ast.walk(s) if isinstance(e, ast.IfExp) for n in ast.walk(e)}
    calls = (source(c.func) for c in ast.walk(s)
             if isinstance(c, ast.Call) and id(c) not in guarded)
    return any(c.startswith("torch.cuda.") and not CPU_CALLS_TOO.match(c) for c in calls)


def gpu_only_statements(source: str) -> set[Statement]:
    """The GPU-only statements of a module's source (see the module's docstring)."""
    found: set[Statement] = set()
    code = Source(source)

    def walk(stmts: list[ast.stmt]) -> None:
        for at, s in enumerate(stmts):
            if isinstance(s, ast.If):
                test = code(s.test)
                if ON_THE_DEVICE.search(test) and not GPU_HERE.search(test) and " or " not in test:
                    if NEGATIVE.search(test):
                        found.update(simple_statements(s.orelse))
                        if s.body and isinstance(s.body[-1], EXITS) and not s.orelse:
                            found.update(simple_statements(stmts[at + 1:]))
                    else:
                        found.update(simple_statements(s.body))
            elif not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.For,
                                    ast.While, ast.Try)) and calls_the_gpu(code, s):
                found.add((s.lineno, s.end_lineno or s.lineno))
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(s, name, None)
                if isinstance(inner, list):
                    walk(inner)
            for handler in getattr(s, "handlers", None) or []:
                walk(handler.body)

    walk(ast.parse(source).body)
    return found


def measure(pytest_args: list[str]) -> dict[Path, set[int]]:
    """The lines of fsdp_exp the tests ran, by file (in this process: ranks the tests start
    run on the CPU, where no GPU-only line runs)."""
    import coverage
    import pytest

    with tempfile.TemporaryDirectory() as scratch:
        cov = coverage.Coverage(data_file=str(Path(scratch) / "coverage"), source=[str(PACKAGE)])
        cov.start()
        try:
            code = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
        finally:
            cov.stop()
        if code not in (0, 1):  # 1: some tests failed; the lines they ran still count
            raise SystemExit(f"pytest could not run the tests (exit {code})")
        data = cov.get_data()
        return {Path(f): set(data.lines(f) or ()) for f in data.measured_files()}


def default_tests() -> list[str]:
    return [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "cuda" in p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help="pytest's arguments (default: the test files that name cuda)")
    parser.add_argument("--missing", action="store_true", help="list the GPU-only lines no test ran")
    args = parser.parse_args(argv)
    ran = measure(args.tests or default_tests())
    total = covered = 0
    missing: list[str] = []
    print(f"{'module':44} {'GPU-only':>8} {'run':>5}")
    for path in sorted(PACKAGE.rglob("*.py")):
        statements = gpu_only_statements(path.read_text())
        if not statements:
            continue
        lines = ran.get(path.resolve(), set())
        run = [s for s in statements if any(n in lines for n in range(s[0], s[1] + 1))]
        total, covered = total + len(statements), covered + len(run)
        name = str(path.relative_to(ROOT))
        print(f"{name:44} {len(statements):8} {len(run):5}")
        missing += [f"{name}:{s[0]}" for s in sorted(set(statements) - set(run))]
    print(f"{'all':44} {total:8} {covered:5}  {covered / max(total, 1):.0%} of the GPU-only statements run")
    if args.missing:
        print("not run:", *missing, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
