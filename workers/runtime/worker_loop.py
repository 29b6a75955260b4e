"""The worker's loop: consume a batch, restore what was assigned, handle, sweep, commit.

One step: consume a batch (never waiting past the next commit) -> restore the partitions
assigned during that consume (membership.py) -> record handling (parse, check key and
partition, process; a record that fails in any way is dead-lettered, never the stream) ->
outputs into the checkpoint (emitter.py) -> a TTL sweep when due (expiry_sweep.py) -> a commit
when due -> stop once idle, if asked to.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, Message

from pipeline.processor import RequestProcessor
from workers.kafka.clients import AUTHORIZATION_ERRORS
from workers.runtime.checkpointing import FatalWorkerError, describe_error
from workers.runtime.emitter import Emitter
from workers.runtime.expiry_sweep import ExpirySweep
from workers.runtime.health import Health
from workers.runtime.membership import GROUP_THREAD_WAKE_S, Membership
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.record_handling import handle_batch
from workers.runtime.run_stats import RunStats, current_rss_bytes
from workers.runtime.settings import WorkerSettings
from workers.runtime.timeline import Timeline
from workers.runtime.worker_context import Clients, Ownership

log = logging.getLogger("detok.worker")

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


class WorkerLoop:
    """The loop's steps, until stopped (`running` False once idle past `exit_when_idle_s`)."""

    def __init__(
        self,
        settings: WorkerSettings,
        processor: RequestProcessor,
        clients: Clients,
        ownership: Ownership,
        parts: tuple[Membership, Emitter, ExpirySweep],
        *,
        metrics: PrometheusMetrics,
        stats: RunStats,
        timeline: Timeline,
        health: Health,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.processor = processor
        self.clients = clients
        self.ownership = ownership
        self.membership, self.emitter, self.expiry = parts
        self.metrics = metrics
        self.stats = stats
        self.timeline = timeline
        self.health = health
        self.running = True
        self.last_message_at = time.monotonic()
        self._group_thread_woken_at = 0.0  # monotonic; see GROUP_THREAD_WAKE_S

    def step(self) -> None:
        if self.membership.fatal is not None:
            raise self.membership.fatal
        self.health.step()
        # consume() waits until the batch is full or the timeout ends; never past the commit
        # deadline, or at moderate rates every commit (and so every delta) comes up to a whole
        # wait late. A commit that is due while the previous transaction is still committing
        # waits for it here, decoding on, instead of in `settle`: under load a transaction took
        # up to 3 s, and the loop that waited for it let that much input queue up behind it.
        due_in = self.commit_due_in()
        if due_in <= 0 and self.clients.strategy.committing():
            due_in = SETTLE_POLL_S  # not 0: that would spin until the transaction ends
        wait = CONSUME_WAIT_S if self.ownership.assigned else UNASSIGNED_WAIT_S
        if self.membership.restore_just_ended:
            # The restored partitions fetched while the changelog was read; their records are
            # taken now, not after waiting for a full batch, which held a joining worker's first
            # records ~100 ms (debug `consume`: 1,574 records queued 5 ms after the assignment,
            # restored at +0.076 s, first records at +0.173 s: one whole batch wait).
            wait, self.membership.restore_just_ended = 0.0, False
        self._wake_group_thread()
        consume_started = time.perf_counter()
        consumer = self.clients.consumer
        messages = consumer.consume(self.settings.max_batch, min(wait, max(due_in, 0.0)))
        if self.ownership.restoring:
            messages = self.membership.restore_before_handling(messages)
        if self.membership.rebalanced:
            # After the restore: a join's first output waits for that, not this.
            self.membership.rejoin_promptly()
        now = time.time()
        if messages:
            handle_started = time.perf_counter()
            self.stats.consume_s += handle_started - consume_started
            self.stats.batches += 1
            self._handle(messages, now)
            handled_in = time.perf_counter() - handle_started
            self.stats.handle_s += handled_in
            self.stats.slowest_handle_s = max(self.stats.slowest_handle_s, handled_in)
        if self.expiry.due():
            self.expiry.run(now)
        if self.commit_due_in() <= 0 and not self.clients.strategy.committing():
            self.emitter.commit(wait=False)
        self.clients.producer.poll(0)
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
            self.clients.consumer.assignment()

    def commit_due_in(self) -> float:
        """Seconds until the next commit is due: a commit interval after the last one began, or
        now when the checkpoint holds the first records of an assignment not yet committed.

        A worker that was just assigned partitions (it joined, or took over a leaver's) has no
        output visible for them until its first commit; waiting out the interval there only
        adds to that delay (up to 250 ms of a join's first second). One early commit per
        assignment costs one small transaction; every later one keeps the interval.
        """
        checkpoint = self.emitter.checkpoint
        if any(not fresh.isdisjoint(checkpoint.offsets) for fresh in self.ownership.uncommitted):
            return 0.0
        elapsed = time.monotonic() - checkpoint.started_at
        return self.settings.commit_interval_ms / 1000 - elapsed

    def _idle_long_enough(self) -> bool:
        idle_limit = self.settings.exit_when_idle_s
        # A worker that was never assigned anything has not seen the input yet (its group may
        # still be waiting for a dead member's session to expire); it must not call that idle.
        # An empty assignment is not "at the end": in a cooperative rebalance a joining member
        # first gets nothing and its partitions a round later.
        if idle_limit is None or not self.ownership.assigned or self.ownership.restoring:
            return False
        if not self.ownership.at_end >= self.ownership.assigned:
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
                self.ownership.at_end.discard(message.partition())
                records.append(message)
            elif error.code() == KafkaError._PARTITION_EOF:
                self.ownership.at_end.add(message.partition())
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
        handled = handle_batch(records, self.processor, self.ownership.owners, now)
        processed_in = time.perf_counter() - started
        self.stats.process_s += processed_in
        self.emitter.checkpoint.offsets.update(handled.next_offsets)
        self.timeline.mark_partitions("first records", handled.next_offsets)
        for partition, seconds in handled.newest_timestamp.items():
            if seconds > self.ownership.newest_timestamp.get(partition, float("-inf")):
                self.ownership.newest_timestamp[partition] = seconds
        self.ownership.owners.update(handled.new_owners)
        for letter in handled.dead_letters:
            self.emitter.dead_letter(letter)
        result = handled.result
        if handled.events:
            self.metrics.observe_batch(result, handled.events, processed_in)
        self.stats.generated_tokens += result.decoded_tokens
        self.emitter.checkpoint.decoded_tokens += result.decoded_tokens
        self.emitter.emit(result)
        self.metrics.observe_consumed(handled.records, now)
        self.stats.records += handled.records
