"""Files written whole, then moved into place: a reader never sees half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, record: dict) -> None:
    write_atomically(Path(path), json.dumps(record, indent=2) + "\n")


def read_json(path: Path) -> dict | None:
    """A record write_json wrote, or None when there is none (or not a whole one)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
