"""Peak resident memory of a command, measured so the caller's own memory does not leak in.

Linux keeps a process's peak RSS across fork and exec (`ru_maxrss` of a child spawned straight
from a large parent reports at least the parent's size at the fork), so the command is started by
a small Python launcher: the command is forked from the launcher, whose memory is a few MiB, and
the launcher reports `RUSAGE_CHILDREN` of its one child.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_LAUNCHER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "ab"))
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def run_with_peak_rss(
    command: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None
) -> tuple[int, int]:
    """Run `command` (its stderr appended to `log`); return its exit code and peak RSS in bytes."""
    launched = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(log), *command],
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        check=True,
    )
    code, peak = launched.stdout.split()
    return int(code), int(peak)
