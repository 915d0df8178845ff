"""`python tests/left_running.py COMMAND...`: runs COMMAND as the parent of whatever it
leaves behind (PR_SET_CHILD_SUBREAPER: a process whose parent exits is adopted by this one,
not by init), and once COMMAND has exited (and GRACE_S more) prints, as the last line, a JSON object with its
exit code and the command lines of the processes still alive, which it then stops."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 0.5  # a process on its way out as COMMAND exits: multiprocessing's resource tracker, reading EOF


def children() -> dict[int, str]:
    """This process's children that are alive (not zombies), by pid, with their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found[int(stat.parent.name)] = cmdline
    return found


def main() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("left_running.py: this system cannot adopt orphans (PR_SET_CHILD_SUBREAPER)")
    returncode = subprocess.call(sys.argv[1:])
    sys.stdout.flush()
    deadline = time.monotonic() + GRACE_S
    while (left := children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print("\n" + json.dumps({"returncode": returncode, "left": sorted(left.values())}), flush=True)


if __name__ == "__main__":
    main()
