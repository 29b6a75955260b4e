"""Peak resident memory (and CPU time) of a command, measured so the caller's own memory does not
leak in.

Linux keeps a process's peak RSS across fork and exec (`ru_maxrss` of a child spawned straight
from a large parent reports at least the parent's size at the fork), so the command is started by
a small Python launcher: the command is forked from the launcher, whose memory is a few MiB, and
the launcher reports `RUSAGE_CHILDREN` of its one child. Its CPU time (user + system, all
threads) is reported too: on a host shared by many jobs, wall time mostly measures the wait for a
core, while CPU time is what the command itself spent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_LAUNCHER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "ab"))
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(code, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)
"""


def run_with_peak_rss(
    command: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None
) -> tuple[int, int, float]:
    """Run `command` (its stderr appended to `log`); return its exit code, peak RSS in bytes and
    CPU seconds."""
    launched = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(log), *command],
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        check=True,
    )
    code, peak, cpu = launched.stdout.split()
    return int(code), int(peak), float(cpu)
