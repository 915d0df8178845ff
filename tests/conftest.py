"""Helpers shared by the tests: run the real CLI in a fresh process, read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A small ViT keeps the end-to-end runs fast on 2 cores; the code path is the default one.
SMALL_VIT = ["model.num_layers=2", "wandb.mode=disabled"]


def run_cli(*args: str, cwd: Path, timeout: float = 240, extra_env: dict | None = None,
            module: tuple[str, ...] = ("-m", "fsdp_exp")) -> subprocess.CompletedProcess:
    """`python -m fsdp_exp ARGS` in `cwd`, as a user would type it; output captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, *module, *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
