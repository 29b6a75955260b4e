"""The Kafka worker: consume token-id events, decode, produce text, exactly once.

One loop, consume-transform-produce:

    consume a batch -> parse (bad bytes: dead letter) -> RequestProcessor.process (one decode
    round) -> completions, metric events and dead letters kept in the checkpoint, deltas
    coalesced per request -> every commit interval: those outputs, changelog snapshots of the
    requests touched, and the consumed offsets, all in one transaction, which commits on a
    committer thread while the loop decodes on (the next commit waits for it first).

Per-request state (a `DecodeStream` window, the text so far, the expected seq) lives in memory,
keyed by request id and owned by the input partition its events arrive on. Its changelog is a
compacted topic with the input's partition count: the snapshot of a request on input partition p
is written to changelog partition p, so whoever is assigned p restores exactly p's requests.

Failure model (exactly-once): a crash loses the open transaction; the next owner restores the
committed snapshots and re-consumes from the committed offsets, and read_committed readers never
saw the aborted outputs. An abortable error does the same inside the process (abort, restore,
rewind). A fatal error stops the worker with a non-zero exit, for the orchestrator to restart.
"""

from __future__ import annotations

import gc
import json
import logging
import resource
import signal
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from pipeline.processor import BatchResult, DeadLetter, Delta, RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import dump_json
from schemas.validation import Rejection, parse_event
from workers.config import WorkerSettings
from workers.dead_letters import dead_letter_headers, dead_letter_key
from workers.kafka_origin import KafkaOrigin
from workers.metrics import WorkerMetrics

log = logging.getLogger("detok.worker")

# Broker round trips of a transaction commit take milliseconds on a healthy cluster; 30 s
# covers a leader election without hanging forever on a dead broker.
KAFKA_TIMEOUT_S = 30.0
# Retriable commit errors (a coordinator moving, a request timing out) are retried this many
# times, a second apart, before the worker gives up; Quix Streams uses the same bound.
COMMIT_ATTEMPTS = 3
COMMIT_RETRY_BACKOFF_S = 1.0
# Longest wait for a consume batch to fill: long enough that a busy input gives full batches
# (one decode round amortised over max_batch events), short enough to notice signals promptly.
CONSUME_WAIT_S = 0.1
# Allocations between young-generation garbage collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 100_000
# The input fetch: see `_consumer_config`.
FETCH_MIN_BYTES = 100_000
FETCH_WAIT_MAX_MS = 50
# TTL sweeps walk every request; once a second is plenty for TTLs measured in minutes.
EXPIRE_INTERVAL_S = 1.0
# The restore consumer's fetch wait and consume timeout: short, because it only reads to EOF.
RESTORE_FETCH_WAIT_MS = 10
RESTORE_CONSUME_TIMEOUT_S = 0.05
# Offset commits that fail because the group is rebalancing: under at-least-once the partition's
# next owner (maybe us) re-consumes from the last commit, so these are not fatal.
REBALANCE_COMMIT_ERRORS = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError._ASSIGNMENT_LOST,
    }
)
# Header on changelog records: the input offset the snapshot reflects (Quix's pattern). Under
# at-least-once, a snapshot written ahead of the committed offset is skipped on restore.
PROCESSED_OFFSET_HEADER = "__detok.processed_offset"


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
    rss_at_first_consume: int = 0
    # Where the loop's time went (seconds): in consume() calls that returned records, in
    # handling them (of which `process_s` inside the processor: parse-free decode work), and in
    # commits. What is left of the wall time was spent waiting for input.
    consume_s: float = 0.0
    handle_s: float = 0.0
    process_s: float = 0.0
    commit_s: float = 0.0
    # The longest single batch and commit: what a delay tail is made of.
    slowest_handle_s: float = 0.0
    slowest_commit_s: float = 0.0

    def summary(self, active_requests: int) -> str:
        return json.dumps(
            {
                "first_consume_at": self.first_consume_at,
                "last_commit_at": self.last_commit_at,
                "records": self.records,
                "batches": self.batches,
                "generated_tokens": self.generated_tokens,
                "commits": self.commits,
                "rss_at_first_consume": self.rss_at_first_consume,
                "consume_s": round(self.consume_s, 3),
                "handle_s": round(self.handle_s, 3),
                "process_s": round(self.process_s, 3),
                "commit_s": round(self.commit_s, 3),
                "slowest_handle_s": round(self.slowest_handle_s, 3),
                "slowest_commit_s": round(self.slowest_commit_s, 3),
                "rss_at_exit": current_rss_bytes(),
                "peak_rss": peak_rss_bytes(),
                "active_requests": active_requests,
            }
        )


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


class FatalWorkerError(Exception):
    """The worker cannot go on (fenced, fatal producer error, lost delivery under ALOS)."""


class _Output(NamedTuple):
    """A record to produce at the next commit (a completion, a metric event, a dead letter)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None = None
    timestamp: int = 0


@dataclass
class _Checkpoint:
    """What has happened since the last commit.

    Every output waits here until the commit: under exactly-once the previous transaction may
    still be committing on the committer thread, and nothing may be produced until it is done.
    """

    offsets: dict[int, int]  # input partition -> next offset to consume
    dirty: set[str]  # requests whose snapshot must be rewritten
    deltas: dict[str, Delta]  # request -> its coalesced delta
    outputs: list[_Output]
    started_at: float

    @classmethod
    def fresh(cls) -> _Checkpoint:
        return cls({}, set(), {}, [], time.monotonic())

    @property
    def empty(self) -> bool:
        return not (self.offsets or self.dirty or self.deltas or self.outputs)


class _TransactionOutcome(NamedTuple):
    committed: bool  # False: it must be aborted and the worker rolled back
    seconds: float  # from sending the offsets to the next transaction begun
    finished_at: float  # wall clock


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        registry: TokenizerRegistry,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.exactly_once = settings.guarantee == "exactly-once"
        self.metrics = metrics or WorkerMetrics(registry.names, registry=None)
        self.processor = RequestProcessor(
            registry,
            unknown_generated_ids=settings.unknown_generated_ids,
            request_ttl_s=settings.request_ttl_s,
            finished_retention_s=settings.finished_retention_s,
        )
        self.processor.warm_up()
        tune_garbage_collector()
        self.owner: dict[str, int] = {}  # request id -> input partition
        self.assigned: set[int] = set()
        self.restoring: set[int] = set()
        self.at_end: set[int] = set()
        self.checkpoint = _Checkpoint.fresh()
        self.running = True
        self.last_message_at = time.monotonic()
        self.last_expire_at = time.monotonic()
        self._delivery_error: KafkaError | None = None
        # False once the worker stops on a fatal error: leaving the group must not commit then.
        self._commit_on_revoke = True
        self.stats = RunStats()
        self.consumer = Consumer(self._consumer_config())
        self.producer = Producer(self._producer_config())
        # Committing a transaction is a few broker round trips (offsets, then EndTxn) during
        # which the worker used to wait: 10-17% of its time draining, and under live load,
        # when the broker answers slower, up to a third. One committer thread waits instead,
        # while the loop goes on decoding into the next checkpoint (it releases the GIL).
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detok-commit")
        self._in_flight: Future[_TransactionOutcome] | None = None

    # -- configuration ------------------------------------------------------------------------

    def _consumer_config(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.settings.bootstrap_servers,
            "group.id": self.settings.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.partition.eof": True,
            "session.timeout.ms": self.settings.session_timeout_ms,
            "heartbeat.interval.ms": max(self.settings.session_timeout_ms // 10, 100),
            # librdkafka pre-fetches up to this much per partition. 16 MB is several seconds of
            # input at full speed (events are ~150 bytes), so the decode loop never starves,
            # while 8 partitions at the old 64 MB each let the prefetch alone add ~200 MB of RSS.
            "queued.max.messages.kbytes": 16384,
            # With the default fetch.min.bytes=1 and input arriving continuously, every fetch
            # returned at once with a handful of records: thousands of fetches a second, and the
            # broker serving them burnt 1.3-2 cores of this 2-core machine, starving the worker
            # (p99 delay 1.8 s at half the maximum rate). Letting the broker gather 100 KB
            # (~700 events) or wait 50 ms, whichever comes first, cut its CPU by half and the p99
            # to ~0.6 s; 50 ms is a fifth of the default commit interval, the latency floor.
            "fetch.min.bytes": FETCH_MIN_BYTES,
            "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
            "statistics.interval.ms": 5000,
            "stats_cb": self.metrics.consumer_statistics,
            **self.settings.kafka_config,
        }

    def _producer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "bootstrap.servers": self.settings.bootstrap_servers,
            "enable.idempotence": True,
            # Java clients hash keys with murmur2; so must we, or a request's outputs would land
            # on other partitions than a Java producer would choose.
            "partitioner": "murmur2_random",
            # Deltas and snapshots are produced at commit, and a commit sends at once whatever
            # lingers; so linger only batches the completions and metric events produced
            # between commits, and 20 ms (librdkafka's guide: > 5 ms for throughput) does that
            # without adding to the delay a reader sees.
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            **self.settings.kafka_config,
        }
        if self.exactly_once:
            config["transactional.id"] = self.settings.transactional_id
            # An orphaned transaction (a worker killed with a random instance id) blocks
            # read_committed readers until it times out; 30 s bounds that stall.
            config["transaction.timeout.ms"] = 30_000
        else:
            config["on_delivery"] = self._on_delivery
        return config

    # -- lifecycle ----------------------------------------------------------------------------

    def run(self) -> int:
        """Process until stopped by a signal, by `exit_when_idle_s`, or by a fatal error."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        if self.exactly_once:
            self.producer.init_transactions(KAFKA_TIMEOUT_S)
            self.producer.begin_transaction()
        self.consumer.subscribe(
            [self.topics.input],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        try:
            while self.running:
                self._step()
            self._commit()
        except FatalWorkerError:
            log.exception("fatal error; stopping without commit")
            self._close(abort=True)
            return 1
        except KafkaException:
            log.exception("fatal Kafka error; stopping without commit")
            self._close(abort=True)
            return 1
        self._close(abort=False)
        log.info("run summary %s", self.stats.summary(self.processor.active_requests))
        return 0

    def _stop(self, signum: int, frame: object) -> None:
        log.info("signal %s: finishing the batch, committing, leaving the group", signum)
        self.running = False

    def _close(self, abort: bool) -> None:
        if self._in_flight is not None:
            # Only after a failure: its outcome no longer matters, but it must end first.
            try:
                self._in_flight.result()
            except (KafkaException, FatalWorkerError):
                log.warning("the last transaction failed too", exc_info=True)
            self._in_flight = None
        self._committer.shutdown()
        if abort and self.exactly_once:
            try:
                self.producer.abort_transaction(KAFKA_TIMEOUT_S)
            except KafkaException:
                log.warning("abort at shutdown failed", exc_info=True)
        self._commit_on_revoke = not abort
        self.consumer.close()  # leaves the group; our revoke callback commits what is open
        self.producer.flush(KAFKA_TIMEOUT_S)

    # -- the loop -----------------------------------------------------------------------------

    def _step(self) -> None:
        if self.restoring:
            self._restore()
        # consume() waits until the batch is full or the timeout ends; never past the commit
        # deadline, or at moderate rates every commit (and so every delta) comes up to a whole
        # wait late.
        due_in = self.settings.commit_interval_ms / 1000 - (
            time.monotonic() - self.checkpoint.started_at
        )
        consume_started = time.perf_counter()
        messages = self.consumer.consume(
            self.settings.max_batch, min(CONSUME_WAIT_S, max(due_in, 0.0))
        )
        now = time.time()
        if messages:
            handle_started = time.perf_counter()
            self.stats.consume_s += handle_started - consume_started
            self.stats.batches += 1
            self._handle(messages, now)
            handled_in = time.perf_counter() - handle_started
            self.stats.handle_s += handled_in
            self.stats.slowest_handle_s = max(self.stats.slowest_handle_s, handled_in)
        if time.monotonic() - self.last_expire_at >= EXPIRE_INTERVAL_S:
            self.last_expire_at = time.monotonic()
            self._emit(self.processor.expire(now))
        elapsed_ms = (time.monotonic() - self.checkpoint.started_at) * 1000
        if elapsed_ms >= self.settings.commit_interval_ms:
            self._commit(wait=False)
        self.producer.poll(0)
        if self._idle_long_enough():
            log.info("every assigned partition is at its end and idle; stopping")
            self.running = False

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
        batch = []
        records = 0  # partition EOFs and consumer errors are messages too, but not records
        offsets = self.checkpoint.offsets
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self.at_end.add(message.partition())
                    continue
                if error.fatal():
                    raise KafkaException(error)
                log.warning("consumer error: %s", error)
                continue
            partition = message.partition()
            records += 1
            self.at_end.discard(partition)
            offsets[partition] = message.offset() + 1
            origin = KafkaOrigin(message)
            event = parse_event(message.value() or b"")
            if isinstance(event, Rejection):
                self._dead_letter(
                    DeadLetter(event.reason, event.error_class, event.message, None, None, origin)
                )
                continue
            self.owner.setdefault(event.request_id, partition)
            batch.append((event, origin))
        self.last_message_at = time.monotonic()
        if batch:
            started = time.perf_counter()
            result = self.processor.process(batch, now)
            processed_in = time.perf_counter() - started
            self.stats.process_s += processed_in
            self.metrics.observe_batch(result, len(batch), processed_in)
            self.stats.generated_tokens += result.decoded_tokens
            self._emit(result)
        self.metrics.observe_consumed(records, now)
        self.stats.records += records

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
            key = completion.request_id.encode()
            outputs.append(_Output(self.topics.completions, key, dump_json(completion)))
        for metric in result.metrics:
            key = metric.request_id.encode()
            outputs.append(_Output(self.topics.metrics, key, dump_json(metric)))
        for letter in result.dead_letters:
            self._dead_letter(letter)
        self.checkpoint.dirty |= result.touched
        self.metrics.observe_outputs(result)

    def _dead_letter(self, letter: DeadLetter) -> None:
        headers = dead_letter_headers(letter, self.settings.group, self.settings.instance_id)
        timestamp = letter.origin.timestamp_ms if letter.origin else None
        self.checkpoint.outputs.append(
            _Output(
                self.topics.dead_letters,
                dead_letter_key(letter),
                letter.value,
                headers,
                timestamp or 0,
            )
        )
        self.metrics.dead_letters.labels(reason=letter.reason.value).inc()

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        *,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        timestamp: int = 0,
    ) -> None:
        kwargs: dict[str, Any] = {"key": key, "headers": headers, "timestamp": timestamp}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self.producer.produce(topic, value, **kwargs)
                return
            except BufferError:
                # The local queue is full: let librdkafka send, then try again.
                self.producer.poll(0.05)

    # -- commit -------------------------------------------------------------------------------

    def _commit(self, wait: bool = True) -> None:
        """Produce the checkpoint's outputs and commit them with its offsets.

        Under exactly-once the transaction commits on the committer thread; `wait=False` (the
        loop's periodic commit) returns at once and the next commit settles it first. Every
        other caller (shutdown, a revoke) waits for the outcome.
        """
        started = time.perf_counter()
        self._settle()  # may roll back, which replaces the checkpoint
        checkpoint = self.checkpoint
        if checkpoint.empty:
            checkpoint.started_at = time.monotonic()
            return
        for output in checkpoint.outputs:
            self._produce(
                output.topic,
                output.key,
                output.value,
                headers=output.headers,
                timestamp=output.timestamp,
            )
        for request_id, delta in checkpoint.deltas.items():
            self._produce(self.topics.deltas, request_id.encode(), delta.to_wire_json())
        self.metrics.deltas_produced.inc(len(checkpoint.deltas))
        self._write_changelog(checkpoint)
        offsets = [
            TopicPartition(self.topics.input, partition, offset)
            for partition, offset in sorted(checkpoint.offsets.items())
        ]
        self.checkpoint = _Checkpoint.fresh()
        if self.exactly_once:
            metadata = self.consumer.consumer_group_metadata()
            self._in_flight = self._committer.submit(self._commit_transaction, offsets, metadata)
            self.stats.commit_s += time.perf_counter() - started
            if wait:
                self._settle()
            return
        committed = self._commit_at_least_once(offsets)
        if not committed:
            # The outputs are out; only the offsets were refused, by a rebalance. Partitions we
            # kept (cooperative rebalances keep most) offer them again with the next commit:
            # dropped, an idle partition's committed offset would lag behind its end forever.
            self.checkpoint.offsets = {
                p: offset for p, offset in checkpoint.offsets.items() if p in self.assigned
            }
        seconds = time.perf_counter() - started
        self.stats.commit_s += seconds
        self._count_commit(_TransactionOutcome(committed, seconds, time.time()))

    def _settle(self) -> None:
        """Wait for the transaction on the committer thread; roll back if it was aborted."""
        if self._in_flight is None:
            return
        waited = time.perf_counter()
        future, self._in_flight = self._in_flight, None
        outcome = future.result()  # a fatal error surfaces here, as it did when synchronous
        self.stats.commit_s += time.perf_counter() - waited
        if not outcome.committed:
            self.producer.abort_transaction(KAFKA_TIMEOUT_S)
            self.producer.begin_transaction()
            self._rollback()
        self._count_commit(outcome)

    def _count_commit(self, outcome: _TransactionOutcome) -> None:
        if outcome.committed:
            self.stats.commits += 1
            self.stats.last_commit_at = outcome.finished_at
        self.stats.slowest_commit_s = max(self.stats.slowest_commit_s, outcome.seconds)
        self.metrics.observe_commit(outcome.seconds, outcome.committed)
        self.metrics.active_requests.set(self.processor.active_requests)

    def _write_changelog(self, checkpoint: _Checkpoint) -> None:
        for request_id in checkpoint.dirty:
            partition = self.owner.get(request_id)
            if partition is None:
                continue
            value = self.processor.snapshot(request_id)
            offset = checkpoint.offsets.get(partition, -1)
            self._produce(
                self.topics.changelog,
                request_id.encode(),
                value,
                partition=partition,
                headers=[(PROCESSED_OFFSET_HEADER, str(offset).encode())],
            )
            if value is None:
                del self.owner[request_id]

    def _commit_transaction(
        self, offsets: list[TopicPartition], metadata: Any
    ) -> _TransactionOutcome:
        """On the committer thread: offsets into the open transaction, commit it, begin the
        next. Touches nothing but the producer; the loop does the rest (`_settle`)."""
        started = time.perf_counter()
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                if offsets:
                    self.producer.send_offsets_to_transaction(offsets, metadata, KAFKA_TIMEOUT_S)
                    offsets = []  # sent; a retry only repeats the commit
                self.producer.commit_transaction(KAFKA_TIMEOUT_S)
                self.producer.begin_transaction()
                return _TransactionOutcome(True, time.perf_counter() - started, time.time())
            except KafkaException as exception:
                error: KafkaError = exception.args[0]
                if error.txn_requires_abort():
                    log.warning("transaction must abort (%s); rolling back", error)
                    return _TransactionOutcome(False, time.perf_counter() - started, time.time())
                if error.retriable() and attempt < COMMIT_ATTEMPTS:
                    log.warning("commit attempt %d failed (%s); retrying", attempt, error)
                    time.sleep(COMMIT_RETRY_BACKOFF_S)
                    continue
                raise FatalWorkerError(f"transaction commit failed: {error}") from exception
        raise AssertionError("unreachable")

    def _commit_at_least_once(self, offsets: list[TopicPartition]) -> bool:
        remaining = self.producer.flush(KAFKA_TIMEOUT_S)
        if remaining or self._delivery_error is not None:
            raise FatalWorkerError(
                f"outputs not delivered ({remaining} pending, error {self._delivery_error}); "
                "offsets left uncommitted so a restart reprocesses them"
            )
        if offsets:
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exception:
                error: KafkaError = exception.args[0]
                if error.code() not in REBALANCE_COMMIT_ERRORS and not error.retriable():
                    raise
                # Outputs are delivered; only the offsets were refused. Whoever owns the
                # partitions next re-consumes from the previous commit: duplicates, which
                # at-least-once allows, and the changelog skips snapshots ahead of the commit.
                log.warning("offset commit refused during a rebalance (%s)", error)
                return False
        return True

    def _on_delivery(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self._delivery_error = error

    def _rollback(self) -> None:
        """After an abort: forget uncommitted state, restore it, re-consume from the commit."""
        partitions = sorted(self.assigned)
        self.checkpoint = _Checkpoint.fresh()
        self._drop_state(partitions)
        if not partitions:
            return
        committed = self.consumer.committed(
            [TopicPartition(self.topics.input, p) for p in partitions], KAFKA_TIMEOUT_S
        )
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            try:
                self.consumer.seek(TopicPartition(self.topics.input, tp.partition, offset))
            except KafkaException:
                log.warning("rewind of partition %d failed", tp.partition, exc_info=True)
        self._begin_restore(partitions)

    # -- rebalance and restore ----------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # No I/O here: restore runs in the main loop, so this callback stays short and bounded
        # (a slow callback is how Quix Streams' workers livelocked in rebalance loops).
        consumer.incremental_assign(partitions)
        numbers = [tp.partition for tp in partitions]
        log.info("assigned partitions %s", numbers)
        self.assigned.update(numbers)
        self._begin_restore(numbers)
        self.metrics.rebalances.labels(event="assign").inc()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        numbers = [tp.partition for tp in partitions]
        log.info("revoked partitions %s", numbers)
        self.metrics.rebalances.labels(event="revoke").inc()
        if self._commit_on_revoke:
            try:
                self._commit()
            except (KafkaException, FatalWorkerError):
                log.exception("commit on revoke failed; the next owner reprocesses")
        self._release(numbers)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost partitions are already someone else's: never commit for them.
        numbers = [tp.partition for tp in partitions]
        self.metrics.rebalances.labels(event="lost").inc()
        self._settle()
        if self.exactly_once:
            self.producer.abort_transaction(KAFKA_TIMEOUT_S)
            self.producer.begin_transaction()
        self._release(numbers)
        self._rollback()

    def _release(self, partitions: list[int]) -> None:
        """Forget partitions this worker no longer owns, and their state."""
        self._drop_state(partitions)
        self.assigned.difference_update(partitions)
        self.restoring.difference_update(partitions)
        self.at_end.difference_update(partitions)
        self.metrics.partitions_restoring.set(len(self.restoring))
        self.metrics.active_requests.set(self.processor.active_requests)

    def _drop_state(self, partitions: Iterable[int]) -> None:
        dropped = set(partitions)
        for request_id in [r for r, p in self.owner.items() if p in dropped]:
            del self.owner[request_id]
            self.processor.requests.pop(request_id, None)
            self.checkpoint.dirty.discard(request_id)
            self.checkpoint.deltas.pop(request_id, None)
        for partition in dropped:
            self.checkpoint.offsets.pop(partition, None)

    def _begin_restore(self, partitions: Iterable[int]) -> None:
        numbers = list(partitions)
        self.consumer.pause([TopicPartition(self.topics.input, p) for p in numbers])
        self.restoring.update(numbers)
        self.metrics.partitions_restoring.set(len(self.restoring))

    def _restore(self) -> None:
        """Rebuild the state of the restoring partitions from the changelog, then resume them.

        Reads each changelog partition from the beginning to its end (partition EOF, never
        "offset == high watermark - 1": under read_committed, transaction markers occupy
        offsets and that test can hang). Compaction keeps this proportional to live requests.
        """
        started = time.perf_counter()
        partitions = sorted(self.restoring)
        committed_input = self._committed_offsets(partitions)
        restore_consumer = Consumer(
            {
                "bootstrap.servers": self.settings.bootstrap_servers,
                "group.id": f"{self.settings.group}-restore",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                # The restore reads what is already there; a broker holding a fetch open for
                # data that will never come (the default 500 ms) only delays the EOF.
                "fetch.wait.max.ms": RESTORE_FETCH_WAIT_MS,
                **self.settings.kafka_config,
            }
        )
        # Without metadata at hand, librdkafka looks it up on its own slower schedule: asking
        # first took an empty restore from ~2 s to ~0.1 s.
        restore_consumer.list_topics(self.topics.changelog, KAFKA_TIMEOUT_S)
        restore_consumer.assign(
            [TopicPartition(self.topics.changelog, p, OFFSET_BEGINNING) for p in partitions]
        )
        latest: dict[str, tuple[int, bytes | None]] = {}
        remaining = set(partitions)
        try:
            while remaining:
                # consume() waits out its whole timeout unless the batch fills, so a short
                # timeout lets the loop see each partition's EOF as soon as it arrives.
                for message in restore_consumer.consume(10_000, RESTORE_CONSUME_TIMEOUT_S):
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            remaining.discard(message.partition())
                            continue
                        raise KafkaException(error)
                    if not self.exactly_once and _ahead_of_commit(message, committed_input):
                        continue
                    latest[message.key().decode()] = (message.partition(), message.value())
        finally:
            restore_consumer.close()
        for request_id, (partition, value) in latest.items():
            if value is None:
                continue
            self.processor.restore(request_id, value)
            self.owner[request_id] = partition
        self.restoring.difference_update(partitions)
        self.consumer.resume([TopicPartition(self.topics.input, p) for p in partitions])
        self.metrics.observe_restore(time.perf_counter() - started, len(self.restoring))
        self.metrics.active_requests.set(self.processor.active_requests)
        log.info(
            "restored %d requests of partitions %s in %.2fs",
            len(latest),
            partitions,
            time.perf_counter() - started,
        )

    def _committed_offsets(self, partitions: list[int]) -> dict[int, int]:
        if self.exactly_once:
            return {}
        committed = self.consumer.committed(
            [TopicPartition(self.topics.input, p) for p in partitions], KAFKA_TIMEOUT_S
        )
        return {tp.partition: tp.offset for tp in committed}


def _ahead_of_commit(message: Message, committed_input: dict[int, int]) -> bool:
    """Under at-least-once: was this snapshot written for input the group never committed?"""
    for key, value in message.headers() or ():
        if key == PROCESSED_OFFSET_HEADER:
            return int(value) > committed_input.get(message.partition(), -1)
    return False
