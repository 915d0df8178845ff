"""Every `python -m fsdp_exp` command in the README, docs/ and examples/*/README.md, as written.

Commands are read from the files' fenced code blocks (continued lines joined, `$ ` prompts and
a leading `cd DIR &&` understood, shell variables of the block filled in). A command that needs
what this machine lacks says so in its comment, `[needs: gpu]`, `[needs: cluster]`,
`[needs: files]` (data or a run to read, named by a placeholder or made by the line above) or
`[needs: network]`: it must compose. Every other command passes the checks `python -m fsdp_exp`
makes before any rank starts, and, in the slow suite, runs to the end with only what makes it
short added. A transcript (`$ python -m fsdp_exp ...` followed by `fsdp_exp: ...`) must be
refused with the line it shows.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdp_exp.commands.experiment import compose_config
from fsdp_exp.driver.check import combinations, parse_overrides
from tests.conftest import REPO, precheck, run_cli
from fsdp_exp.errors import ConfigError

DOCUMENTS = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "examples").glob("*/README.md"))]
NEEDS = re.compile(r"\[needs: ([a-z ,]+)\]")


@dataclass(frozen=True)
class Command:
    document: str
    line: int
    args: tuple[str, ...]  # after `python -m fsdp_exp`
    cwd: str  # relative to the document's folder: `cd DIR &&`
    needs: tuple[str, ...]
    refused_with: str | None  # a transcript's `fsdp_exp: ...` line

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


def documented_commands() -> list[Command]:
    commands = []
    for document in DOCUMENTS:
        lines = (REPO / document).read_text().splitlines()
        inside, variables, number, block_cwd = False, {}, 0, ""
        while number < len(lines):
            raw, number = lines[number], number + 1
            if raw.strip().startswith("```"):
                inside, variables, block_cwd = not inside, {}, ""
                continue
            if not inside:
                continue
            text, start = raw.strip(), number
            while text.endswith("\\") and number < len(lines):  # a continued command
                text, number = text[:-1] + " " + lines[number].strip(), number + 1
            if re.fullmatch(r"cd \S+", text):  # the block's later commands run there
                block_cwd = text.split()[1]
                continue
            assignment = re.fullmatch(r'([A-Z_]+)="(.*)"', text)
            if assignment:
                variables[assignment.group(1)] = assignment.group(2)
                continue
            transcript = text.startswith("$ ")
            text = text.removeprefix("$ ")
            cwd = block_cwd
            found = re.match(r"cd (\S+) && (.*)", text)
            if found:
                cwd, text = found.groups()
            for name, value in variables.items():
                text = text.replace(f"${name}", value)
            if not re.match(r"python -m fsdp_exp(\s|$)", text):
                continue
            needs = NEEDS.search(text)
            refused = lines[number].strip() if transcript and number < len(lines) else None
            commands.append(Command(
                document, start, tuple(shlex.split(text, comments=True)[3:]), cwd,
                tuple(n.strip() for n in needs.group(1).split(",")) if needs else (),
                refused if refused and refused.startswith("fsdp_exp: ") else None))
    return commands


COMMANDS = documented_commands()


def test_the_documents_hold_the_commands_this_test_reads() -> None:
    assert len(COMMANDS) >= 30
    readme = {c.args for c in COMMANDS if c.document == "README.md"}
    assert ("task=estimate", "model=gpt", "model.size=xl", "task.world_size=64") in readme
    assert any(c.refused_with for c in COMMANDS) and any(c.cwd for c in COMMANDS)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder with the examples beside it, as a user's checkout has them."""
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def where(command: Command, workdir: Path) -> Path:
    """The folder a command runs in: the document's own (examples/x/README.md: examples/x), then its `cd`."""
    base = workdir / Path(command.document).parent if command.document.startswith("examples") else workdir
    return base / command.cwd


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_every_documented_command_is_accepted_as_written(command: Command, workdir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = where(command, workdir)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))  # `python -m` puts the working folder on the path
    if any("pkg://mypkg.conf" in a for a in command.args):  # as its comment says: conf/ moved into mypkg/
        shutil.move(folder / "conf", folder / "mypkg" / "conf")
        (folder / "mypkg" / "conf" / "__init__.py").touch()
    if command.refused_with:
        with pytest.raises(ConfigError) as refused:
            precheck(list(command.args))
        assert f"fsdp_exp: {refused.value}" == command.refused_with
    elif command.needs or "--cfg" in command.args:
        # a placeholder (`<date>`) stands for what the reader has: any value composes
        args = [re.sub(r"<[^>]+>", "x", a) for a in command.args if a not in ("--cfg", "job")]
        multirun = any(a in ("-m", "--multirun") for a in args)
        args = [a for a in args if a not in ("-m", "--multirun")]
        for run in combinations(parse_overrides(args)) if multirun else [args]:
            compose_config(run)
    else:
        precheck(list(command.args))


SHORT = ["train.steps=2", "train.log_every=1", "wandb.mode=disabled"]
SEARCH_SHORT = ["task.search_up_to=32", "task.estimate=false"]  # task=max_batch's own keys, and task=tune's
TUNE_SHORT = ["task.budget=3"]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_documented_command_runs_as_written(workdir: Path) -> None:
    """In document order, in one folder, as a newcomer would type them (so an export finds
    the checkpoint the line above saved), with only what makes each short added."""
    failed = []
    for command in COMMANDS:
        if command.needs or command.refused_with or "--cfg" in command.args:
            continue
        folder = where(command, workdir)
        task = next((a.partition("=")[2] for a in command.args if a.startswith("task=")), "train")
        short = [s for s in SHORT if not (task in ("estimate", "eval", "export") and s.startswith("train."))]
        short += SEARCH_SHORT if task in ("max_batch", "tune") else []
        short += TUNE_SHORT if task == "tune" else []
        replaced = {s.partition("=")[0] for s in short}
        args = [a for a in command.args if a.partition("=")[0] not in replaced]
        env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
        done = run_cli(*args, *short, cwd=folder, timeout=900, extra_env=env)
        if done.returncode != 0:
            failed.append(f"{command.id}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
            continue
        answer = answer_as_printed(task, [*args, *short], done.stdout + done.stderr)
        if answer is not None:  # the search's answer, pasted and run
            ran = run_cli(*answer, cwd=folder, timeout=900, extra_env=env)
            if ran.returncode != 0:
                failed.append(f"{command.id}, its answer {' '.join(answer)}: exit {ran.returncode}: "
                              f"{ran.stderr.strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)


def answer_as_printed(task: str, args: list[str], output: str) -> list[str] | None:
    """What a reader runs next: task=tune's `run it:` line as printed; task=max_batch's max batch
    in the command without its task keys, for the 50 steps its verification ran. None for a
    sweep (an answer per run) and other tasks."""
    if any(a in ("-m", "--multirun") for a in args):
        return None
    if task == "tune":
        (line,) = [x for x in output.splitlines() if x.startswith("  run it: ")]
        return shlex.split(line.removeprefix("  run it: "))[3:]
    if task == "max_batch":
        size = int(re.search(r"max batch: (\d+) per rank", output).group(1))
        kept = [a for a in args if a.partition("=")[0] not in ("task", "train.steps") and not a.startswith("task.")]
        return [*kept, f"train.batch_size={size}", "train.steps=50"]
    return None
