"""The Kafka worker: consume token-id events, decode, produce text.

One loop, consume-transform-produce:

    consume a batch -> record handling (parse, check key and partition, process; a record that
    fails in any way is dead-lettered, never the stream) -> completions, filtered-id records and
    dead letters kept in the checkpoint, deltas coalesced per request -> every commit interval:
    those outputs, changelog snapshots of the requests touched, and the consumed offsets, handed
    to the commit strategy (exactly-once: one transaction, committed on a committer thread while
    the loop decodes on; at-least-once: outputs flushed, then offsets).

The parts, each a module: the loop (worker_loop.py), group membership, assignment and restore
(membership.py), outputs, commits and rollback (emitter.py), TTL sweeps (expiry_sweep.py), and
what they share (worker_context.py); this module builds them, runs the loop and leaves the group.

Per-request state (a `DecodeStream` window, the text so far, the expected seq) lives in the
processor, keyed by request id and owned by the input partition its events arrive on; the
changelog (workers/runtime/changelog.py) rebuilds it on assignment.

Failure model: a crash loses what was not committed; the next owner restores the committed
snapshots and re-consumes from the committed offsets. An abortable error does the same inside
the process (abort, restore, rewind), and so does a producer that became unusable (its
sequence state lost, a call wedged in the client): the commit strategy replaces it with a new
one under the same transactional id, which fences the old one and aborts its transaction. A
transaction refused only because the group moved to a new generation (a rebalance) is instead
committed again unchanged under the new one (workers/runtime/checkpointing.py, RECOMMIT_ATTEMPTS). A
broker-level fatal error (fenced, not authorised, a broker gone past every bound) stops the
worker with a non-zero exit and a message naming the cause, for the orchestrator to restart it.
Every wait is bounded and ends on SIGTERM; once stopping, the worker is gone within
`shutdown_timeout_s`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer

from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from workers.kafka.clients import make_consumer, make_producer
from workers.runtime.checkpointing import (
    CALL_TIMEOUT_S,
    Checkpoint,
    CommitStrategy,
    Deadline,
    ExactlyOnce,
    FatalWorkerError,
    strategy_for,
)
from workers.runtime.emitter import Emitter
from workers.runtime.expiry_sweep import ExpirySweep
from workers.runtime.health import Health
from workers.runtime.membership import Membership, consumer_settings
from workers.runtime.output_limits import OutputLimits
from workers.runtime.output_writer import OutputWriter
from workers.runtime.process_policy import StopRequest
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.run_stats import RunStats
from workers.runtime.settings import WorkerSettings
from workers.runtime.timeline import Timeline
from workers.runtime.worker_context import Clients, Ownership, message_of
from workers.runtime.worker_loop import WorkerLoop

log = logging.getLogger("detok.worker")

# Bounds the consumer's blocking lookups (committed offsets, metadata) while running; shortened
# further by the shutdown deadline once stopping.
KAFKA_TIMEOUT_S = 30.0


class Worker:
    """One worker process's runtime: builds its parts (see worker_context.py), runs the loop,
    and leaves the group within the shutdown deadline."""

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
            chat_parsers=settings.chat_parsers,
        )
        self.processor.warm_up()
        self.stop = stop or StopRequest()
        self.deadline = Deadline()
        self.stop.on_stop(self._stopping)
        strategy = strategy_for(settings.guarantee, settings.transactional_id, self.deadline)
        self.stats = RunStats()
        self.timeline = Timeline()
        self.clients = Clients(
            make_consumer(self.connection, consumer_settings(settings, metrics)),
            make_producer(self.connection, self._producer_settings(strategy)),
            strategy,
        )
        self.writer = OutputWriter(
            self.clients.producer,
            limits,
            self.topics,
            self.processor,
            metrics,
            group=settings.group,
            instance_id=settings.instance_id,
        )
        self._build_parts()
        self.timeline.mark("worker built")

    def _build_parts(self) -> None:
        """The loop and the parts it drives, sharing `clients` and `ownership`."""
        shared: dict[str, Any] = {
            "metrics": self.metrics,
            "stats": self.stats,
            "timeline": self.timeline,
        }
        waits: dict[str, Any] = {"stop": self.stop, "deadline": self.deadline}
        self.ownership = Ownership(self.health, self.metrics)
        self.emitter = Emitter(
            self.topics,
            self.processor,
            self.writer,
            self.clients,
            self.ownership,
            **shared,
            **waits,
        )
        self.membership = Membership(
            self.settings,
            self.processor,
            self.clients,
            self.ownership,
            self.emitter,
            **shared,
            **waits,
        )
        if isinstance(self.strategy, ExactlyOnce):
            self.strategy.topics_gone = self.emitter.missing_topics
        self.expiry = ExpirySweep(self.processor, self.ownership, self.emitter, self.stats)
        self.loop = WorkerLoop(
            self.settings,
            self.processor,
            self.clients,
            self.ownership,
            (self.membership, self.emitter, self.expiry),
            **shared,
            health=self.health,
        )

    # The clients and the checkpoint, as the worker's own: tests replace a client, and read
    # what is not committed yet.

    @property
    def consumer(self) -> Consumer:
        return self.clients.consumer

    @consumer.setter
    def consumer(self, consumer: Consumer) -> None:
        self.clients.consumer = consumer

    @property
    def producer(self) -> Producer:
        return self.clients.producer

    @property
    def strategy(self) -> CommitStrategy:
        return self.clients.strategy

    @strategy.setter
    def strategy(self, strategy: CommitStrategy) -> None:
        self.clients.strategy = strategy

    @property
    def checkpoint(self) -> Checkpoint:
        return self.emitter.checkpoint

    def run(self) -> int:
        """Process until stopped by a signal, by `exit_when_idle_s`, or by a fatal error."""
        try:
            if not self._start_producer():
                return 0
            self.clients.consumer.subscribe(
                [self.topics.input],
                on_assign=self.membership.on_assign,
                on_revoke=self.membership.on_revoke,
                on_lost=self.membership.on_lost,
            )
            self.timeline.mark("subscribed")
            while self.loop.running and not self.stop.requested:
                self.loop.step()
            self.emitter.commit()
        except (FatalWorkerError, KafkaException) as error:
            self._stopping()  # leaving after a failure is bounded like leaving on SIGTERM
            missing = self.emitter.missing_topics()
            log.error("stopping without commit: %s%s", message_of(error), missing)
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
            self.clients.strategy.start(self.clients.producer, self._new_producer)
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
        REPLACEMENT_CAUSES in workers/runtime/checkpointing.py), with the same settings and so the
        same transactional id; everything that produces uses it from now on."""
        self.metrics.producer_replacements.labels(cause=cause).inc()
        self.clients.producer = make_producer(
            self.connection, self._producer_settings(self.clients.strategy)
        )
        self.writer.producer = self.clients.producer
        return self.clients.producer

    def _stopping(self) -> None:
        self.deadline.set_in(self.settings.shutdown_timeout_s)

    def _close(self, abort: bool) -> None:
        self.clients.strategy.close()
        if abort:
            try:
                if self.clients.strategy.abort():
                    self.metrics.observe_abort("stopping_on_error")
            except (KafkaException, FatalWorkerError) as error:
                log.warning("abort at shutdown failed: %s", message_of(error))
        self.membership.commit_on_revoke = not abort
        self._leave_group()
        try:
            self.clients.producer.flush(self.deadline.remaining(KAFKA_TIMEOUT_S))
        except KafkaException as error:
            log.warning("flush at shutdown failed: %s", message_of(error))

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
            self.clients.consumer.close()
        except (KafkaException, FatalWorkerError) as error:
            log.warning("leaving the group failed: %s", message_of(error))

    def _producer_settings(self, strategy: CommitStrategy) -> dict[str, Any]:
        return {
            # Deltas and snapshots are produced at commit, and a commit sends at once whatever
            # lingers; so linger only batches the completions and filtered-id records produced
            # between commits, and 20 ms (librdkafka's guide: > 5 ms for throughput) does that
            # without adding to the delay a reader sees.
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            # As large as the largest topic takes: each record is checked against its own
            # topic's limit before it is produced (workers/runtime/output_limits.py).
            "message.max.bytes": self.limits.producer_message_max_bytes(),
            **strategy.producer_settings(),
        }
