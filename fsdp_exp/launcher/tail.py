"""The new lines of a file another process is writing (a rank's log, a task's stdout)."""

from __future__ import annotations

from pathlib import Path


class NewLines:
    def __init__(self, path: Path, offset: int = 0):
        self.path = Path(path)
        self.offset = offset
        self.partial = b""

    def read(self, final: bool = False) -> list[bytes]:
        """The complete lines written since the last call; with `final`, the unfinished
        last line too."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        return lines
