"""The worker as a member of its consumer group: settings, assignment callbacks, restore.

The group assigns input partitions in callbacks that run inside the loop's `consume`. They do
no I/O: an assigned partition is marked restoring (`Ownership.begin_restore`), and the loop
restores it from the changelog (`restore_before_handling`) before any of its records is
handled; readiness follows. A revoked partition is committed and forgotten; a lost one is
aborted, never committed, and the rest rolled back.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from pipeline.processor import RequestProcessor
from workers.runtime.changelog import (
    ChangelogPartitionsMissing,
    RestoreInterrupted,
    apply_latest,
    read_latest,
    settled_commits,
)
from workers.runtime.checkpointing import Deadline, FatalWorkerError
from workers.runtime.emitter import Emitter
from workers.runtime.output_limits import changelog_too_small
from workers.runtime.process_policy import StopRequest
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.run_stats import RunStats
from workers.runtime.settings import WorkerSettings
from workers.runtime.timeline import Timeline
from workers.runtime.worker_context import Clients, Ownership, message_of

log = logging.getLogger("detok.worker")

# The input fetch: see `consumer_settings`.
FETCH_MIN_BYTES = 100_000
FETCH_WAIT_MAX_MS = 50
# How soon a member learns that the group rebalances (a worker joined or left): in the classic
# group protocol a member hears of it only in its next heartbeat's answer, and a cooperative
# rebalance takes two rounds, each waiting for every member to notice: the running members
# notice the joining one, then the joining one notices the second round, which starts once the
# others gave up its partitions. At a tenth of the 10 s session timeout (1 s) each notice could
# take a second. At 200 ms a joining worker's partitions still came 0.3-0.5 s after its empty
# first assignment, nearly all of it the second notice. 100 ms bounds each notice, for ten small
# requests a second per worker to the group coordinator (a hundred workers: a thousand
# heartbeats a second, each a lookup in the coordinator's memory).
REBALANCE_NOTICE_MS = 100
# The heartbeat interval is a floor, not a schedule: librdkafka sends a heartbeat only when its
# main thread wakes, and that thread sleeps until its next timer or queued operation, up to a
# second. A member with no partitions (a joining worker between the two rounds) has nothing that
# wakes it: its heartbeats came 400-500 ms apart, and it noticed the second round that long
# after the others had started it (its librdkafka debug log: sync at t, next heartbeat at
# t + 0.50 s, "rebalance in progress"). So the loop wakes that thread once per notice interval
# with the cheapest request it serves (reading the assignment: ~20 us), and each heartbeat goes
# out when due. A member with partitions was thought to be woken by its own fetches, but those
# stop while its prefetch queue is full, which is all the time it drains a backlog: the running
# member of a two-worker drain heartbeat 100-310 ms apart (debug `cgrp`), so it heard of the
# joining worker up to 0.3 s late, and the joiner's first round waited for that. So the loop
# wakes the thread whether or not it has partitions: ten calls a second, ~0.2 ms of them.
GROUP_THREAD_WAKE_S = REBALANCE_NOTICE_MS / 1000
# Bounds the metadata request that follows a rebalance callback (`Membership.rejoin_promptly`): a
# live broker answers in milliseconds; if none does, the loop goes on without it.
REJOIN_METADATA_TIMEOUT_S = 1.0


def consumer_settings(settings: WorkerSettings, metrics: PrometheusMetrics) -> dict[str, Any]:
    """The group consumer's settings: read_committed, cooperative rebalances, prompt notice of
    them, and a fetch sized for full batches (see each comment)."""
    return {
        **membership_settings(settings),
        "group.id": settings.group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "partition.assignment.strategy": "cooperative-sticky",
        "enable.partition.eof": True,
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": min(settings.session_timeout_ms // 10, REBALANCE_NOTICE_MS),
        # librdkafka pre-fetches up to this much per partition. 16 MB is several seconds of
        # input at full speed (events are ~150 bytes), so the decode loop never starves,
        # while 8 partitions at the old 64 MB each let the prefetch alone add ~200 MB of RSS.
        "queued.max.messages.kbytes": 16384,
        # With the default fetch.min.bytes=1 and input arriving continuously, every fetch
        # returned at once with a handful of records: thousands of fetches a second, and the
        # broker serving them took more CPU than the worker itself, starving it (p99 delay
        # 1.8 s at half the maximum rate). Letting the broker gather 100 KB (~700 events) or
        # wait 50 ms, whichever comes first, halved its CPU and brought the p99 to ~0.6 s;
        # 50 ms is a fifth of the default commit interval, the latency floor.
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        "statistics.interval.ms": 5000,
        "stats_cb": metrics.consumer_statistics,
    }


def membership_settings(settings: WorkerSettings) -> dict[str, Any]:
    """Static membership (see `WorkerSettings.static_membership`): nothing when off."""
    if not settings.static_membership:
        return {}
    if "instance_id" not in settings.model_fields_set:
        log.warning(
            "static membership with a random instance id: a restarted worker joins as a new "
            "member, and its old id holds its partitions until the session timeout; "
            "give each replica a stable --instance-id"
        )
    return {"group.instance.id": settings.instance_id}


class Membership:
    """This member's side of the group protocol: the rebalance callbacks, the restore of what
    they assign, and the prompt rejoin after them."""

    def __init__(
        self,
        settings: WorkerSettings,
        processor: RequestProcessor,
        clients: Clients,
        ownership: Ownership,
        emitter: Emitter,
        *,
        metrics: PrometheusMetrics,
        stats: RunStats,
        timeline: Timeline,
        stop: StopRequest,
        deadline: Deadline,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.connection = settings.connection
        self.processor = processor
        self.clients = clients
        self.ownership = ownership
        self.emitter = emitter
        self.metrics = metrics
        self.stats = stats
        self.timeline = timeline
        self.stop = stop
        self.deadline = deadline
        self.rebalanced = False  # a rebalance callback ran since the last step (see the loop)
        self.restore_just_ended = False  # the next consume takes what is fetched (the loop)
        # False once the worker stops on a fatal error: leaving the group must not commit then.
        self.commit_on_revoke = True
        self.fatal: FatalWorkerError | None = None  # met in a callback, raised by the loop

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # No I/O here: restore runs in the main loop, so this callback stays short and bounded
        # (a slow callback is how Quix Streams' workers livelocked in rebalance loops).
        consumer.incremental_assign(partitions)
        numbers = [tp.partition for tp in partitions]
        log.info("assigned partitions %s", numbers)
        self.ownership.joined = True
        self.rebalanced = True
        self.timeline.assigned(numbers)
        self.ownership.assigned.update(numbers)
        if numbers:
            self.ownership.uncommitted.append(set(numbers))
        self.ownership.begin_restore(numbers)  # reports readiness, also for an empty assignment
        self.metrics.rebalances.labels(event="assign").inc()

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = [tp.partition for tp in partitions]
        log.info("revoked partitions %s", numbers)
        self.rebalanced = True
        self.metrics.rebalances.labels(event="revoke").inc()
        if self.commit_on_revoke:
            try:
                self.emitter.commit(in_rebalance_callback=True)
            except (KafkaException, FatalWorkerError) as error:
                self.stats.redone_tokens += self.emitter.checkpoint.decoded_tokens
                log.warning(
                    "commit on revoke failed (%s); the next owner reprocesses", message_of(error)
                )
                if isinstance(error, FatalWorkerError):
                    # Raised from a librdkafka callback it would be lost; the loop raises it.
                    self.fatal = error
        self.release(numbers)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost partitions are already someone else's: never commit for them.
        numbers = [tp.partition for tp in partitions]
        self.metrics.rebalances.labels(event="lost").inc()
        try:
            strategy = self.clients.strategy
            self.emitter.take(strategy.settle(None))  # never committed again: no longer ours
            if strategy.abort():
                self.metrics.observe_abort("partitions_lost")
        except (KafkaException, FatalWorkerError) as error:
            # Raised in a librdkafka callback, it would escape `poll` or `close` as a traceback;
            # the loop raises it instead (a broker gone while leaving the group is one such).
            log.warning("abort after losing partitions %s failed: %s", numbers, message_of(error))
            self.release(numbers)
            if isinstance(error, FatalWorkerError) and self.fatal is None:
                self.fatal = error
            return
        self.release(numbers)
        self.emitter.rollback()

    def release(self, partitions: list[int]) -> None:
        """Forget partitions this worker no longer owns, and their state."""
        self.emitter.drop_state(partitions)
        self.ownership.release(partitions)
        self.metrics.active_requests.set(self.processor.active_requests)

    def restore_before_handling(self, messages: list[Message]) -> list[Message]:
        """Restore the partitions assigned (or rolled back) during the last consume, then pass
        on the batch; records of partitions left unrestored (a stop during the restore) are
        dropped, never handled without their state: uncommitted, they are consumed again by
        whoever owns the partition next. So are those of partitions started over at their
        beginning (`start_uncommitted`), which are fetched again."""
        started_over = self.restore()
        self.restore_just_ended = not self.ownership.restoring
        unhandled = self.ownership.restoring | started_over
        if not unhandled:
            return messages
        return [m for m in messages if m.partition() not in unhandled]

    def restore(self) -> set[int]:
        """Rebuild the state of the restoring partitions from the changelog; returns the
        partitions `start_uncommitted` sent back to their beginning.

        Guarded per changelog record (workers/runtime/changelog.py): a record that cannot be
        restored fails its request, goes to the dead-letter topic, and is counted; the rest restore.
        """
        started = time.perf_counter()
        cpu_started = time.process_time()  # beside the wall time: a loaded host's share of it
        partitions = sorted(self.ownership.restoring)
        self.timeline.mark_partitions("restore started", partitions)
        try:
            committed = settled_commits(
                self.clients.consumer, self.topics.input, partitions, lambda: self.stop.requested
            )
            started_over = self.start_uncommitted(committed)
            skips_ahead = self.clients.strategy.restore_skips_ahead_of_commit
            committed_input = committed if skips_ahead else None
            latest = read_latest(
                self.connection,
                self.settings.group,
                self.topics.changelog,
                partitions,
                lambda: self.stop.requested,
                committed_input,
            )
        except RestoreInterrupted as interrupted:
            log.info("%s; leaving them unrestored", interrupted)
            return set()
        except ChangelogPartitionsMissing as short:
            raise FatalWorkerError(
                changelog_too_small(self.topics, self._input_partitions(), short.partitions)
            ) from None
        restored = apply_latest(latest, self.processor, committed_input)
        del latest  # a million records, for a million open requests: freed before going on
        self.ownership.owners.update(restored.owners)
        # Failed completions of heads that did not restore (issue 32: one completion each).
        self.emitter.emit(restored.failed_requests)
        for letter in restored.failed:
            self.emitter.dead_letter(letter)
            if letter.request_id is not None:
                self.emitter.checkpoint.dirty.add(letter.request_id)
        self.metrics.changelog_records_skipped.inc(len(restored.failed))
        self.ownership.restoring.difference_update(partitions)
        self.timeline.mark_partitions("restored", partitions)
        self.ownership.report_readiness()
        self.metrics.observe_restore(time.perf_counter() - started, len(self.ownership.restoring))
        self.metrics.active_requests.set(self.processor.active_requests)
        log.info(
            "restored %d requests of partitions %s in %.2fs (%.2f s CPU, all threads; %d "
            "changelog records failed)",
            len(restored.owners),
            partitions,
            time.perf_counter() - started,
            time.process_time() - cpu_started,
            len(restored.failed),
        )
        return started_over

    def _input_partitions(self) -> int | None:
        """The input's partition count as the cluster tells it now (None if it does not answer
        at once), for the message that stops the worker."""
        try:
            metadata = self.clients.consumer.list_topics(
                self.topics.input, timeout=self.deadline.remaining(REJOIN_METADATA_TIMEOUT_S)
            )
            return len(metadata.topics[self.topics.input].partitions)
        except (KafkaException, KeyError):
            return None

    def start_uncommitted(self, committed: dict[int, int]) -> set[int]:
        """Start the partitions the group never committed at their beginning now; returns those.

        librdkafka resets a partition without a committed offset (`auto.offset.reset`,
        earliest) only when an offset query timer fires, 100 ms after the assignment (debug
        `topic`: "backoff: (re)starting offset query timer"), so a new group's first records
        came ~0.1 s after its restore for nothing; a seek to the beginning fetches at once
        (first records 6-8 ms after the assignment instead of 104 ms). Its records already in
        the batch being restored (fetched before the seek) are dropped by the caller: the seek
        fetches them again, and none was handled. A seek that fails leaves the partition to
        librdkafka's reset, and its records in the batch are kept.
        """
        started_over = set()
        for partition, offset in committed.items():
            if offset >= 0:
                continue
            try:
                beginning = TopicPartition(self.topics.input, partition, OFFSET_BEGINNING)
                self.clients.consumer.seek(beginning)
            except KafkaException as error:
                log.debug("partition %d starts at librdkafka's reset: %s", partition, error)
                continue
            started_over.add(partition)
        return started_over

    def rejoin_promptly(self) -> None:
        """After a rebalance callback, let this member join the group's next round at once.

        librdkafka (classic group protocol) sends a member's JoinGroup at most once a second,
        and a cooperative rebalance is two rounds: the member that joins and the members that
        revoke partitions for it all join again for the second round, which then waited out
        the rest of that second (a joining worker's timeline: empty first assignment, then its
        partitions 0.94 s later, with nothing else happening). Any metadata response resets that
        interval (librdkafka's rdkafka_metadata.c, `rd_interval_reset(&rkcg_join_intvl)` for
        the classic protocol), so one small request after each callback lets the second round
        start as soon as the coordinator calls for it (a round trip, after the restore when
        there is one: the callbacks that precede a second round bring no partitions to
        restore, and a new assignment's first output should not wait for it). Made here,
        outside the callback: a consumer's own `list_topics` inside its rebalance callback
        aborts the process (see `Emitter.missing_topics`). A failure only means the round starts at
        librdkafka's own pace.
        """
        self.rebalanced = False
        try:
            self.clients.consumer.list_topics(
                self.topics.input, timeout=self.deadline.remaining(REJOIN_METADATA_TIMEOUT_S)
            )
        except KafkaException as error:
            log.debug("metadata request after a rebalance failed: %s", message_of(error))
