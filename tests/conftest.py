"""Helpers shared by the tests: run the real CLI in a fresh process, read its outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A small ViT keeps the end-to-end runs fast on 2 cores; the code path is the default one.
SMALL_VIT = ["model.num_layers=2", "wandb.mode=disabled"]


def precheck(argv: list[str]) -> dict:
    """The command's check of `argv`, in this process: each run composed with Hydra's compose
    API and checked as fsdp_exp.driver.check checks it for `python -m fsdp_exp`; the plan
    of each run launched (a RunPlan, or Refused for a run of a sweep). A refusal of the
    command as the ConfigError whose line it prints."""
    from fsdp_exp.commands.experiment import compose_config
    from fsdp_exp.driver.check import check_run, check_sweep, combinations, parse_overrides, run_key

    multirun = any(a in ("-m", "--multirun") for a in argv)
    args = [a for a in argv if a not in ("-m", "--multirun")]
    if not multirun:
        return {run_key(args): check_run(compose_config(args))}
    checked = check_sweep(combinations(parse_overrides(args)), compose_config)
    return {run_key(run): checked.plans.get(run_key(run)) for run in checked.launch}


def names(line: str, key: str, *allowed: str) -> None:
    """`line` is one refusal that names `key` first and holds each of `allowed` (the values
    a key takes, the hint a user needs); the words around them are the message's own."""
    text = line.strip().removeprefix("fsdp_exp: ")
    assert "\n" not in text, f"not one line: {line!r}"
    assert text.startswith(f"{key}:") or text.startswith(f"{key} "), f"{line!r} does not name {key!r} first"
    missing = [a for a in allowed if a not in text]
    assert not missing, f"{line!r} lacks {missing}"


def run_cli(*args: str, cwd: Path, timeout: float = 240, extra_env: dict | None = None,
            module: tuple[str, ...] = ("-m", "fsdp_exp")) -> subprocess.CompletedProcess:
    """`python -m fsdp_exp ARGS` in `cwd`, as a user would type it (a training run traces its
    own estimate beside it, as by default: memory.estimate); output captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, *module, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def estimated_first(*args: str, cwd: Path, where: Path, extra_env: dict | None = None) -> Path:
    """task=estimate of the setups ARGS run (`-m`: each of the sweep's), kept for them
    (fsdp_exp.estimate.earlier): their runs, shorter than a trace, check against it at once.
    Where it wrote."""
    folder = "sweep" if "-m" in args else "run"
    result = run_cli(*args, "task=estimate", f"hydra.{folder}.dir={where}", cwd=cwd, timeout=400, extra_env=extra_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return where


def refused_here(*args: str, cwd: Path, extra_env: dict | None = None,
                 missing: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m fsdp_exp ARGS` run by its own `main()` in this process, for a command the
    check must refuse before anything starts: its exit code and what it printed, without the
    seconds a fresh interpreter spends importing torch. Every refusal takes the same way out
    of `main()` (one line, exit 2); tests/test_checks.py runs it in a fresh process too, rank
    server included. `missing`: packages whose import fails meanwhile, as when they are not
    installed (Python's own way: None in sys.modules). The checks a command makes in a fork of
    its rank server run here, where those imports fail, even after an earlier test in this
    process started a server (`launcher.local.elastic_run`). Hydra's, logging's, the signals'
    and the process's state are put back."""
    import contextlib
    import io
    import logging
    import signal

    from hydra.core.global_hydra import GlobalHydra

    from fsdp_exp.commands.experiment import main
    from fsdp_exp.launcher import rank_server

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    loggers = [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    logging_state = [(lg, lg.handlers[:], lg.filters[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    out, err, code = io.StringIO(), io.StringIO(), 0
    hidden = {name: sys.modules.get(name) for name in missing}
    sys.modules.update(dict.fromkeys(missing))
    server_started, rank_server.started = rank_server.started, False
    os.environ.update(extra_env or {})
    os.chdir(cwd)
    sys.argv = ["fsdp_exp", *args, "memory.estimate=false"]  # a run it failed to refuse traces nothing
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        rank_server.started = server_started
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for lg, lg_handlers, lg_filters, level, propagate, disabled in logging_state:
            lg.handlers[:], lg.filters[:] = lg_handlers, lg_filters
            lg.level, lg.propagate, lg.disabled = level, propagate, disabled
        GlobalHydra.instance().clear()
        for name, module in hidden.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module
    return subprocess.CompletedProcess(["fsdp_exp", *args], code, out.getvalue(), err.getvalue())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def rank_pid(log_file: Path) -> int | None:
    """The pid a rank writes at the top of its log ("rank 1 is pid 1234 on host")."""
    match = re.search(r"rank \d+ is pid (\d+)", log_file.read_text()) if log_file.is_file() else None
    return int(match.group(1)) if match else None


def signal_at_step(runs: list[subprocess.Popen], dirs: list[Path], at_step: int, signals: dict[int, int],
                   timeout: float = 240) -> int | None:
    """Once the run has logged `at_step` (in whichever of `dirs` holds metrics.jsonl), send
    each rank its signal, in the order given; the step it was signalled at, or None when
    the runs ended or `timeout` passed first. A rank's pid is read from its log, in
    whichever of `dirs` holds it."""
    step = wait_for_step(runs, dirs, at_step, timeout)
    if step is not None:
        for rank, signum in signals.items():
            log = next(d / f"rank{rank}.log" for d in dirs if (d / f"rank{rank}.log").is_file())
            os.kill(rank_pid(log), signum)
    return step


def wait_for_step(runs: list[subprocess.Popen], dirs: list[Path], at_step: int, timeout: float = 240) -> int | None:
    """Until the run has logged `at_step` (in whichever of `dirs` holds metrics.jsonl): the
    last step logged, or None when the runs ended or `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(run.poll() is None for run in runs):
        metrics = [d / "metrics.jsonl" for d in dirs if (d / "metrics.jsonl").is_file()]
        steps = [r["step"] for r in read_jsonl(metrics[0]) if "step" in r] if metrics else []
        if steps and steps[-1] >= at_step:
            return steps[-1]
        time.sleep(0.02)
    return None


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def own_estimate_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's estimates kept apart (fsdp_exp.estimate.earlier): no test reuses another's,
    nor the user's ~/.cache."""
    folder = tmp_path_factory.mktemp("fsdp_exp_cache")
    monkeypatch.setenv("FSDP_EXP_CACHE", str(folder))
    return folder


def run_and_list_left(*args: str, cwd: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`python -m fsdp_exp ARGS` (as run_cli) under a process that adopts whatever it leaves
    running (Linux's child subreaper): its result, and the command lines of the processes
    still alive when it exited (then stopped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "left_running.py"), sys.executable, "-m", "fsdp_exp",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output, _, last = done.stdout.rstrip("\n").rpartition("\n")
    assert last.startswith("{"), done.stderr[-2000:]
    listed = json.loads(last)
    return subprocess.CompletedProcess(done.args, listed["returncode"], output, done.stderr), listed["left"]


# A user's package, as tests write it: a residual block whose instances are FSDP units, and
# the settings of a short parity run (SGD with momentum, every step logged, weights exported).
RESIDUAL_BLOCK = """
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))
"""
PARITY_STEPS = 5
PARITY_RUN = ["wandb.mode=disabled", "memory.estimate=false", "train.batch_size=16", f"train.steps={PARITY_STEPS}",
              "train.log_every=1", "train.lr=0.05", "optimizer._target_=torch.optim.SGD", "+optimizer.momentum=0.9",
              "checkpoint.export_full=true"]


def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> dict:
    """`source` as the user's module `name`, on the import path of this process and (the
    environment returned) of the command's."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"PYTHONPATH": str(tmp_path)}
