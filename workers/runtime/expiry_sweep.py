"""The worker's TTL sweeps: requests idle past their TTL end with a failed completion.

The processor decides which requests expired (contract 4); this module says when to ask it
(spaced by what a sweep costs) and against which clock each request's idleness is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pipeline.processor import RequestProcessor
from workers.runtime.emitter import Emitter
from workers.runtime.run_stats import RunStats
from workers.runtime.worker_context import Ownership

# TTL sweeps walk every request; once a second is plenty for TTLs measured in minutes.
EXPIRE_INTERVAL_S = 1.0
# Requests one sweep may end. Each expiry is a completion, a dead letter and a snapshot, all in
# the next commit: 200k requests expiring together (a producer fleet restarted) made one
# transaction of ~600k records and tripled the worker's memory. 5,000 per sweep keeps a commit
# to ~15k extra records and still drains 200k in under a minute.
EXPIRE_LIMIT = 5000
# A sweep is followed by at least this many times its own duration without one: sweeps then cost
# at most 2% of the loop however many requests are open (see `ExpirySweep.run`).
SWEEP_SPACING = 50


def next_sweep_interval(took_s: float, *, ended: int) -> float:
    """Seconds until the next TTL sweep, after one that took `took_s` and ended `ended` requests.

    A sweep that hit EXPIRE_LIMIT leaves more due: their expiries are work owed, not a scan to
    space out, so the next sweep comes after EXPIRE_INTERVAL_S. Spacing by such a sweep's time
    (a second or more to end 5,000 requests on a loaded host) put each next 5,000 a minute later.
    """
    if ended >= EXPIRE_LIMIT:
        return EXPIRE_INTERVAL_S
    return max(EXPIRE_INTERVAL_S, took_s * SWEEP_SPACING)


class ExpirySweep:
    """When the next sweep is due, and the sweep itself (its outputs go to the emitter)."""

    def __init__(
        self, processor: RequestProcessor, ownership: Ownership, emitter: Emitter, stats: RunStats
    ) -> None:
        self.processor = processor
        self.ownership = ownership
        self.emitter = emitter
        self.stats = stats
        self.last_at = time.monotonic()
        self.interval_s = EXPIRE_INTERVAL_S

    def due(self) -> bool:
        return time.monotonic() - self.last_at >= self.interval_s

    def run(self, now: float) -> None:
        """The TTL sweep, spaced so that it costs at most 1/SWEEP_SPACING of the loop.

        A sweep looks at every open request (a cheap filter, then the few old ones in full),
        so its cost grows with them: ~0.2 s for a million on this kind of host, a fifth of a
        loop that swept every second. The next sweep waits SWEEP_SPACING times as long as this
        one took (never less than EXPIRE_INTERVAL_S): expiries come that much later (seconds,
        against TTLs of minutes), and the loop keeps its time.
        """
        started = time.perf_counter()
        result = self.processor.expire(self.ttl_reference(now), limit=EXPIRE_LIMIT, latest=now)
        self.emitter.emit(result)
        took = time.perf_counter() - started
        self.stats.expire_s += took
        self.last_at = time.monotonic()
        self.interval_s = next_sweep_interval(took, ended=len(result.touched))

    def ttl_reference(self, now: float) -> Callable[[str], float]:
        """The time a request's idleness is measured against (contract 4).

        Wall clock once its partition is caught up; until then, the newest record time consumed
        from that partition. A backlog (after an outage, or lag) never expires requests whose
        events are still waiting in it: their partition's clock only moves as they are read.
        """
        ownership = self.ownership
        owners, at_end, newest = ownership.owners, ownership.at_end, ownership.newest_timestamp

        def reference(request_id: str) -> float:
            partition = owners.get(request_id)
            if partition is None or partition in at_end:
                return now
            return newest.get(partition, float("-inf"))

        return reference
