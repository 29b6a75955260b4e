"""What one worker process did, for its exit summary, and the memory probes that summary reads.

Kept out of the loop's module so that a benchmark can time the worker itself (first consumed
record to last commit) from one JSON line, and the loop only adds numbers to a plain record.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass
from typing import Any


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc), for the run summary's memory-per-request figure."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """VmHWM: this process's RSS high-water mark. (ru_maxrss survives exec on Linux, so it would
    report the parent's peak for a worker started by a big process.)"""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class RunStats:
    """What one worker did, logged as one JSON line at exit so a benchmark can time the worker
    itself (first consumed record to last commit), not the replay in front of it."""

    first_consume_at: float | None = None  # wall clock, comparable across worker processes
    last_commit_at: float | None = None
    records: int = 0
    batches: int = 0  # consume() calls that returned records
    generated_tokens: int = 0
    commits: int = 0
    # Commits that did not take (aborted transactions, offsets refused by a rebalance): their
    # input is decoded again by whoever owns the partition next, so a benchmark that sums
    # `generated_tokens` over workers counts that work twice and must be told how much.
    aborted_commits: int = 0
    # Generated tokens decoded since the last commit that took, when a commit failed or the
    # partitions were lost: the redone work behind an over-count of `generated_tokens`.
    redone_tokens: int = 0
    # Transactions refused because the group's generation moved while they were on their way,
    # and committed again unchanged under the new one (nothing redone; see RECOMMIT_ATTEMPTS).
    recommitted_commits: int = 0
    rss_at_first_consume: int = 0
    # Where the loop's time went (seconds): in consume() calls that returned records, in
    # handling them (of which `process_s` inside the processor: parse-free decode work), and in
    # commits. What is left of the wall time was spent waiting for input.
    consume_s: float = 0.0
    handle_s: float = 0.0
    process_s: float = 0.0
    commit_s: float = 0.0
    expire_s: float = 0.0  # in TTL sweeps (part of no other figure)
    # The longest single batch and commit: what a delay tail is made of.
    slowest_handle_s: float = 0.0
    slowest_commit_s: float = 0.0

    def summary(self, active_requests: int, timeline: dict[str, Any] | None = None) -> str:
        return json.dumps(
            {
                "first_consume_at": self.first_consume_at,
                "last_commit_at": self.last_commit_at,
                "records": self.records,
                "batches": self.batches,
                "generated_tokens": self.generated_tokens,
                "commits": self.commits,
                "aborted_commits": self.aborted_commits,
                "redone_tokens": self.redone_tokens,
                "recommitted_commits": self.recommitted_commits,
                "rss_at_first_consume": self.rss_at_first_consume,
                "consume_s": round(self.consume_s, 3),
                "handle_s": round(self.handle_s, 3),
                "process_s": round(self.process_s, 3),
                "commit_s": round(self.commit_s, 3),
                "expire_s": round(self.expire_s, 3),
                "slowest_handle_s": round(self.slowest_handle_s, 3),
                "slowest_commit_s": round(self.slowest_commit_s, 3),
                "rss_at_exit": current_rss_bytes(),
                "peak_rss": peak_rss_bytes(),
                "active_requests": active_requests,
                "timeline": timeline,
            }
        )
