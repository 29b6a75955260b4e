"""What the worker commits, and the two ways it commits it: exactly-once and at-least-once.

The loop collects a `Checkpoint` (input offsets, outputs, deltas, the requests whose snapshot must
be rewritten) and hands its offsets to a `CommitStrategy` after producing its records. The
strategy owns everything the guarantee changes: the producer settings, how offsets are committed,
what "settling" a commit means, how a failed one is abandoned, and which changelog records a
restore keeps. The loop holds one strategy and never asks which guarantee it runs under (Quix
Streams' `checkpointing/` is the model).

Every blocking client call here is short (`CALL_TIMEOUT_S`) and repeated until the commit's own
budget or the worker's shutdown deadline ends, whichever comes first: librdkafka calls cannot be
interrupted by a signal, so a long one (the old 30 s per call, three attempts) was what kept a
stopping worker alive for minutes during a broker outage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from queue import SimpleQueue
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from pipeline.processor import Origin
from workers.kafka.clients import produce

log = logging.getLogger("detok.worker")

# One commit (offsets, then EndTxn) takes milliseconds on a healthy cluster. On a replicated
# cluster the retriable failures are a leader election (a few seconds), a transaction coordinator
# moving to another broker (the dead one's session timeout, 9 s by default, then the election),
# a rolling restart, and every broker briefly unreachable (a network partition, a full restart).
# All of those end by themselves, and a worker that exits meanwhile only gets restarted into the
# same outage, so retriable errors are waited out for up to two minutes; past that the cluster
# is not coming back soon, and the worker exits non-zero for its orchestrator to see. A stop
# request still cuts the wait to the shutdown deadline.
COMMIT_TIMEOUT_S = 120.0
# The longest single blocking client call: how late a stop request can be noticed, and so how
# far past its shutdown deadline a stopping worker can run.
CALL_TIMEOUT_S = 2.0
# Pause between retries of a retriable error that came back at once (not a timeout), doubling up
# to MAX_RETRY_PAUSE_S: a refusing coordinator is not asked hundreds of times a second, and a
# long outage costs a request every few seconds rather than a busy loop.
RETRY_PAUSE_S = 0.2
MAX_RETRY_PAUSE_S = 5.0
# While a wait goes on, it is logged again this often (the first error is logged at once).
STILL_WAITING_LOG_INTERVAL_S = 10.0
# A transactional client call is given at most CALL_TIMEOUT_S, yet after every broker of a
# cluster was stopped and started again, abort_transaction and send_offsets_to_transaction were
# seen never to return (librdkafka #3779 and #4420 report such blocked transactional calls).
# Every transactional call therefore runs on its producer's own thread (`_ProducerCalls`), and a
# call that has not returned this long after its own timeout is wedged inside the client: its
# producer is replaced (`ExactlyOnce._replace`). A call returns by its timeout plus librdkafka's
# own queueing, which a CPU-starved host stretches; 8 s more (four call timeouts) is past any
# slow call. A false alarm costs a fencing and a restore, never a record, so the bound leans
# short: it is what a wedge adds to a stall (the watchdog this replaced waited 60 s and then
# exited), and it stays below the 30 s transaction timeout, so a worker wedged after an outage
# resumes seconds after its brokers do. It is also how far past its shutdown deadline a worker
# stopping during a wedged call can run.
WEDGED_CALL_SLACK_S = 8.0
# An abort is a round trip to the transaction coordinator once the open transaction's records
# are settled, yet after every broker of a cluster was restarted, abort_transaction was seen to
# return "timed out, retry call to resume" on every call for 50-60 s (both workers of one CI
# run of the all-brokers-down test; one was still retrying at its shutdown deadline and exited
# 1). The call returns, so it is not wedged; the client's transaction state is stuck. Past this
# budget the producer is replaced like a wedged one (`ExactlyOnce._replace`): the new producer's
# init_transactions fences the old one and aborts its transaction at the coordinator, which a
# stuck client never gets to. Longer than a partition leader's election after a kill (the dead
# broker's 9 s session timeout, then the vote), so an abort merely waiting out an election is
# not replaced; a false alarm costs a fencing, never a record.
ABORT_BUDGET_S = 15.0
# librdkafka's idempotent producer raises these as fatal when a partition leader dies with
# records in flight and the new leader's sequence state disagrees with the producer's (seen after
# a kill -9 of a leader: OUT_OF_ORDER_SEQUENCE_NUMBER, "sequence desynchronization"). That
# producer instance can never be used again, but nothing is wrong with the worker or its data:
# a new producer with the same transactional id fences the old one and aborts its open
# transaction, and the worker restores and re-consumes, as a restarted worker would.
PRODUCER_STATE_ERRORS = frozenset(
    {
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)
# A call failing with one of these (fatal) means another producer initialised our transactional
# id: the worker that now owns its partitions. Nothing may then initialise that id again (a new
# producer of ours would fence that worker in turn), and nothing is left to abort: the other
# producer's init_transactions aborted our open transaction.
FENCED_ERRORS = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)
# An orphaned transaction (a worker killed with a random instance id) blocks read_committed
# readers until it times out; 30 s bounds that stall.
TRANSACTION_TIMEOUT_MS = 30_000
# The coordinator refuses a transaction's first AddPartitionsToTxn and AddOffsetsToTxn with
# CONCURRENT_TRANSACTIONS until the previous transaction's commit markers are written, which a
# busy broker takes a few hundred milliseconds to do now and then. librdkafka retries a refused
# AddOffsetsToTxn after `retry.backoff.ms`, doubling from its default 100 ms: markers done after
# 150 ms cost the send_offsets_to_transaction that waited for them 100 + 200 ms, and one that
# took 750 ms (100 + 200 + 400) set a latency run's p99 delay (1,184 ms against 560-843 ms in
# the same rotation; bench_e2e's `latency_run`, librdkafka debug log "eos"). 20 ms is what
# Java's producer waits before retrying a transaction's first AddPartitionsToTxn refused this
# way (`ADD_PARTITIONS_RETRY_BACKOFF_MS`); the doubling up to librdkafka's `retry.backoff.max.ms`
# (1 s) still spaces out the retries of a longer outage.
TRANSACTION_RETRY_BACKOFF_MS = 20
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

# The group coordinator answers with these while it moves to another broker (a broker stopped,
# killed or restarted) or loads the group after a move; the cluster recovers by itself, so an
# offset lookup asks again a pause later (`changelog.settled_commits`) and an at-least-once
# offset commit is offered again with the next one, like one refused by a rebalance. Failing
# on them cost a CI run: during a rolling restart a rollback's lookup got NOT_COORDINATOR, and
# the worker exited 1.
COORDINATOR_MOVING_ERRORS = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._WAIT_COORD,
        KafkaError._TRANSPORT,
    }
)

# A transaction refused because the group moved to a new generation while it was on its way
# (ILLEGAL_GENERATION: its offsets carried the generation the loop saw when it committed) is
# committed again under the new one: the same records, the same offsets. In a cooperative
# rebalance every member's generation moves twice, and a transaction in flight at either moment
# was refused; rolling back (restore every partition from the changelog, re-consume) redid
# 11-14% of a two-worker drain. The refused transaction's partitions are still this member's:
# a cooperative rebalance takes a partition from it only in its revoke callback, which settles
# (and so recommits) the transaction first. The new generation reaches the consumer with the
# join response that follows the refusal within a round trip; RECOMMIT_WAIT_S bounds that wait,
# past which (or after RECOMMIT_ATTEMPTS refusals in a row) the worker rolls back as before.
RECOMMIT_ATTEMPTS = 3
RECOMMIT_WAIT_S = CALL_TIMEOUT_S
RECOMMIT_POLL_S = 0.005
# librdkafka's serialised group metadata (`rd_kafka_consumer_group_metadata_write`): this magic,
# the generation id (4 bytes), then the group id, member id and instance id. Only a metadata
# that differs from the refused one in the generation alone is the same member's: a member
# removed from the group (session timeout) rejoins under a new member id, and its partitions
# may be another member's by then, so its refused transactions are rolled back.
GROUP_METADATA_MAGIC = b"CGMDv2:"
GENERATION_BYTES = slice(len(GROUP_METADATA_MAGIC), len(GROUP_METADATA_MAGIC) + 4)

# A record as the writer produced it (topic, value, the rest of `produce`'s arguments): kept
# for each transaction so that one refused by a new generation can be produced again unchanged.
ProducedRecord = tuple[str, bytes | None, dict[str, Any]]


def same_member_next_generation(refused: bytes, current: bytes) -> bool:
    """True if `current` is the group metadata of the member `refused` named, under another
    generation: what a transaction refused by ILLEGAL_GENERATION may be committed again under."""
    magic, generation = GROUP_METADATA_MAGIC, GENERATION_BYTES
    return (
        refused.startswith(magic)
        and current.startswith(magic)
        and current[generation] != refused[generation]
        and current[generation.stop :] == refused[generation.stop :]
    )


# Why a transaction was aborted, the `cause` label of the worker's abort counter:
# - abortable_error: the broker refused to commit it (the coordinator timed it out during an
#   outage, the group moved on); the batch is re-processed from restored state;
# - partitions_lost: the group took the partitions away (session timeout) before it committed;
# - producer_replaced: the producer became unusable (its sequence state lost, a call wedged, an
#   abort stuck); its replacement's init_transactions aborted the transaction (see ProducerLost);
# - stopping_on_error: the worker is exiting after a fatal error and discards what is open.
ABORT_CAUSES = ("abortable_error", "partitions_lost", "producer_replaced", "stopping_on_error")
# Why a producer was replaced, the `cause` label of the worker's replacement counter.
REPLACEMENT_CAUSES = ("producer_state_lost", "wedged_call", "abort_stuck")


class FatalWorkerError(Exception):
    """The worker cannot go on (fenced, not authorised, a broker gone past every bound)."""


class _BudgetSpent(FatalWorkerError):
    """A retried call's own budget ran out (not the shutdown deadline): fatal unless its caller
    has a way out (a stuck abort replaces the producer)."""


class ProducerFailed(FatalWorkerError):
    """`produce` refused a record because the producer itself is in a fatal state; what that
    state is (lost sequence state, or fenced) only a transactional call reports."""


class ProducerLost(Exception):
    """This producer instance can never be used again, while a new one recovers everything:
    `cause` is a label of REPLACEMENT_CAUSES, `detail` what happened, for the log."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


class Deadline:
    """When a stopping worker must be gone (monotonic clock); unset while it runs.

    Shared by the loop (which sets it on SIGTERM) and the committer thread (which bounds its
    calls by it), so a commit in flight during a broker outage gives up in time.
    """

    def __init__(self) -> None:
        self.at: float | None = None

    def set_in(self, seconds: float) -> None:
        if self.at is None:
            self.at = time.monotonic() + seconds

    def passed(self) -> bool:
        return self.at is not None and self.at <= time.monotonic()

    def describe(self, budget_s: float) -> str:
        """How a bounded wait ended, for the message that reports it."""
        if self.passed():
            return "before the shutdown deadline"
        return f"within {budget_s:.0f} s"

    def remaining(self, bound: float) -> float:
        """`bound`, or less if the deadline comes sooner (never below zero)."""
        if self.at is None:
            return bound
        return max(min(bound, self.at - time.monotonic()), 0.0)


@dataclass(slots=True)
class Output:
    """A record to produce at the next commit, with what a size refusal must name.

    `request_id` and `origin` say what an `output_too_large` dead letter points to when the
    record itself cannot be written: the request, or the input record it came from.
    """

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] | None = None
    timestamp: int = 0
    partition: int | None = None
    request_id: str | None = None
    origin: Origin | None = None


@dataclass
class Checkpoint:
    """What has happened since the last commit.

    Every output waits here until the commit: under exactly-once the previous transaction may
    still be committing on the committer thread, and nothing may be produced until it is done.
    """

    offsets: dict[int, int]  # input partition -> next offset to consume
    dirty: set[str]  # requests whose snapshot must be rewritten
    deltas: dict[str, Any]  # request -> its coalesced delta
    outputs: list[Output]
    started_at: float
    decoded_tokens: int = 0  # generated tokens decoded into this checkpoint

    @classmethod
    def fresh(cls) -> Checkpoint:
        return cls({}, set(), {}, [], time.monotonic())

    @property
    def empty(self) -> bool:
        return not (self.offsets or self.dirty or self.deltas or self.outputs)


@dataclass(frozen=True)
class CommitOutcome:
    committed: bool
    seconds: float  # from sending the offsets to the commit's end
    finished_at: float  # wall clock
    decoded_tokens: int  # of the checkpoint: redone elsewhere or again when not committed
    rollback: bool = False  # the outputs were discarded: restore and re-consume
    abort_cause: str | None = None  # why it was aborted (a label of ABORT_CAUSES)
    refused_offsets: dict[int, int] = field(default_factory=dict)  # offer again if still ours
    generation_moved: bool = False  # refused by ILLEGAL_GENERATION (see RECOMMIT_ATTEMPTS)
    recommits: int = 0  # times it was refused that way and committed again, unchanged


class CommitStrategy(Protocol):
    """One delivery guarantee: how a checkpoint's records and offsets become durable."""

    guarantee: str
    # What a restore keeps: True when a changelog record may be ahead of the committed input
    # (its snapshot was written, its offsets never committed) and must be skipped.
    restore_skips_ahead_of_commit: bool
    # True when `commit` is to be given the records produced for it (`ProducedRecord`).
    keeps_records: bool

    def producer_settings(self) -> dict[str, Any]: ...
    def start(self, producer: Producer, renew: Callable[[str], Producer]) -> None:
        """Begin with `producer`; `renew(cause)` makes a producer in place of a lost one."""
        ...

    def producer_failed(self, failure: ProducerFailed) -> None:
        """`produce` refused a record because the producer is in a fatal state: raise, or
        return if the next commit finds out what that state is and recovers."""
        ...

    def commit(
        self,
        consumer: Consumer,
        offsets: list[TopicPartition],
        decoded_tokens: int,
        records: list[ProducedRecord],
        in_rebalance_callback: bool = False,
    ) -> CommitOutcome | None:
        """Commit what was produced since the last commit (`records`, if `keeps_records`)
        with `offsets`; None while the outcome is pending (`settle` returns it).
        `in_rebalance_callback`: called from the consumer's revoke callback, where the consumer
        is called on this thread only."""
        ...

    def settle(self, consumer: Consumer | None) -> CommitOutcome | None:
        """The outcome of the commit under way, once it ends. `consumer`, when given, is the
        one whose group generation a refused commit may be made again under (never for
        partitions being lost)."""
        ...

    def committing(self) -> bool:
        """True while the last commit is still under way (`settle` would wait for it)."""
        ...

    def abort(self) -> bool:
        """Discard what is open; True if that aborted a transaction."""
        ...

    def close(self) -> None: ...


def describe_error(error: KafkaError) -> str:
    """A fatal client error in words: the cause first, the librdkafka text after."""
    code = error.code()
    if code in FENCED_ERRORS:
        cause = "fenced: another worker started with the same transactional id"
    elif code in (
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    ):
        cause = "not authorised"
    elif code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        cause = "a topic does not exist"
    else:
        cause = error.name()
    return f"{cause} ({error.str()})"


class ExactlyOnce:
    """Outputs, changelog and input offsets in one transaction per checkpoint.

    The transaction commits on a committer thread while the loop decodes into the next
    checkpoint: a commit is a few broker round trips during which the loop used to wait (10-17%
    of its time draining, up to a third under live load). The next commit settles it first.

    A producer that becomes unusable (ProducerLost: its sequence state lost, a call wedged) is
    replaced in process by `_replace`; the worker then rolls back as after any abort.
    """

    guarantee = "exactly-once"
    # The changelog is read read_committed, and its records commit atomically with the offsets:
    # every visible snapshot reflects committed input, so a restore keeps them all.
    restore_skips_ahead_of_commit = False
    keeps_records = True

    def __init__(
        self, transactional_id: str, deadline: Deadline, commit_timeout_s: float = COMMIT_TIMEOUT_S
    ) -> None:
        self.transactional_id = transactional_id
        self.deadline = deadline
        self.commit_timeout_s = commit_timeout_s
        # Names the pipeline topics deleted while the worker runs ("" when none); the worker
        # sets it (`Emitter.missing_topics`). Records produced to a topic deleted under them
        # stay unflushed, so each commit call times out until the commit's whole budget
        # (COMMIT_TIMEOUT_S) is spent, and only then was the topic named: a timed-out call
        # asks, and a deleted topic stops the worker at once.
        self.topics_gone: Callable[[], str] = _none_gone
        self.producer: Producer | None = None
        self._calls: _ProducerCalls | None = None
        self._renew: Callable[[str], Producer] | None = None
        # Replaced producers, kept referenced so that none is destroyed while the worker runs:
        # destroying a librdkafka client waits for its threads to end, which a producer in an
        # unknown state (a call of it still wedged) may never do.
        self._abandoned: list[_ProducerCalls] = []
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detok-commit")
        self._in_flight: Future[CommitOutcome] | None = None
        self._sent: _Sent | None = None  # what the transaction in flight holds
        self._lost: ProducerLost | None = None  # set by the committer thread, read by `settle`
        self._fenced: str | None = None  # the fencing a call reported (see FENCED_ERRORS)

    def producer_settings(self) -> dict[str, Any]:
        return {
            "transactional.id": self.transactional_id,
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            "retry.backoff.ms": TRANSACTION_RETRY_BACKOFF_MS,
        }

    def start(self, producer: Producer, renew: Callable[[str], Producer]) -> None:
        """Fence any predecessor with our transactional id and open the first transaction."""
        self._renew = renew
        self._use(producer)
        try:
            self._initialise(self.commit_timeout_s)
        except ProducerLost as lost:
            self._replace(lost)

    def producer_failed(self, failure: ProducerFailed) -> None:
        """Nothing to do yet: the transaction can no longer commit, and the commit that follows
        meets the producer's own error (replaced if a new producer recovers, fatal if not)."""
        log.warning("%s; the commit names the producer's error", failure)

    def commit(
        self,
        consumer: Consumer,
        offsets: list[TopicPartition],
        decoded_tokens: int,
        records: list[ProducedRecord],
        in_rebalance_callback: bool = False,
    ) -> CommitOutcome | None:
        metadata = consumer.consumer_group_metadata()
        self._sent = _Sent(offsets, metadata, decoded_tokens, records)
        self._in_flight = self._committer.submit(self._commit, offsets, metadata, decoded_tokens)
        return None

    def settle(self, consumer: Consumer | None) -> CommitOutcome | None:
        """Wait for the transaction on the committer thread; commit it again under the group's
        new generation, abort it, or replace the producer, if it must be."""
        if self._in_flight is None:
            return None
        future, self._in_flight = self._in_flight, None
        sent, self._sent = self._sent, None
        outcome = future.result()  # a fatal error surfaces here, as it did when synchronous
        if outcome.generation_moved and consumer is not None and sent is not None:
            outcome = self._recommit(consumer, sent, outcome)
        lost, self._lost = self._lost, None
        if lost is not None:
            self._replace(lost)
        elif outcome.rollback:
            self.abort()
        return outcome

    def committing(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def abort(self) -> bool:
        """Discard the open transaction's records and open the next one; an abort still not
        done after ABORT_BUDGET_S replaces the producer. Nothing to do once fenced: the fencing
        producer aborted the transaction, and a fenced client refuses every call. (A fenced
        worker's abort at shutdown got "Conflicting commit_transaction API call is already in
        progress" for 15 s, then replaced its producer, whose init_transactions fenced the
        successor: both workers exited 1.)"""
        if self._fenced is not None:
            log.info("not aborting: %s", self._fenced)
            return False
        try:
            try:
                self._retry_until_done(
                    lambda producer, timeout: producer.abort_transaction(timeout),
                    "aborting a transaction",
                    ABORT_BUDGET_S,
                )
            except _BudgetSpent as stuck:
                raise ProducerLost("abort_stuck", str(stuck)) from None
            self._begin()
        except ProducerLost as lost:
            self._replace(lost)  # its init_transactions aborts the transaction
        return True

    def close(self) -> None:
        if self._in_flight is not None:
            # Only after a failure: its outcome no longer matters, but it must end first.
            try:
                self._in_flight.result()
            except (KafkaException, FatalWorkerError) as error:
                log.warning("the last transaction failed too: %s", error)
            self._in_flight = None
        self._committer.shutdown()

    def _use(self, producer: Producer) -> None:
        self.producer = producer
        self._calls = _ProducerCalls(producer)

    def _initialise(self, budget_s: float) -> None:
        self._retry_until_done(
            lambda producer, timeout: producer.init_transactions(timeout),
            "initialising transactions (is the broker reachable?)",
            budget_s,
        )
        self._begin()

    def _replace(self, lost: ProducerLost) -> None:
        """The one way out of a lost producer: abandon it (never called again, never closed: a
        wedged one cannot be), make a new one with the same transactional id, and initialise
        it, which fences the old instance's epoch and aborts its open transaction. The worker
        then rolls back (restore, rewind), as a restarted worker would: nothing is lost or
        duplicated. Bounded like a commit: a cluster that lets no new producer initialise for
        `commit_timeout_s` is gone, and the worker stops (FatalWorkerError)."""
        assert self._renew is not None and self._calls is not None
        if self._fenced is not None:
            raise FatalWorkerError(
                f"the producer is not replaced ({lost.cause}): {self._fenced}; a new one would "
                "fence the worker that fenced it"
            )
        started = time.monotonic()
        while True:
            log.warning("replacing the producer (%s): %s", lost.cause, lost.detail)
            self._abandoned.append(self._calls)
            self._calls.abandon()
            self._use(self._renew(lost.cause))
            try:
                self._initialise(self.commit_timeout_s - (time.monotonic() - started))
                log.info("producer replaced (%s)", lost.cause)
                return
            except ProducerLost as again:
                lost = again
            if self.deadline.remaining(self.commit_timeout_s - (time.monotonic() - started)) <= 0:
                raise FatalWorkerError(
                    f"no new producer could be initialised "
                    f"{self.deadline.describe(self.commit_timeout_s)}; last: {lost}"
                )
            time.sleep(self.deadline.remaining(RETRY_PAUSE_S))

    def _commit(
        self, offsets: list[TopicPartition], metadata: Any, decoded_tokens: int
    ) -> CommitOutcome:
        """On the committer thread: offsets into the open transaction, commit it, begin the
        next. Touches nothing but the producer; the loop does the rest (`settle`)."""
        started = time.perf_counter()
        pending = list(offsets)

        def commit(producer: Producer, timeout: float) -> None:
            if pending:
                producer.send_offsets_to_transaction(pending, metadata, timeout)
                pending.clear()  # sent; a retry only repeats the commit
            producer.commit_transaction(timeout)

        def rolled_back(cause: str) -> CommitOutcome:
            seconds = time.perf_counter() - started
            return CommitOutcome(
                False, seconds, time.time(), decoded_tokens, rollback=True, abort_cause=cause
            )

        try:
            self._retry_until_done(commit, "committing a transaction")
            self._begin()
        except _MustAbort as abort:
            if abort.error.code() == KafkaError.ILLEGAL_GENERATION:
                log.info("transaction refused: the group moved to a new generation")
                return replace(rolled_back("abortable_error"), generation_moved=True)
            log.warning("transaction must abort (%s); rolling back", abort.error)
            return rolled_back("abortable_error")
        except ProducerLost as lost:
            # Maybe after the commit went through: the rollback then restores what committed.
            self._lost = lost
            return rolled_back("producer_replaced")
        return CommitOutcome(True, time.perf_counter() - started, time.time(), decoded_tokens)

    def _recommit(self, consumer: Consumer, sent: _Sent, refused: CommitOutcome) -> CommitOutcome:
        """Commit a transaction refused by a new generation again under it (see
        RECOMMIT_ATTEMPTS): abort it, produce its records again in a new one, send its offsets
        with the consumer's current group metadata, commit. `refused` (a rollback) if the
        member changed, its new generation did not arrive in time, or refusals go on."""
        metadata = sent.metadata
        for attempt in range(1, RECOMMIT_ATTEMPTS + 1):
            current = self._next_generation(consumer, metadata)
            if current is None or self._lost is not None:
                return refused
            self.abort()  # a producer lost meanwhile is replaced: the records go to the new one
            try:
                for topic, value, kwargs in sent.records:
                    produce(self.producer, topic, value, **kwargs)
            except KafkaException as error:
                log.warning("producing a refused transaction again failed: %s", error)
                return refused
            outcome = self._commit(sent.offsets, current, sent.decoded_tokens)
            if not outcome.generation_moved:
                log.info(
                    "a transaction the group's new generation refused was committed again "
                    "(%d records, attempt %d)",
                    len(sent.records),
                    attempt,
                )
                return replace(outcome, recommits=attempt)
            metadata, refused = current, outcome
        return refused

    def _next_generation(self, consumer: Consumer, refused: bytes) -> bytes | None:
        """This member's group metadata under a generation other than `refused`'s, once the
        consumer has it; None if the member changed or it did not come in time."""
        waited = _RetryWait(
            "waiting for the group's new generation", RECOMMIT_WAIT_S, self.deadline
        )
        while True:
            current: bytes = consumer.consumer_group_metadata()
            if same_member_next_generation(refused, current):
                return current
            if current != refused or waited.spent():
                return None
            time.sleep(RECOMMIT_POLL_S)

    def _begin(self) -> None:
        """Open the next transaction (a local call, but on the producer's thread like all)."""
        self._retry_until_done(
            lambda producer, timeout: producer.begin_transaction(), "beginning a transaction"
        )

    def _retry_until_done(
        self, call: Callable[[Producer, float], None], what: str, budget_s: float | None = None
    ) -> None:
        """`call(producer, timeout)` in short calls, retrying retriable errors (a timed-out call
        is one) with a growing pause until the budget (the commit's, unless given) or the
        shutdown deadline ends. ProducerLost if the producer must be replaced."""
        assert self._calls is not None
        wait = _RetryWait(
            what, self.commit_timeout_s if budget_s is None else budget_s, self.deadline
        )
        while True:
            timeout = wait.next_call_timeout()
            try:
                self._calls.run(call, timeout, what)
                wait.done()
                return
            except KafkaException as exception:
                error: KafkaError = exception.args[0]
                if error.fatal() and error.code() in PRODUCER_STATE_ERRORS:
                    raise ProducerLost(
                        "producer_state_lost", f"{what} failed: {describe_error(error)}"
                    ) from exception
                if error.fatal():
                    if error.code() in FENCED_ERRORS:
                        self._fenced = describe_error(error)
                    raise FatalWorkerError(f"{what} failed: {describe_error(error)}") from exception
                if error.txn_requires_abort():
                    raise _MustAbort(error) from exception
                if not error.retriable() or (
                    error.code() == KafkaError._TIMED_OUT and self.topics_gone()
                ):
                    raise FatalWorkerError(f"{what} failed: {describe_error(error)}") from exception
                wait.retry_after(error)


def _none_gone() -> str:
    return ""


@dataclass(frozen=True)
class _Sent:
    """A transaction handed to the committer: enough to commit it again (`_recommit`)."""

    offsets: list[TopicPartition]
    metadata: bytes  # the consumer's group metadata when it was committed
    decoded_tokens: int
    records: list[ProducedRecord]


class _ProducerCalls:
    """One producer, and the daemon thread that makes its transactional calls.

    librdkafka's calls cannot be interrupted from Python, and one was seen never to return (see
    WEDGED_CALL_SLACK_S). Made here, a call is waited for with a bound instead, and a wedged one
    is left on this thread while the worker goes on with a new producer. A daemon thread: one
    still wedged when the worker exits must not hold the process.
    """

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self._jobs: SimpleQueue[tuple[Callable[[], None], Future[None]] | None] = SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="detok-producer-calls").start()

    def run(self, call: Callable[[Producer, float], None], timeout: float, what: str) -> None:
        """`call(producer, timeout)`, its error raised here; ProducerLost if it is wedged."""
        producer = self.producer
        done: Future[None] = Future()
        self._jobs.put((lambda: call(producer, timeout), done))
        bound = timeout + WEDGED_CALL_SLACK_S
        try:
            done.result(bound)
        except TimeoutError:
            raise ProducerLost(
                "wedged_call",
                f"{what}: the Kafka client call has not returned {bound:.0f} s after it "
                f"started although its timeout is {timeout:.1f} s",
            ) from None

    def abandon(self) -> None:
        """Never called again; its thread ends once it is free (at once unless wedged)."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, done = job
            _complete(done, call)


def _complete(done: Future[None], call: Callable[[], None]) -> None:
    """Make `call` here, and hand its outcome (its error included) to the thread waiting on
    `done`: a client call made on a thread of its own, waited for with a bound."""
    try:
        call()
    except BaseException as error:  # raised in the waiting thread
        done.set_exception(error)
    else:
        done.set_result(None)


class _RetryWait:
    """The bounded, logged backoff of one retried call (see COMMIT_TIMEOUT_S)."""

    def __init__(self, what: str, budget_s: float, deadline: Deadline) -> None:
        self.what = what
        self.budget_s = budget_s
        self.deadline = deadline
        self.started = time.monotonic()
        self.pause = RETRY_PAUSE_S
        self.last: KafkaError | None = None
        self.logged_at = 0.0

    def next_call_timeout(self) -> float:
        """The next call's timeout; FatalWorkerError once the budget or the deadline is spent."""
        left = self.budget_s - (time.monotonic() - self.started)
        timeout = self.deadline.remaining(min(CALL_TIMEOUT_S, left))
        if timeout <= 0:
            ended = FatalWorkerError if self.deadline.passed() else _BudgetSpent
            raise ended(
                f"{self.what} did not finish {self.deadline.describe(self.budget_s)}; "
                f"last error: {self.last}"
            )
        return timeout

    def retry_after(self, error: KafkaError) -> None:
        """Log the error (at once when new, then every STILL_WAITING_LOG_INTERVAL_S) and pause
        if it came back at once; a timed-out call has already waited its timeout."""
        now = time.monotonic()
        changed = self.last is None or self.last.code() != error.code()
        if changed or now - self.logged_at >= STILL_WAITING_LOG_INTERVAL_S:
            log.warning(
                "%s: %s; retrying (waiting %.0f s so far, up to %.0f s)",
                self.what,
                error,
                now - self.started,
                self.budget_s,
            )
            self.logged_at = now
        self.last = error
        if error.code() != KafkaError._TIMED_OUT:
            time.sleep(self.deadline.remaining(self.pause))
            self.pause = min(self.pause * 2, MAX_RETRY_PAUSE_S)

    def spent(self) -> bool:
        """True once the budget or the shutdown deadline has run out."""
        return self.deadline.remaining(self.budget_s - (time.monotonic() - self.started)) <= 0

    def done(self) -> None:
        if self.last is not None:
            log.info(
                "%s succeeded after %.1f s of retriable errors",
                self.what,
                time.monotonic() - self.started,
            )


class _MustAbort(Exception):
    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error


class AtLeastOnce:
    """Outputs first, then offsets: a crash between the two repeats output, never loses it.

    Readers dedup the repeats: completions are keyed by request id (a compacted topic keeps the
    last), deltas carry `text_offset` (a replayed delta repeats text at offsets already seen).
    """

    guarantee = "at-least-once"
    # A snapshot is produced before its offsets are committed; one whose offsets never committed
    # describes input that will be consumed again, so a restore skips it (Quix's rule).
    restore_skips_ahead_of_commit = True
    keeps_records = False  # what was produced stays produced

    def __init__(self, deadline: Deadline, commit_timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        self.deadline = deadline
        self.commit_timeout_s = commit_timeout_s
        self.producer: Producer | None = None
        self._delivery_error: KafkaError | None = None

    def producer_settings(self) -> dict[str, Any]:
        return {"on_delivery": self._on_delivery}

    def start(self, producer: Producer, renew: Callable[[str], Producer]) -> None:
        self.producer = producer

    def producer_failed(self, failure: ProducerFailed) -> None:
        """Fatal: the outputs since the last commit were not all produced, and at-least-once
        commits offsets after outputs; a restart re-consumes from the last commit."""
        raise failure

    def commit(
        self,
        consumer: Consumer,
        offsets: list[TopicPartition],
        decoded_tokens: int,
        records: list[ProducedRecord],
        in_rebalance_callback: bool = False,
    ) -> CommitOutcome | None:
        assert self.producer is not None
        started = time.perf_counter()
        budget_end = time.monotonic() + self.commit_timeout_s
        remaining = self.producer.flush(0)
        while remaining and self._delivery_error is None:
            timeout = self.deadline.remaining(min(CALL_TIMEOUT_S, budget_end - time.monotonic()))
            if timeout <= 0:
                break
            remaining = self.producer.flush(timeout)
        if remaining or self._delivery_error is not None:
            raise FatalWorkerError(
                f"outputs not delivered {self.deadline.describe(self.commit_timeout_s)} "
                f"({remaining} pending, error {self._delivery_error}); offsets left "
                "uncommitted so a restart reprocesses them"
            )
        refused: dict[int, int] = {}
        if offsets:
            try:
                if in_rebalance_callback:
                    # From another thread, a synchronous commit waits for the callback to
                    # return, which waits for the commit: deadlocked until the budget ended.
                    consumer.commit(offsets=offsets, asynchronous=False)
                else:
                    self._commit_offsets(consumer, offsets, budget_end)
            except KafkaException as exception:
                error: KafkaError = exception.args[0]
                passing = REBALANCE_COMMIT_ERRORS | COORDINATOR_MOVING_ERRORS
                if error.code() not in passing and not error.retriable():
                    failure = describe_error(error)
                    raise FatalWorkerError(f"offset commit failed: {failure}") from None
                # Outputs are delivered; only the offsets were refused. Whoever owns the
                # partitions next re-consumes from the previous commit: duplicates, which
                # at-least-once allows, and the changelog skips snapshots ahead of the commit.
                log.warning("offset commit refused (%s); offered again with the next", error)
                refused = {tp.partition: tp.offset for tp in offsets}
        return CommitOutcome(
            not refused,
            time.perf_counter() - started,
            time.time(),
            decoded_tokens,
            refused_offsets=refused,
        )

    def _commit_offsets(
        self, consumer: Consumer, offsets: list[TopicPartition], budget_end: float
    ) -> None:
        """`consumer.commit`, synchronous, on a thread of its own, waited for in CALL_TIMEOUT_S
        slices until it returns (its error raised here), the commit's budget ends, or the
        shutdown deadline passes (FatalWorkerError).

        librdkafka's synchronous commit has no timeout: with the group coordinator gone it
        waits for one to come back, for as long as that takes (seen: a broker killed between a
        commit's flush and its offsets, and the worker, sent SIGTERM, still blocked 120 s
        later, past its 5 s shutdown deadline). Left behind on its thread, the call ends when
        the consumer is closed, which answers it `_WAIT_COORD`."""
        done: Future[None] = Future()
        commit = partial(consumer.commit, offsets=offsets, asynchronous=False)
        threading.Thread(
            target=_complete, args=(done, commit), daemon=True, name="detok-offset-commit"
        ).start()
        while True:
            timeout = self.deadline.remaining(min(CALL_TIMEOUT_S, budget_end - time.monotonic()))
            if timeout <= 0:
                raise FatalWorkerError(
                    f"offset commit not answered {self.deadline.describe(self.commit_timeout_s)} "
                    "(no group coordinator); offsets left uncommitted so a restart reprocesses "
                    "them"
                )
            try:
                done.result(timeout)
                return
            except TimeoutError:
                continue

    def settle(self, consumer: Consumer | None) -> CommitOutcome | None:
        return None  # every commit finished before `commit` returned

    def committing(self) -> bool:
        return False

    def abort(self) -> bool:
        """Nothing to discard: what was delivered stays, as duplicates at-least-once allows."""
        return False

    def close(self) -> None:
        pass

    def _on_delivery(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self._delivery_error = error


def strategy_for(guarantee: str, transactional_id: str, deadline: Deadline) -> CommitStrategy:
    """The strategy of a `WorkerSettings.guarantee`: the one place that asks which it is."""
    if guarantee == "exactly-once":
        return ExactlyOnce(transactional_id, deadline)
    return AtLeastOnce(deadline)
