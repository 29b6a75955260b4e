"""The worker's own timeline from process start to its first committed output, per assignment.

Scaling out is judged by how soon a worker that joins a group does useful work, and the seconds
that takes hide in phases nobody sees from outside: loading the tokenizers, joining the group,
the empty first assignment of a cooperative rebalance, the restore, the first fetch after the
partitions resume, the first transaction that commits. Each phase is logged at INFO as it is
reached (`timeline: ...`) and kept for the run summary, so a benchmark can print where the
seconds went without guessing from the outside.

Times are wall clock (comparable across processes, as the run summary's are), reported relative
to the process start (from /proc, so interpreter start-up and imports count) and, for the phases
of one assignment, relative to that assignment.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("detok.worker")


def process_started_at() -> float:
    """This process's start time (wall clock) from /proc; now where /proc is not there."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as stat:
            # Field 22 (starttime, clock ticks since boot); fields after the ")" that closes the
            # command name, which may itself hold spaces.
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/stat", encoding="ascii") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
    except (OSError, ValueError, StopIteration):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Assignment:
    """One assignment received from the group, and when each of its phases was reached."""

    index: int
    partitions: list[int]
    at: float
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class Timeline:
    """Phases of the worker's life (`mark`) and of each assignment (`mark_partitions`)."""

    started_at: float = field(default_factory=process_started_at)
    phases: dict[str, float] = field(default_factory=dict)
    assignments: list[Assignment] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        """A once-per-process phase (the first occurrence counts)."""
        if phase in self.phases:
            return
        now = time.time()
        self.phases[phase] = now
        log.info("timeline: %s at +%.3f s after process start", phase, now - self.started_at)

    def assigned(self, partitions: list[int]) -> None:
        """An assignment arrived; an empty one (the first round of a cooperative rebalance) is
        the group join, which the worker had no other way to see."""
        self.mark("joined")
        if not partitions:
            return
        now = time.time()
        self.assignments.append(Assignment(len(self.assignments), sorted(partitions), now))
        log.info(
            "timeline: assigned partitions %s at +%.3f s after process start",
            sorted(partitions),
            now - self.started_at,
        )

    def mark_partitions(
        self, phase: str, partitions: Iterable[int], at: float | None = None
    ) -> None:
        """`phase` reached for `partitions`: recorded (the first time) for every assignment
        that holds any of them. `at` is when it happened, if not now (a commit's end)."""
        touched = set(partitions)
        now = time.time() if at is None else at
        for assignment in self.assignments:
            if phase in assignment.phases or touched.isdisjoint(assignment.partitions):
                continue
            assignment.phases[phase] = now
            log.info(
                "timeline: partitions %s: %s at +%.3f s after their assignment "
                "(+%.3f s after process start)",
                assignment.partitions,
                phase,
                now - assignment.at,
                now - self.started_at,
            )

    def summary(self) -> dict[str, Any]:
        """Seconds after process start per phase, and per assignment after the assignment."""
        return {
            "process_started_at": self.started_at,
            "since_start_s": {
                phase: round(at - self.started_at, 3) for phase, at in self.phases.items()
            },
            "assignments": [
                {
                    "partitions": a.partitions,
                    "since_start_s": round(a.at - self.started_at, 3),
                    "since_assignment_s": {
                        phase: round(at - a.at, 3) for phase, at in a.phases.items()
                    },
                }
                for a in self.assignments
            ],
        }
