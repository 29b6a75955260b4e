"""The Kafka worker: consume token-id events, decode, produce text.

One loop, consume-transform-produce:

    consume a batch -> record handling (parse, check key and partition, process; a record that
    fails in any way is dead-lettered, never the stream) -> completions, filtered-id records and
    dead letters kept in the checkpoint, deltas coalesced per request -> every commit interval:
    those outputs, changelog snapshots of the requests touched, and the consumed offsets, handed
    to the commit strategy (exactly-once: one transaction, committed on a committer thread while
    the loop decodes on; at-least-once: outputs flushed, then offsets).

Per-request state (a `DecodeStream` window, the text so far, the expected seq) lives in the
processor, keyed by request id and owned by the input partition its events arrive on; the
changelog (workers/changelog.py) rebuilds it on assignment.

Failure model: a crash loses what was not committed; the next owner restores the committed
snapshots and re-consumes from the committed offsets. An abortable error does the same inside
the process (abort, restore, rewind), and so does a producer that became unusable (its
sequence state lost, a call wedged in the client): the commit strategy replaces it with a new
one under the same transactional id, which fences the old one and aborts its transaction. A
transaction refused only because the group moved to a new generation (a rebalance) is instead
committed again unchanged under the new one (workers/checkpointing.py, RECOMMIT_ATTEMPTS). A
broker-level fatal error (fenced, not authorised, a broker gone past every bound) stops the
worker with a non-zero exit and a message naming the cause, for the orchestrator to restart it.
Every wait is bounded and ends on SIGTERM; once stopping, the worker is gone within
`shutdown_timeout_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from pipeline.processor import BatchResult, DeadLetter, RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason, dump_json
from workers.changelog import (
    SETTLE_LOOKUP_TIMEOUT_S,
    RestoreInterrupted,
    apply_latest,
    changelog_record,
    read_latest,
    settled_commits,
)
from workers.checkpointing import (
    CALL_TIMEOUT_S,
    Checkpoint,
    CommitOutcome,
    Deadline,
    FatalWorkerError,
    Output,
    ProducerFailed,
    describe_error,
    strategy_for,
)
from workers.config import WorkerSettings
from workers.health import Health
from workers.kafka_clients import AUTHORIZATION_ERRORS, make_consumer, make_producer
from workers.output_limits import OutputLimits
from workers.output_writer import OutputWriter
from workers.process_policy import StopRequest
from workers.prometheus import PrometheusMetrics
from workers.record_handling import handle_batch, unexpected
from workers.run_stats import RunStats, current_rss_bytes
from workers.timeline import Timeline

log = logging.getLogger("detok.worker")

# Bounds the consumer's blocking lookups (committed offsets, metadata) while running; shortened
# further by the shutdown deadline once stopping.
KAFKA_TIMEOUT_S = 30.0
# Longest wait for a consume batch to fill: long enough that a busy input gives full batches
# (one decode round amortised over max_batch events), short enough to notice signals promptly.
CONSUME_WAIT_S = 0.1
# The consume wait while no partition is assigned. The group's assignment arrives in a callback
# inside `consume`, which then keeps waiting for records until its timeout: with CONSUME_WAIT_S
# a joining worker started its restore up to 100 ms after being assigned (seen in its timeline:
# restore started +0.076 s). An unassigned worker has no batch to fill, so it waits briefly and
# starts the restore within 10 ms, for a hundred cheap wake-ups a second while it waits to join.
UNASSIGNED_WAIT_S = 0.01
# How long a consume waits while a due commit waits for the previous transaction to end.
SETTLE_POLL_S = 0.005
# The input fetch: see `_consumer_settings`.
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
# Bounds the metadata request that follows a rebalance callback (`Worker._rejoin_promptly`): a
# live broker answers in milliseconds; if none does, the loop goes on without it.
REJOIN_METADATA_TIMEOUT_S = 1.0
# TTL sweeps walk every request; once a second is plenty for TTLs measured in minutes.
EXPIRE_INTERVAL_S = 1.0
# Requests one sweep may end. Each expiry is a completion, a dead letter and a snapshot, all in
# the next commit: 200k requests expiring together (a producer fleet restarted) made one
# transaction of ~600k records and tripled the worker's memory. 5,000 per sweep keeps a commit
# to ~15k extra records and still drains 200k in under a minute.
EXPIRE_LIMIT = 5000
# A sweep is followed by at least this many times its own duration without one: sweeps then cost
# at most 2% of the loop however many requests are open (see `Worker._sweep`).
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


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        registry: TokenizerRegistry,
        metrics: PrometheusMetrics,
        limits: OutputLimits,
        stop: StopRequest | None = None,
        health: Health | None = None,
    ) -> None:
        self.settings = settings
        self.health = health or Health()
        self.topics = settings.topics
        self.connection = settings.connection
        self.metrics = metrics
        self.limits = limits
        self.processor = RequestProcessor(
            registry,
            unknown_generated_ids=settings.unknown_generated_ids,
            request_ttl_s=settings.request_ttl_s,
            finished_retention_s=settings.finished_retention_s,
            max_text_bytes=limits.max_text_bytes(settings.topics),
            max_held_bytes=limits.max_held_bytes(settings.topics),
        )
        self.processor.warm_up()
        self.stop = stop or StopRequest()
        self.deadline = Deadline()
        self.stop.on_stop(self._stopping)
        self.strategy = strategy_for(settings.guarantee, settings.transactional_id, self.deadline)
        self.owners: dict[str, int] = {}  # request id -> input partition, for requests with state
        self.assigned: set[int] = set()
        # The partitions of each assignment whose records no commit has carried yet: the first
        # commit that does is not made to wait for the commit interval (`_commit_due_in`).
        self.uncommitted: list[set[int]] = []
        self._rebalanced = False  # a rebalance callback ran since the last step (see there)
        self._restore_just_ended = False  # the next consume takes what is fetched (see _step)
        self._group_thread_woken_at = 0.0  # monotonic; see GROUP_THREAD_WAKE_S
        self.joined = False  # the group has assigned this member something (maybe nothing)
        self.restoring: set[int] = set()
        self.at_end: set[int] = set()
        self.newest_timestamp: dict[int, float] = {}  # partition -> newest record time consumed
        self.checkpoint = Checkpoint.fresh()
        self.running = True
        self.last_message_at = time.monotonic()
        self.last_expire_at = time.monotonic()
        self.expire_interval_s = EXPIRE_INTERVAL_S
        # False once the worker stops on a fatal error: leaving the group must not commit then.
        self._commit_on_revoke = True
        self._fatal: FatalWorkerError | None = None  # met in a callback, raised by the loop
        self.stats = RunStats()
        self.timeline = Timeline()
        # The input partitions of the commit whose outcome `_take` gets next (one is in flight
        # at most): what the timeline's "first commit" of an assignment is told about.
        self._committing: list[int] = []
        self.consumer: Consumer = make_consumer(self.connection, self._consumer_settings())
        self.producer = make_producer(self.connection, self._producer_settings())
        self.writer = OutputWriter(
            self.producer,
            limits,
            self.topics,
            self.processor,
            metrics,
            group=settings.group,
            instance_id=settings.instance_id,
        )
        self.timeline.mark("worker built")

    # -- configuration ------------------------------------------------------------------------

    def _consumer_settings(self) -> dict[str, Any]:
        return {
            **self._membership_settings(),
            "group.id": self.settings.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.partition.eof": True,
            "session.timeout.ms": self.settings.session_timeout_ms,
            "heartbeat.interval.ms": min(
                self.settings.session_timeout_ms // 10, REBALANCE_NOTICE_MS
            ),
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
            "stats_cb": self.metrics.consumer_statistics,
        }

    def _membership_settings(self) -> dict[str, Any]:
        """Static membership (see `WorkerSettings.static_membership`): nothing when off."""
        if not self.settings.static_membership:
            return {}
        if "instance_id" not in self.settings.model_fields_set:
            log.warning(
                "static membership with a random instance id: a restarted worker joins as a new "
                "member, and its old id holds its partitions until the session timeout; "
                "give each replica a stable --instance-id"
            )
        return {"group.instance.id": self.settings.instance_id}

    def _producer_settings(self) -> dict[str, Any]:
        return {
            # Deltas and snapshots are produced at commit, and a commit sends at once whatever
            # lingers; so linger only batches the completions and filtered-id records produced
            # between commits, and 20 ms (librdkafka's guide: > 5 ms for throughput) does that
            # without adding to the delay a reader sees.
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            # As large as the largest topic takes: each record is checked against its own
            # topic's limit before it is produced (workers/output_limits.py).
            "message.max.bytes": self.limits.producer_message_max_bytes(),
            **self.strategy.producer_settings(),
        }

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self) -> int:
        """Process until stopped by a signal, by `exit_when_idle_s`, or by a fatal error."""
        try:
            if not self._start_producer():
                return 0
            self.consumer.subscribe(
                [self.topics.input],
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self.timeline.mark("subscribed")
            while self.running and not self.stop.requested:
                self._step()
            self.commit()
        except (FatalWorkerError, KafkaException) as error:
            self._stopping()  # leaving after a failure is bounded like leaving on SIGTERM
            log.error("stopping without commit: %s%s", _message(error), self._missing_topics())
            self._close(abort=True)
            return 1
        self._close(abort=False)
        log.info(
            "run summary %s",
            self.stats.summary(self.processor.active_requests, self.timeline.summary()),
        )
        return 0

    def _start_producer(self) -> bool:
        """Initialise the producer (exactly-once: fence the predecessor with our transactional
        id, aborting its open transaction); False if a stop ended the wait for that.

        A stop during the wait keeps initialising until the shutdown deadline, because that
        fencing is what lets the group's next owner of our partitions restore at once rather
        than after the predecessor's transaction timeout. If the deadline ends it first, the
        stop is still a clean one: nothing was consumed or produced, nothing of ours is open.
        (A worker restarted while a broker was down was stopped so, and exited 1 as if it had
        failed.)"""
        try:
            self.strategy.start(self.producer, self._new_producer)
        except FatalWorkerError as error:
            if not self.stop.requested:
                raise
            log.warning("stopped before the producer was ready, nothing consumed: %s", error)
            self._close(abort=False)
            return False
        self.timeline.mark("producer ready")
        return True

    def _new_producer(self, cause: str) -> Producer:
        """A producer in place of one the commit strategy abandoned (`cause`: a label of
        REPLACEMENT_CAUSES in workers/checkpointing.py), with the same settings and so the same
        transactional id; everything that produces uses it from now on."""
        self.metrics.producer_replacements.labels(cause=cause).inc()
        self.producer = make_producer(self.connection, self._producer_settings())
        self.writer.producer = self.producer
        return self.producer

    def _stopping(self) -> None:
        self.deadline.set_in(self.settings.shutdown_timeout_s)

    def _close(self, abort: bool) -> None:
        self.strategy.close()
        if abort:
            try:
                if self.strategy.abort():
                    self.metrics.observe_abort("stopping_on_error")
            except (KafkaException, FatalWorkerError) as error:
                log.warning("abort at shutdown failed: %s", _message(error))
        self._commit_on_revoke = not abort
        self._leave_group()
        try:
            self.producer.flush(self.deadline.remaining(KAFKA_TIMEOUT_S))
        except KafkaException as error:
            log.warning("flush at shutdown failed: %s", _message(error))

    def _leave_group(self) -> None:
        """Close the consumer (it leaves the group; on a clean stop our revoke callback commits
        what is open), waiting for it until the shutdown deadline at most.

        With the group coordinator gone, closing waits for every offset commit still queued for
        it, and librdkafka's commits have no timeout (at-least-once, a broker killed between a
        commit's flush and its offsets: the close still waited 60 s later, one socket timeout
        after another). A stopping worker must be gone by its deadline, so past it the close is
        left on its own thread and the worker exits; the group drops the member by its session
        timeout, as after a kill."""
        closing = threading.Thread(target=self._close_consumer, daemon=True, name="detok-leave")
        closing.start()
        # A close is given one client call's time even past the deadline: a stop that ended a
        # commit at the deadline still leaves the group when the cluster answers.
        closing.join(max(self.deadline.remaining(KAFKA_TIMEOUT_S), CALL_TIMEOUT_S))
        if closing.is_alive():
            log.warning(
                "leaving the group did not finish %s (no group coordinator); exiting without it",
                self.deadline.describe(KAFKA_TIMEOUT_S),
            )

    def _close_consumer(self) -> None:
        try:
            self.consumer.close()
        except (KafkaException, FatalWorkerError) as error:
            log.warning("leaving the group failed: %s", _message(error))

    def _missing_topics(self) -> str:
        """Name a pipeline topic that is gone: a deleted output topic otherwise surfaces as a
        transaction error whose text blames fencing or timeouts.

        Asked through the producer: this runs in the consumer's revoke and lost callbacks too (a
        rollback there), and the consumer's own `list_topics` inside its callback aborts the
        process (confluent-kafka's `CallState_get: Assertion cs != NULL`; seen in the 2-worker
        bench when a rebalance aborted a transaction).
        """
        try:
            metadata = self.producer.list_topics(timeout=self.deadline.remaining(5.0))
        except KafkaException:
            return ""
        missing = [t for t in self.topics.model_dump().values() if t not in metadata.topics]
        if not missing:
            return ""
        return f"; topic(s) {', '.join(missing)} no longer exist (deleted while the worker ran?)"

    # -- the loop -----------------------------------------------------------------------------

    def _step(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        self.health.step()
        # consume() waits until the batch is full or the timeout ends; never past the commit
        # deadline, or at moderate rates every commit (and so every delta) comes up to a whole
        # wait late. A commit that is due while the previous transaction is still committing
        # waits for it here, decoding on, instead of in `settle`: under load a transaction took
        # up to 3 s, and the loop that waited for it let that much input queue up behind it.
        due_in = self._commit_due_in()
        if due_in <= 0 and self.strategy.committing():
            due_in = SETTLE_POLL_S  # not 0: that would spin until the transaction ends
        wait = CONSUME_WAIT_S if self.assigned else UNASSIGNED_WAIT_S
        if self._restore_just_ended:
            # The restored partitions fetched while the changelog was read; their records are
            # taken now, not after waiting for a full batch, which held a joining worker's first
            # records ~100 ms (debug `consume`: 1,574 records queued 5 ms after the assignment,
            # restored at +0.076 s, first records at +0.173 s: one whole batch wait).
            wait, self._restore_just_ended = 0.0, False
        self._wake_group_thread()
        consume_started = time.perf_counter()
        messages = self.consumer.consume(self.settings.max_batch, min(wait, max(due_in, 0.0)))
        if self.restoring:
            messages = self._restore_before_handling(messages)
        if self._rebalanced:  # after the restore: a join's first output waits for that, not this
            self._rejoin_promptly()
        now = time.time()
        if messages:
            handle_started = time.perf_counter()
            self.stats.consume_s += handle_started - consume_started
            self.stats.batches += 1
            self._handle(messages, now)
            handled_in = time.perf_counter() - handle_started
            self.stats.handle_s += handled_in
            self.stats.slowest_handle_s = max(self.stats.slowest_handle_s, handled_in)
        if time.monotonic() - self.last_expire_at >= self.expire_interval_s:
            self._sweep(now)
        if self._commit_due_in() <= 0 and not self.strategy.committing():
            self.commit(wait=False)
        self.producer.poll(0)
        if self._idle_long_enough():
            log.info("every assigned partition is at its end and idle; stopping")
            self.running = False

    def _wake_group_thread(self) -> None:
        """Let librdkafka's main thread send a heartbeat that is due (see GROUP_THREAD_WAKE_S):
        reading the assignment is an operation that thread serves, and after serving one it
        runs the group's housekeeping, heartbeats included."""
        now = time.monotonic()
        if now - self._group_thread_woken_at >= GROUP_THREAD_WAKE_S:
            self._group_thread_woken_at = now
            self.consumer.assignment()

    def _rejoin_promptly(self) -> None:
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
        aborts the process (see `_missing_topics`). A failure only means the round starts at
        librdkafka's own pace.
        """
        self._rebalanced = False
        try:
            self.consumer.list_topics(
                self.topics.input, timeout=self.deadline.remaining(REJOIN_METADATA_TIMEOUT_S)
            )
        except KafkaException as error:
            log.debug("metadata request after a rebalance failed: %s", _message(error))

    def _commit_due_in(self) -> float:
        """Seconds until the next commit is due: a commit interval after the last one began, or
        now when the checkpoint holds the first records of an assignment not yet committed.

        A worker that was just assigned partitions (it joined, or took over a leaver's) has no
        output visible for them until its first commit; waiting out the interval there only
        adds to that delay (up to 250 ms of a join's first second). One early commit per
        assignment costs one small transaction; every later one keeps the interval.
        """
        if any(not fresh.isdisjoint(self.checkpoint.offsets) for fresh in self.uncommitted):
            return 0.0
        elapsed = time.monotonic() - self.checkpoint.started_at
        return self.settings.commit_interval_ms / 1000 - elapsed

    def _sweep(self, now: float) -> None:
        """The TTL sweep, spaced so that it costs at most 1/SWEEP_SPACING of the loop.

        A sweep looks at every open request (a cheap filter, then the few old ones in full),
        so its cost grows with them: ~0.2 s for a million on this kind of host, a fifth of a
        loop that swept every second. The next sweep waits SWEEP_SPACING times as long as this
        one took (never less than EXPIRE_INTERVAL_S): expiries come that much later (seconds,
        against TTLs of minutes), and the loop keeps its time.
        """
        started = time.perf_counter()
        result = self.processor.expire(self.ttl_reference(now), limit=EXPIRE_LIMIT, latest=now)
        self._emit(result)
        took = time.perf_counter() - started
        self.stats.expire_s += took
        self.last_expire_at = time.monotonic()
        self.expire_interval_s = next_sweep_interval(took, ended=len(result.touched))

    def ttl_reference(self, now: float) -> Callable[[str], float]:
        """The time a request's idleness is measured against (contract 4).

        Wall clock once its partition is caught up; until then, the newest record time consumed
        from that partition. A backlog (after an outage, or lag) never expires requests whose
        events are still waiting in it: their partition's clock only moves as they are read.
        """
        owners, at_end, newest = self.owners, self.at_end, self.newest_timestamp

        def reference(request_id: str) -> float:
            partition = owners.get(request_id)
            if partition is None or partition in at_end:
                return now
            return newest.get(partition, float("-inf"))

        return reference

    def _idle_long_enough(self) -> bool:
        idle_limit = self.settings.exit_when_idle_s
        # A worker that was never assigned anything has not seen the input yet (its group may
        # still be waiting for a dead member's session to expire); it must not call that idle.
        # An empty assignment is not "at the end": in a cooperative rebalance a joining member
        # first gets nothing and its partitions a round later.
        if idle_limit is None or not self.assigned or self.restoring:
            return False
        if not self.at_end >= self.assigned:
            return False
        return time.monotonic() - self.last_message_at >= idle_limit

    def _handle(self, messages: list[Message], now: float) -> None:
        if self.stats.first_consume_at is None:
            self.stats.first_consume_at = now
            self.stats.rss_at_first_consume = current_rss_bytes()
        records = []  # partition EOFs and consumer errors are messages too, but not records
        for message in messages:
            error = message.error()
            if error is None:
                self.at_end.discard(message.partition())
                records.append(message)
            elif error.code() == KafkaError._PARTITION_EOF:
                self.at_end.add(message.partition())
            elif error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise FatalWorkerError(f"input topic {self.topics.input} does not exist")
            elif error.fatal() or error.code() in AUTHORIZATION_ERRORS:  # no retry grants an ACL
                raise FatalWorkerError(f"consumer: {describe_error(error)}")
            else:
                log.warning("consumer error: %s", error)
        self.last_message_at = time.monotonic()
        if not records:
            return
        started = time.perf_counter()
        handled = handle_batch(records, self.processor, self.owners, now)
        processed_in = time.perf_counter() - started
        self.stats.process_s += processed_in
        self.checkpoint.offsets.update(handled.next_offsets)
        self.timeline.mark_partitions("first records", handled.next_offsets)
        for partition, seconds in handled.newest_timestamp.items():
            if seconds > self.newest_timestamp.get(partition, float("-inf")):
                self.newest_timestamp[partition] = seconds
        self.owners.update(handled.new_owners)
        for letter in handled.dead_letters:
            self._dead_letter(letter)
        result = handled.result
        if handled.events:
            self.metrics.observe_batch(result, handled.events, processed_in)
        self.stats.generated_tokens += result.decoded_tokens
        self.checkpoint.decoded_tokens += result.decoded_tokens
        self._emit(result)
        self.metrics.observe_consumed(handled.records, now)
        self.stats.records += handled.records

    def _emit(self, result: BatchResult) -> None:
        deltas = self.checkpoint.deltas
        for delta in result.deltas:
            previous = deltas.get(delta.request_id)
            if previous is None:
                deltas[delta.request_id] = delta
            else:
                previous.absorb(delta)
        outputs = self.checkpoint.outputs
        for completion in result.completions:
            request_id = completion.request_id
            outputs.append(
                Output(
                    self.topics.completions,
                    request_id.encode(),
                    dump_json(completion),
                    request_id=request_id,
                )
            )
        for record in result.filtered_ids:
            request_id = record.request_id
            outputs.append(
                Output(
                    self.topics.metrics,
                    request_id.encode(),
                    dump_json(record),
                    request_id=request_id,
                )
            )
        for letter in result.dead_letters:
            self._dead_letter(letter)
        self.checkpoint.dirty |= result.touched
        self.metrics.observe_outputs(result)

    def _dead_letter(self, letter: DeadLetter) -> None:
        self.checkpoint.outputs.append(self.writer.dead_letter(letter))

    # -- commit -------------------------------------------------------------------------------

    def commit(self, wait: bool = True, in_rebalance_callback: bool = False) -> None:
        """Produce the checkpoint's records and commit them with its offsets.

        Under exactly-once the transaction commits on the committer thread; `wait=False` (the
        loop's periodic commit) returns at once and the next commit settles it first. Every
        other caller (shutdown, a revoke) waits for the outcome.
        """
        started = time.perf_counter()
        self._take(self.strategy.settle(self.consumer))  # may roll back: a new checkpoint
        checkpoint = self.checkpoint
        if checkpoint.empty:
            checkpoint.started_at = time.monotonic()
            if not self.strategy.committing():
                self.metrics.observe_caught_up()
            return
        self.writer.produced = [] if self.strategy.keeps_records else None
        try:
            self._produce(checkpoint)
        except ProducerFailed as failure:
            self.strategy.producer_failed(failure)
        records, self.writer.produced = self.writer.produced or [], None
        offsets = [
            TopicPartition(self.topics.input, partition, offset)
            for partition, offset in sorted(checkpoint.offsets.items())
        ]
        self.checkpoint = Checkpoint.fresh()
        self._committing = list(checkpoint.offsets)
        self.uncommitted = [p for p in self.uncommitted if p.isdisjoint(checkpoint.offsets)]
        outcome = self.strategy.commit(
            self.consumer, offsets, checkpoint.decoded_tokens, records, in_rebalance_callback
        )
        self.stats.commit_s += time.perf_counter() - started
        if outcome is None and wait:
            outcome = self.strategy.settle(self.consumer)
        self._take(outcome)

    def _produce(self, checkpoint: Checkpoint) -> None:
        for output in checkpoint.outputs:
            self.writer.write(output)
        for request_id, delta in checkpoint.deltas.items():
            self.writer.write(
                Output(
                    self.topics.deltas,
                    request_id.encode(),
                    delta.to_wire_json(),
                    request_id=request_id,
                )
            )
        self.metrics.deltas_produced.inc(len(checkpoint.deltas))
        self._write_changelog(checkpoint)

    def _take(self, outcome: CommitOutcome | None) -> None:
        """Account for a finished commit; roll back or re-offer what did not take."""
        if outcome is None:
            return
        self.stats.recommitted_commits += outcome.recommits > 0  # transactions, not attempts
        if outcome.committed:
            self.stats.commits += 1
            self.stats.last_commit_at = outcome.finished_at
            self.metrics.observe_caught_up()
            self.timeline.mark_partitions("first commit", self._committing, outcome.finished_at)
        else:
            self.stats.aborted_commits += 1
            moved = any(p not in self.assigned for p in outcome.refused_offsets)
            if outcome.rollback or moved:  # decoded again, here or by the partition's new owner
                self.stats.redone_tokens += outcome.decoded_tokens
        self.stats.slowest_commit_s = max(self.stats.slowest_commit_s, outcome.seconds)
        self.metrics.observe_commit(outcome.seconds, outcome.committed, outcome.recommits > 0)
        self.metrics.active_requests.set(self.processor.active_requests)
        if outcome.abort_cause is not None:
            self.metrics.observe_abort(outcome.abort_cause)
        if outcome.rollback:
            # Retrying a batch aborted because a pipeline topic was deleted aborts again, forever
            # (each retry writes to the same missing topic): that is fatal, and named.
            if self._missing_topics():
                raise FatalWorkerError("the transaction was aborted")
            self._rollback()
        # The outputs are out; only the offsets were refused, by a rebalance. Partitions we kept
        # (cooperative rebalances keep most) offer them again with the next commit: dropped, an
        # idle partition's committed offset would lag behind its end forever.
        for partition, offset in outcome.refused_offsets.items():
            if partition in self.assigned:
                self.checkpoint.offsets.setdefault(partition, offset)

    def _write_changelog(self, checkpoint: Checkpoint) -> None:
        for request_id in checkpoint.dirty:
            partition = self.owners.get(request_id)
            if partition is None:
                continue
            records = self._changelog_records(request_id)  # may fail the request first
            state = self.processor.requests.get(request_id)
            for key, value in records:
                if self.processor.requests.get(request_id) is not state:
                    break  # a record too large failed the request, and wrote its marker
                self.writer.write(
                    changelog_record(
                        self.topics.changelog,
                        request_id,
                        value,
                        partition,
                        checkpoint.offsets.get(partition, -1),
                        key=key,
                    )
                )
            if state is None:
                del self.owners[request_id]

    def _changelog_records(self, request_id: str) -> list[tuple[bytes, bytes | None]]:
        """The request's changelog records (incremental: new text and a small head); a request
        whose state cannot be encoded fails (with an `unexpected_error` dead letter naming it)
        instead of the commit."""
        try:
            return self.processor.changelog_records(request_id)
        except Exception as error:
            log.warning("snapshot of request %s failed: %r", request_id, error)
            self.writer.write_failure(
                self.processor.mark_failed(request_id, DeadLetterReason.UNEXPECTED_ERROR)
            )
            letter = unexpected(error, None, request_id, None)
            self.writer.write_stand_in(letter, keep_original=True)
            return self.processor.changelog_records(request_id)

    def _rollback(self) -> None:
        """After an abort: forget uncommitted state, restore it, re-consume from the commit."""
        partitions = sorted(self.assigned)
        self.stats.redone_tokens += self.checkpoint.decoded_tokens
        self.checkpoint = Checkpoint.fresh()
        self._drop_state(partitions)
        if not partitions:
            return
        try:
            committed = settled_commits(
                self.consumer,
                self.topics.input,
                partitions,
                lambda: self.stop.requested,
                self.deadline.remaining(SETTLE_LOOKUP_TIMEOUT_S),
            )
        except RestoreInterrupted as interrupted:
            # Stopping: left unrestored, the partitions' records are dropped unhandled, and
            # nothing of them is committed; their next owner reprocesses from the commit.
            log.info("%s; not rewinding partitions %s", interrupted, partitions)
            committed = {}
        for partition, committed_offset in committed.items():
            offset = committed_offset if committed_offset >= 0 else OFFSET_BEGINNING
            try:
                self.consumer.seek(TopicPartition(self.topics.input, partition, offset))
            except KafkaException:
                log.warning("rewind of partition %d failed", partition, exc_info=True)
        self._begin_restore(partitions)

    # -- rebalance and restore ----------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # No I/O here: restore runs in the main loop, so this callback stays short and bounded
        # (a slow callback is how Quix Streams' workers livelocked in rebalance loops).
        consumer.incremental_assign(partitions)
        numbers = [tp.partition for tp in partitions]
        log.info("assigned partitions %s", numbers)
        self.joined = True
        self._rebalanced = True
        self.timeline.assigned(numbers)
        self.assigned.update(numbers)
        if numbers:
            self.uncommitted.append(set(numbers))
        self._begin_restore(numbers)  # reports readiness, also for an empty assignment
        self.metrics.rebalances.labels(event="assign").inc()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = [tp.partition for tp in partitions]
        log.info("revoked partitions %s", numbers)
        self._rebalanced = True
        self.metrics.rebalances.labels(event="revoke").inc()
        if self._commit_on_revoke:
            try:
                self.commit(in_rebalance_callback=True)
            except (KafkaException, FatalWorkerError) as error:
                self.stats.redone_tokens += self.checkpoint.decoded_tokens
                log.warning(
                    "commit on revoke failed (%s); the next owner reprocesses", _message(error)
                )
                if isinstance(error, FatalWorkerError):
                    # Raised from a librdkafka callback it would be lost; the loop raises it.
                    self._fatal = error
        self._release(numbers)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost partitions are already someone else's: never commit for them.
        numbers = [tp.partition for tp in partitions]
        self.metrics.rebalances.labels(event="lost").inc()
        try:
            self._take(self.strategy.settle(None))  # never committed again: no longer ours
            if self.strategy.abort():
                self.metrics.observe_abort("partitions_lost")
        except (KafkaException, FatalWorkerError) as error:
            # Raised in a librdkafka callback, it would escape `poll` or `close` as a traceback;
            # the loop raises it instead (a broker gone while leaving the group is one such).
            log.warning("abort after losing partitions %s failed: %s", numbers, _message(error))
            self._release(numbers)
            if isinstance(error, FatalWorkerError) and self._fatal is None:
                self._fatal = error
            return
        self._release(numbers)
        self._rollback()

    def _release(self, partitions: list[int]) -> None:
        """Forget partitions this worker no longer owns, and their state."""
        self._drop_state(partitions)
        self.assigned.difference_update(partitions)
        self.uncommitted = [p - set(partitions) for p in self.uncommitted if p - set(partitions)]
        self.restoring.difference_update(partitions)
        self.at_end.difference_update(partitions)
        self.metrics.partitions_restoring.set(len(self.restoring))
        self._report_readiness()
        self.metrics.active_requests.set(self.processor.active_requests)

    def _drop_state(self, partitions: Iterable[int]) -> None:
        dropped = set(partitions)
        gone = [r for r, p in self.owners.items() if p in dropped]
        for request_id in gone:
            del self.owners[request_id]
            self.checkpoint.dirty.discard(request_id)
            self.checkpoint.deltas.pop(request_id, None)
        self.processor.forget(gone)
        for partition in dropped:
            self.checkpoint.offsets.pop(partition, None)
            self.newest_timestamp.pop(partition, None)

    def _begin_restore(self, partitions: Iterable[int]) -> None:
        """Mark partitions whose state must be restored before any of their records is handled.

        They are not paused: librdkafka fetches their input (the committed-offset lookup, the
        first fetch) while the loop reads the changelog, and `_restore_before_handling` restores
        them before the batch that holds their first records is handled. Pausing them instead
        cost up to a second per assignment: librdkafka's broker thread acts on a resume only
        when it next wakes, which with no fetch in flight is its 1 s idle tick (seen in its
        debug log: resume at t, first fetch decision at t + 0.98 s; confluent-kafka-go#630).
        """
        self.restoring.update(partitions)
        self.metrics.partitions_restoring.set(len(self.restoring))
        self._report_readiness()

    def _report_readiness(self) -> None:
        """The readiness hook (workers/health.py): ready once joined and nothing restores."""
        if not self.joined:
            return
        if self.restoring:
            self.health.set_ready(False, f"restoring partitions {sorted(self.restoring)}")
        else:
            self.health.set_ready(True, f"partitions {sorted(self.assigned)} restored")

    def _restore_before_handling(self, messages: list[Message]) -> list[Message]:
        """Restore the partitions assigned (or rolled back) during the last consume, then pass
        on the batch; records of partitions left unrestored (a stop during the restore) are
        dropped, never handled without their state: uncommitted, they are consumed again by
        whoever owns the partition next. So are those of partitions started over at their
        beginning (`_start_uncommitted`), which are fetched again."""
        started_over = self._restore()
        self._restore_just_ended = not self.restoring
        unhandled = self.restoring | started_over
        if not unhandled:
            return messages
        return [m for m in messages if m.partition() not in unhandled]

    def _restore(self) -> set[int]:
        """Rebuild the state of the restoring partitions from the changelog; returns the
        partitions `_start_uncommitted` sent back to their beginning.

        Guarded per changelog record (workers/changelog.py): a record that cannot be restored
        fails its request, goes to the dead-letter topic, and is counted; the rest restore.
        """
        started = time.perf_counter()
        cpu_started = time.process_time()  # beside the wall time: a loaded host's share of it
        partitions = sorted(self.restoring)
        self.timeline.mark_partitions("restore started", partitions)
        try:
            committed = settled_commits(
                self.consumer, self.topics.input, partitions, lambda: self.stop.requested
            )
            started_over = self._start_uncommitted(committed)
            committed_input = committed if self.strategy.restore_skips_ahead_of_commit else None
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
        restored = apply_latest(latest, self.processor, committed_input)
        del latest  # a million records, for a million open requests: freed before going on
        self.owners.update(restored.owners)
        self._emit(restored.failed_requests)  # failed completions of heads that did not restore
        for letter in restored.failed:
            self._dead_letter(letter)
            if letter.request_id is not None:
                self.checkpoint.dirty.add(letter.request_id)
        self.metrics.changelog_records_skipped.inc(len(restored.failed))
        self.restoring.difference_update(partitions)
        self.timeline.mark_partitions("restored", partitions)
        self._report_readiness()
        self.metrics.observe_restore(time.perf_counter() - started, len(self.restoring))
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

    def _start_uncommitted(self, committed: dict[int, int]) -> set[int]:
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
                self.consumer.seek(TopicPartition(self.topics.input, partition, OFFSET_BEGINNING))
            except KafkaException as error:
                log.debug("partition %d starts at librdkafka's reset: %s", partition, error)
                continue
            started_over.add(partition)
        return started_over


def _message(error: BaseException) -> str:
    if isinstance(error, KafkaException) and error.args and isinstance(error.args[0], KafkaError):
        return describe_error(error.args[0])
    return str(error)
