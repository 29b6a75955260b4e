"""How a long-running decode process sets up the interpreter: collector policy and stop signals.

Set by the command that starts a worker (and by benchmarks that want the worker's conditions),
never by the `Worker` constructor: a library object must not change process-wide state that a
test session or another component in the same process relies on.
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Callable

log = logging.getLogger("detok.worker")

# Allocations between young-generation garbage collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 100_000


def tune_garbage_collector() -> None:
    """Set the collector up for a throughput process, once its long-lived tables exist.

    Call after the decode tables are built (`RequestProcessor.warm_up`).
    """
    # The tokenizers' decode tables are long-lived containers (tens of thousands of tracked
    # objects for three models); left in the collector's care, every full collection would walk
    # them all again. They live as long as the process, so take them out of collection for good.
    gc.freeze()
    # Each batch allocates thousands of short-lived objects (events, origins, deltas) while
    # the live request state is large and long-lived. With the default thresholds (a young
    # collection every 700 allocations) the collector ran dozens of times per batch and its
    # older-generation passes re-walked the whole request state: 25-35% of the processing
    # time in the core benchmark. Our objects rarely form cycles (refcounting frees them), so
    # collecting far less often only delays the rare cyclic garbage.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 50, 100)


class StopRequest:
    """SIGTERM and SIGINT as a flag the worker's waits poll, plus callbacks run on the first.

    Installed by the command before anything waits on the broker, so a stop during start-up (a
    broker that does not answer, a long restore) is honoured as promptly as one mid-stream.
    """

    def __init__(self) -> None:
        self.requested = False
        self._callbacks: list[Callable[[], None]] = []

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def on_stop(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def request(self) -> None:
        if self.requested:
            return
        self.requested = True
        for callback in self._callbacks:
            callback()

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("signal %s: finishing the batch, committing, leaving the group", signum)
        self.request()
