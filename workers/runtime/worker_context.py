"""What the worker's parts share: its Kafka clients, and the partitions it owns.

The worker is in parts (workers/runtime/worker.py builds them): the loop (worker_loop.py), group
membership and the restore (membership.py), emitting and committing (emitter.py) and the expiry
sweeps (expiry_sweep.py). They share two objects, never copies of their fields: a client may be
replaced while the worker runs (a new producer after the commit strategy abandoned one), and
a partition's ownership changes in rebalance callbacks that run inside the loop's `consume`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from workers.runtime.checkpointing import CommitStrategy, describe_error
from workers.runtime.health import Health
from workers.runtime.prometheus import PrometheusMetrics


@dataclass
class Clients:
    """The worker's consumer, producer and commit strategy. Every part reads them here, at each
    use: the producer is replaced in process (`Worker._new_producer`)."""

    consumer: Consumer
    producer: Producer
    strategy: CommitStrategy


@dataclass
class Ownership:
    """The input partitions this member owns, their restore and readiness, and the requests
    whose state it holds.

    Changed by the rebalance callbacks (membership.py) and by a rollback (emitter.py); read by
    the loop, the commit and the expiry sweep."""

    health: Health
    metrics: PrometheusMetrics
    owners: dict[str, int] = field(default_factory=dict)  # request id -> input partition
    assigned: set[int] = field(default_factory=set)
    restoring: set[int] = field(default_factory=set)
    at_end: set[int] = field(default_factory=set)
    newest_timestamp: dict[int, float] = field(default_factory=dict)  # newest record time read
    # The partitions of each assignment whose records no commit has carried yet: the first
    # commit that does is not made to wait for the commit interval (`WorkerLoop.commit_due_in`).
    uncommitted: list[set[int]] = field(default_factory=list)
    joined: bool = False  # the group has assigned this member something (maybe nothing)

    def begin_restore(self, partitions: Iterable[int]) -> None:
        """Mark partitions whose state must be restored before any of their records is handled.

        They are not paused: librdkafka fetches their input (the committed-offset lookup, the
        first fetch) while the loop reads the changelog, and `Membership.restore_before_handling`
        restores them before the batch that holds their first records is handled. Pausing them
        instead cost up to a second per assignment: librdkafka's broker thread acts on a resume
        only when it next wakes, which with no fetch in flight is its 1 s idle tick (seen in its
        debug log: resume at t, first fetch decision at t + 0.98 s; confluent-kafka-go#630).
        """
        self.restoring.update(partitions)
        self.metrics.partitions_restoring.set(len(self.restoring))
        self.report_readiness()

    def report_readiness(self) -> None:
        """The readiness hook (workers/runtime/health.py): ready once joined and nothing
        restores."""
        if not self.joined:
            return
        if self.restoring:
            self.health.set_ready(False, f"restoring partitions {sorted(self.restoring)}")
        else:
            self.health.set_ready(True, f"partitions {sorted(self.assigned)} restored")

    def release(self, partitions: list[int]) -> None:
        """Forget partitions this member no longer owns (their requests' state is dropped by
        `Emitter.drop_state`)."""
        gone = set(partitions)
        self.assigned.difference_update(gone)
        self.uncommitted = [p - gone for p in self.uncommitted if p - gone]
        self.restoring.difference_update(gone)
        self.at_end.difference_update(gone)
        self.metrics.partitions_restoring.set(len(self.restoring))
        self.report_readiness()


def message_of(error: BaseException) -> str:
    """An error's text for a log line: a Kafka error described with its code and origin."""
    if isinstance(error, KafkaException) and error.args and isinstance(error.args[0], KafkaError):
        return describe_error(error.args[0])
    return str(error)
