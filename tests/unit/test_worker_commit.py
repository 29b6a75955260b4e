"""The worker's bookkeeping without a broker: commits, and the TTL clock.

What a broker answers is covered by tests/integration; here what no broker produces on demand:
the group refusing an offset commit (a rebalance), after which the at-least-once strategy reports
the refused offsets and the worker offers them again for the partitions it kept; and a producer
the client made unusable (a fatal lost sequence state, a call that never returns), which the
exactly-once strategy replaces in process (tests/integration/test_producer_replacement.py does
the same against a real broker).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from prometheus_client import generate_latest

from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.fake_records import FakeMessage
from tests.unit.small_tokenizers import byte_level
from workers.kafka.topic_names import TopicNames
from workers.runtime import changelog, checkpointing
from workers.runtime.checkpointing import (
    AtLeastOnce,
    CommitOutcome,
    Deadline,
    ExactlyOnce,
    FatalWorkerError,
    Output,
    ProducerFailed,
)
from workers.runtime.membership import GROUP_THREAD_WAKE_S, membership_settings
from workers.runtime.output_limits import OutputLimits
from workers.runtime.output_writer import OutputWriter
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.settings import WorkerSettings
from workers.runtime.worker import Worker


class RefusingConsumer:
    """A consumer whose group is rebalancing (or whose coordinator moves): every offset commit
    is refused."""

    def __init__(self, refusal: int = KafkaError.ILLEGAL_GENERATION) -> None:
        self.refusal = refusal
        self.offered: list[list[tuple[int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.offered.append([(tp.partition, tp.offset) for tp in offsets])
        raise KafkaException(KafkaError(self.refusal))


class DeliveredProducer:
    """A producer whose every record was delivered."""

    def flush(self, timeout: float) -> int:
        return 0


class RecordingStrategy:
    """A commit strategy that answers what it is told to, and records what it was offered."""

    guarantee = "at-least-once"
    restore_skips_ahead_of_commit = True
    keeps_records = True  # to see what the worker hands over

    def __init__(self) -> None:
        self.offered: list[list[tuple[int, int]]] = []
        self.records: list[list] = []
        self.refuse = True
        self.recommits = 0  # what each commit reports as committed again under a new generation

    def producer_settings(self) -> dict:
        return {}

    def start(self, producer: object, renew: object) -> None:
        pass

    def producer_failed(self, failure: Exception) -> None:
        raise failure

    def commit(
        self,
        consumer: object,
        offsets: list[TopicPartition],
        decoded_tokens: int,
        records: list,
        in_rebalance_callback: bool = False,
    ) -> CommitOutcome:
        sent = [(tp.partition, tp.offset) for tp in offsets]
        self.offered.append(sent)
        self.records.append(records)
        refused = dict(sent) if self.refuse else {}
        return CommitOutcome(
            not refused,
            0.0,
            0.0,
            decoded_tokens,
            refused_offsets=refused,
            recommits=self.recommits,
        )

    def settle(self, consumer: object) -> None:
        return None

    def committing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "refusal",
    [KafkaError.ILLEGAL_GENERATION, KafkaError.NOT_COORDINATOR],
    ids=["rebalance", "coordinator moving"],
)
def test_at_least_once_reports_offsets_a_rebalance_refused(refusal: int) -> None:
    """Refused by a rebalance or by a group coordinator on the move (a broker restarting), the
    offsets are reported refused, to be offered again, never a fatal error."""
    strategy = AtLeastOnce(Deadline())
    strategy.start(DeliveredProducer(), lambda cause: DeliveredProducer())
    consumer = RefusingConsumer(refusal)
    offsets = [TopicPartition("in", 0, 10), TopicPartition("in", 1, 20)]
    outcome = strategy.commit(consumer, offsets, decoded_tokens=7, records=[])
    assert consumer.offered == [[(0, 10), (1, 20)]]
    assert not outcome.committed and not outcome.rollback
    assert outcome.refused_offsets == {0: 10, 1: 20}
    assert outcome.decoded_tokens == 7


class CoordinatorlessConsumer:
    """A consumer whose group coordinator is gone: a synchronous commit waits (librdkafka's has
    no timeout) until the consumer is closed, which answers it _WAIT_COORD. (Capped at 5 s, so
    a worker that waits for the answer fails these tests instead of hanging them.)"""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.closed.wait(5)
        raise KafkaException(KafkaError(KafkaError._WAIT_COORD))

    def close(self) -> None:
        self.closed.set()


def test_at_least_once_gives_up_on_an_unanswered_offset_commit_at_the_shutdown_deadline() -> None:
    """A worker stopping during a broker outage must be gone by its shutdown deadline even when
    the outage began between a commit's flush and its offsets; the commit is left behind, and
    closing the consumer ends it."""
    deadline = Deadline()
    strategy = AtLeastOnce(deadline)
    strategy.start(DeliveredProducer(), lambda cause: DeliveredProducer())
    consumer = CoordinatorlessConsumer()
    deadline.set_in(0.3)  # SIGTERM came
    try:
        with pytest.raises(FatalWorkerError, match="before the shutdown deadline"):
            strategy.commit(consumer, [TopicPartition("in", 0, 10)], 1, [])
    finally:
        consumer.close()


def test_at_least_once_bounds_an_unanswered_offset_commit_by_its_budget_too() -> None:
    strategy = AtLeastOnce(Deadline(), commit_timeout_s=0.3)
    strategy.start(DeliveredProducer(), lambda cause: DeliveredProducer())
    consumer = CoordinatorlessConsumer()
    try:
        with pytest.raises(FatalWorkerError, match="not answered within"):
            strategy.commit(consumer, [TopicPartition("in", 0, 10)], 1, [])
    finally:
        consumer.close()


class ThreadRecordingConsumer:
    """Records the thread each offset commit was made on."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.threads.append(threading.current_thread())


def test_at_least_once_commits_on_the_callers_thread_inside_a_rebalance_callback() -> None:
    """Outside a callback the commit waits on a thread of its own (bounded); inside the revoke
    callback a commit from another thread deadlocked (the bench's 2-worker run: the revoke
    commit waited out its 120 s budget), so there it is made on the callback's thread."""
    strategy = AtLeastOnce(Deadline())
    strategy.start(DeliveredProducer(), lambda cause: DeliveredProducer())
    consumer = ThreadRecordingConsumer()
    offsets = [TopicPartition("in", 0, 10)]
    strategy.commit(consumer, offsets, 1, [])
    strategy.commit(consumer, offsets, 1, [], in_rebalance_callback=True)
    assert consumer.threads[0] is not threading.current_thread()
    assert consumer.threads[1] is threading.current_thread()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    settings = WorkerSettings(
        bootstrap_servers="127.0.0.1:9",  # nothing listens there; the test never waits on it
        tokenizers=[f"bytes={path}"],
        guarantee="at-least-once",
    )
    limits = OutputLimits({name: 1_048_588 for name in TopicNames().model_dump().values()})
    worker = Worker(settings, registry, PrometheusMetrics(["bytes"], registry=None), limits)
    yield worker
    worker.consumer.close()


def test_offsets_refused_by_a_rebalance_are_offered_again_for_kept_partitions(worker) -> None:
    strategy = RecordingStrategy()
    worker.strategy = strategy
    worker.ownership.assigned = {0, 2}  # partition 1 went to another member in the rebalance
    worker.checkpoint.offsets.update({0: 10, 1: 20, 2: 30})
    worker.emitter.commit()
    assert strategy.offered[0] == [(0, 10), (1, 20), (2, 30)]
    assert worker.checkpoint.offsets == {0: 10, 2: 30}
    assert worker.stats.commits == 0

    strategy.refuse = False
    worker.emitter.commit()
    assert strategy.offered[1] == [(0, 10), (2, 30)]
    assert worker.checkpoint.offsets == {} and worker.stats.commits == 1


class MovingCoordinatorConsumer:
    """A group consumer whose coordinator is moving to another broker (a rolling restart): the
    first `refusals` offset lookups answer NOT_COORDINATOR, then the committed offsets."""

    def __init__(self, refusals: int, committed: dict[int, int]) -> None:
        self.refusals = refusals
        self.committed_offsets = committed
        self.lookups = 0
        self.seeks: list[tuple[int, int]] = []

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.lookups += 1
        if self.lookups <= self.refusals:
            raise KafkaException(KafkaError(KafkaError.NOT_COORDINATOR))
        return [
            TopicPartition(tp.topic, tp.partition, self.committed_offsets[tp.partition])
            for tp in partitions
        ]

    def seek(self, partition: TopicPartition) -> None:
        self.seeks.append((partition.partition, partition.offset))

    def close(self) -> None:
        pass


def test_a_rollback_waits_out_a_moving_group_coordinator(worker, monkeypatch) -> None:
    """After an abort the worker rewinds to the group's committed offsets; a lookup answered by
    a coordinator on the move (a CI rolling restart: NOT_COORDINATOR, and the worker exited 1)
    is asked again, then the partitions rewind and restore."""
    monkeypatch.setattr(changelog, "LOOKUP_RETRY_PAUSE_S", 0.01)
    consumer = MovingCoordinatorConsumer(refusals=3, committed={0: 40, 1: -1001})
    worker.consumer.close()
    worker.consumer = consumer
    worker.ownership.assigned = {0, 1}
    worker.emitter.rollback()
    assert consumer.lookups == 4
    assert consumer.seeks == [(0, 40), (1, OFFSET_BEGINNING)]
    assert worker.ownership.restoring == {0, 1}


def test_a_rollback_while_stopping_gives_up_on_the_coordinator_unrewound(
    worker, monkeypatch
) -> None:
    """Stopping, the worker does not wait for the coordinator: its partitions stay unrestored,
    so none of their records is handled or committed, and their next owner reprocesses."""
    monkeypatch.setattr(changelog, "LOOKUP_RETRY_PAUSE_S", 0.01)
    consumer = MovingCoordinatorConsumer(refusals=1_000, committed={0: 40})
    worker.consumer.close()
    worker.consumer = consumer
    worker.ownership.assigned = {0}
    worker.stop.requested = True
    worker.emitter.rollback()
    assert consumer.lookups == 1 and consumer.seeks == []
    assert worker.ownership.restoring == {0}


class StuckClosingConsumer:
    """A consumer whose close waits for an offset commit queued for a coordinator that is gone
    (released by the test, or after 10 s)."""

    def __init__(self) -> None:
        self.closing = threading.Event()
        self.release = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.closing.set()
        self.release.wait(10)
        self.closed = True


def test_a_stopping_worker_does_not_wait_past_its_deadline_to_leave_the_group(
    worker, caplog
) -> None:
    worker.consumer.close()
    consumer = StuckClosingConsumer()
    worker.consumer = consumer
    worker.deadline.set_in(0.1)  # SIGTERM came, and the last commit used up the grace period
    try:
        worker._leave_group()
        assert consumer.closing.is_set() and not consumer.closed
        assert "leaving the group did not finish before the shutdown deadline" in caplog.text
    finally:
        consumer.release.set()


def test_ttl_clock_is_record_time_until_a_partition_is_caught_up(worker) -> None:
    """Issue 16 item 9: idleness is measured against the partition's own progress."""
    worker.ownership.owners.update({"caught-up": 0, "behind": 1, "not-read-yet": 2})
    worker.ownership.at_end.add(0)
    worker.ownership.newest_timestamp[1] = 1000.0
    reference = worker.expiry.ttl_reference(now=5000.0)
    assert reference("caught-up") == 5000.0  # nothing waits for it: wall clock
    assert reference("behind") == 1000.0  # its events may be in the backlog: record time
    assert reference("not-read-yet") == float("-inf")  # no clock until a record is read


def test_static_membership_joins_under_the_instance_id(tmp_path: Path) -> None:
    """Off, the consumer has no group.instance.id (librdkafka's dynamic membership); on, it is
    the worker's instance id, so a restarted replica rejoins as the same member."""
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    limits = OutputLimits({name: 1_048_588 for name in TopicNames().model_dump().values()})
    for static in (False, True):
        settings = WorkerSettings(
            bootstrap_servers="127.0.0.1:9",
            tokenizers=[f"bytes={path}"],
            instance_id="replica-0",
            static_membership=static,
        )
        worker = Worker(settings, registry, PrometheusMetrics(["bytes"], registry=None), limits)
        try:
            membership = membership_settings(worker.settings)
        finally:
            worker.consumer.close()
            worker.strategy.close()
        assert membership == ({"group.instance.id": "replica-0"} if static else {})


def test_a_batch_is_handled_only_after_its_partitions_are_restored(worker, monkeypatch) -> None:
    """New partitions are not paused while they restore (their input is fetched meanwhile), so
    the batch that brought their first records waits for the restore; records of partitions a
    stop left unrestored are dropped, uncommitted, never handled without their state."""
    batch = [FakeMessage(b"a", partition_number=0), FakeMessage(b"b", partition_number=1)]
    calls: list[list[int]] = []

    def restore_all(started_over: set[int]) -> Callable[[], set[int]]:
        def restore() -> set[int]:
            calls.append(sorted(worker.ownership.restoring))
            worker.ownership.restoring.clear()
            return started_over

        return restore

    def stopped_while_restoring() -> set[int]:
        calls.append(sorted(worker.ownership.restoring))
        return set()

    worker.ownership.assigned = {0, 1}
    worker.ownership.begin_restore([1])
    monkeypatch.setattr(worker.membership, "restore", restore_all(set()))
    assert worker.membership.restore_before_handling(batch) == batch
    assert calls == [[1]]

    worker.ownership.begin_restore([1])
    monkeypatch.setattr(worker.membership, "restore", stopped_while_restoring)
    assert [m.partition() for m in worker.membership.restore_before_handling(batch)] == [0]
    assert calls[-1] == [1]

    # A partition the restore started over at its beginning is fetched again from there, so
    # its records in this batch are not handled now.
    worker.ownership.restoring.clear()
    worker.ownership.begin_restore([1])
    monkeypatch.setattr(worker.membership, "restore", restore_all({1}))
    assert [m.partition() for m in worker.membership.restore_before_handling(batch)] == [0]


class SeekingConsumer:
    """Records the worker's seeks; a seek of a partition in `refuse` raises, as librdkafka's
    does for a partition in a state it cannot seek."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.seeks: list[tuple[int, int]] = []

    def seek(self, partition: TopicPartition) -> None:
        if partition.partition in self.refuse:
            raise KafkaException(KafkaError(KafkaError._STATE, "erroneous state"))
        self.seeks.append((partition.partition, partition.offset))


def test_partitions_the_group_never_committed_start_at_their_beginning_at_once(worker) -> None:
    """librdkafka starts a partition without a committed offset only when its offset query
    timer fires, 100 ms after the assignment; the restore seeks those partitions to their
    beginning (what `auto.offset.reset=earliest` would choose) and reports them, so the caller
    drops their records fetched before the seek. Committed partitions are left where they are,
    and a partition whose seek fails is not reported: its fetched records are kept."""
    consumer = SeekingConsumer(refuse={3})
    real_consumer, worker.consumer = worker.consumer, consumer
    try:
        started_over = worker.membership.start_uncommitted(
            {0: 42, 1: OFFSET_INVALID, 2: 0, 3: -1001}
        )
    finally:
        worker.consumer = real_consumer
    assert consumer.seeks == [(1, OFFSET_BEGINNING)]
    assert started_over == {1}


class ScriptedProducer:
    """A transactional producer's calls as the strategy makes them; `commit_transaction` raises
    `commit_error` once, or blocks until `release` (a call wedged in the client) when set."""

    def __init__(self, commit_error: KafkaError | None = None, wedge: bool = False) -> None:
        self.calls: list[str] = []
        self.metadata: list[object] = []  # the group metadata each offsets call carried
        self.offsets_errors: list[KafkaError] = []  # raised by the next offsets calls, in turn
        self.commit_error = commit_error
        self.wedge = wedge
        self.release = threading.Event()

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: list, metadata: object, timeout: float) -> None:
        self.calls.append("offsets")
        self.metadata.append(metadata)
        if self.offsets_errors:
            raise KafkaException(self.offsets_errors.pop(0))

    def produce(self, topic: str, value: bytes | None, **kwargs: object) -> None:
        self.calls.append(f"produce {value!r}")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        if self.wedge:
            self.release.wait()
        elif self.commit_error is not None:
            error, self.commit_error = self.commit_error, None
            raise KafkaException(error)

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")
        if self.abort_stuck:
            raise KafkaException(
                KafkaError(KafkaError._TIMED_OUT, "retry call to resume", retriable=True)
            )
        if self.abort_error is not None:
            raise KafkaException(self.abort_error)

    abort_stuck = False  # every abort call times out, as after every broker was restarted
    abort_error: KafkaError | None = None  # raised by every abort call


def group_metadata(generation: int, member: bytes = b"member-1") -> bytes:
    """librdkafka's serialised group metadata (see checkpointing.GROUP_METADATA_MAGIC)."""
    return b"CGMDv2:" + generation.to_bytes(4, "little") + b"g\x00" + member + b"\x00\x01"


class GroupConsumer:
    """A group member whose metadata is each of `generations` in turn, then the last one."""

    def __init__(self, *generations: bytes) -> None:
        self.generations = list(generations) or [group_metadata(1)]

    def consumer_group_metadata(self) -> bytes:
        if len(self.generations) > 1:
            return self.generations.pop(0)
        return self.generations[0]


class Renewals:
    """The worker's side of a replacement: a fresh producer per call, and the causes named."""

    def __init__(self) -> None:
        self.causes: list[str] = []
        self.made: list[ScriptedProducer] = []

    def __call__(self, cause: str) -> ScriptedProducer:
        self.causes.append(cause)
        self.made.append(ScriptedProducer())
        return self.made[-1]


def commit_once(strategy: ExactlyOnce) -> CommitOutcome:
    consumer = GroupConsumer()
    offsets = [TopicPartition("in", 0, 5)]
    assert strategy.commit(consumer, offsets, decoded_tokens=3, records=[]) is None
    outcome = strategy.settle(consumer)
    assert outcome is not None
    return outcome


def test_a_producers_lost_sequence_state_replaces_it_in_process() -> None:
    """After a partition leader dies with records in flight, librdkafka may declare the
    producer's sequence state lost (fatal). The strategy abandons that producer (never calls it
    again), initialises a new one under the same transactional id (which fences the old one and
    aborts its transaction) and reports a rollback, so the worker restores and re-consumes."""
    first = ScriptedProducer(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True))
    renewals = Renewals()
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(first, renewals)
    try:
        outcome = commit_once(strategy)
        assert not outcome.committed and outcome.rollback
        assert outcome.abort_cause == "producer_replaced" and outcome.decoded_tokens == 3
        assert renewals.causes == ["producer_state_lost"]
        assert first.calls == ["init", "begin", "offsets", "commit"]  # no abort, nothing after
        assert renewals.made[0].calls == ["init", "begin"]
        assert strategy.producer is renewals.made[0]
        assert commit_once(strategy).committed  # the new producer commits the next checkpoint
    finally:
        strategy.close()


def test_a_wedged_call_replaces_the_producer(monkeypatch) -> None:
    """A call that never returns (librdkafka #3779, #4420) is given up after its timeout plus
    WEDGED_CALL_SLACK_S and left on its thread; a new producer takes over."""
    monkeypatch.setattr(checkpointing, "WEDGED_CALL_SLACK_S", 0.2)
    monkeypatch.setattr(checkpointing, "CALL_TIMEOUT_S", 0.1)
    wedged = ScriptedProducer(wedge=True)
    renewals = Renewals()
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(wedged, renewals)
    try:
        outcome = commit_once(strategy)
        assert outcome.rollback and outcome.abort_cause == "producer_replaced"
        assert renewals.causes == ["wedged_call"]
        assert strategy.producer is renewals.made[0]
        assert strategy.abort()  # goes to the new producer, not to the wedged one
        assert wedged.calls == ["init", "begin", "offsets", "commit"]
        assert renewals.made[0].calls == ["init", "begin", "abort", "begin"]
    finally:
        wedged.release.set()
        strategy.close()


def test_an_abort_that_never_finishes_replaces_the_producer(monkeypatch) -> None:
    """An abort whose every call times out (seen for 50-60 s after every broker restarted) is
    given ABORT_BUDGET_S, then its producer is replaced: the new one's init_transactions aborts
    the transaction at the coordinator. The shutdown deadline still ends it as a failure."""
    monkeypatch.setattr(checkpointing, "ABORT_BUDGET_S", 0.3)
    monkeypatch.setattr(checkpointing, "CALL_TIMEOUT_S", 0.05)
    stuck = ScriptedProducer()
    stuck.abort_stuck = True
    renewals = Renewals()
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(stuck, renewals)
    try:
        assert strategy.abort()
        assert renewals.causes == ["abort_stuck"]
        assert stuck.calls[:3] == ["init", "begin", "abort"] and set(stuck.calls[2:]) == {"abort"}
        assert renewals.made[0].calls == ["init", "begin"]
        assert strategy.producer is renewals.made[0]
    finally:
        strategy.close()

    stopping = Deadline()
    stuck = ScriptedProducer()
    strategy = ExactlyOnce("detok-g-w0", stopping)
    strategy.start(stuck, renewals)
    stuck.abort_stuck = True
    stopping.set_in(0.1)  # a stop comes before the budget ends: no replacement, a failure
    try:
        with pytest.raises(FatalWorkerError, match="before the shutdown deadline"):
            strategy.abort()
        assert renewals.causes == ["abort_stuck"]
    finally:
        strategy.close()


def test_a_fencing_stays_fatal_and_replacing_is_bounded(monkeypatch) -> None:
    """A fencing means another worker owns the transactional id: a new producer would fence it
    in turn, so that stays fatal. Replacing is bounded like a commit: when no new producer
    initialises within the budget (the cluster is gone), the worker stops with the cause."""
    fenced = ScriptedProducer(KafkaError(KafkaError._FENCED, fatal=True))
    renewals = Renewals()
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(fenced, renewals)
    with pytest.raises(FatalWorkerError, match="fenced"):
        commit_once(strategy)
    assert renewals.causes == []
    strategy.close()

    monkeypatch.setattr(checkpointing, "WEDGED_CALL_SLACK_S", 0.1)
    monkeypatch.setattr(checkpointing, "CALL_TIMEOUT_S", 0.1)
    never_ready: list[ScriptedProducer] = []

    def renew_wedged(cause: str) -> ScriptedProducer:
        producer = ScriptedProducer()
        producer.init_transactions = lambda timeout: producer.release.wait()  # type: ignore[method-assign]
        never_ready.append(producer)
        return producer

    strategy = ExactlyOnce("detok-g-w0", Deadline(), commit_timeout_s=1.0)
    try:
        with pytest.raises(FatalWorkerError, match="no new producer could be initialised"):
            strategy.start(renew_wedged("first"), renew_wedged)
        assert len(never_ready) >= 3  # replaced again and again until the budget ended
    finally:
        for producer in never_ready:
            producer.release.set()
        strategy.close()


def test_a_fenced_producer_is_neither_aborted_nor_replaced(monkeypatch) -> None:
    """Once a call reported the fencing, the worker that fenced us owns the transactional id and
    has aborted our transaction. Seen in the fenced-worker test: the zombie's abort at shutdown
    got "Conflicting commit_transaction API call is already in progress" for 15 s, then its
    producer was replaced, and the new one's init_transactions fenced the successor (both
    exited 1). Now the abort is skipped and no producer is made."""
    monkeypatch.setattr(checkpointing, "ABORT_BUDGET_S", 0.3)
    monkeypatch.setattr(checkpointing, "CALL_TIMEOUT_S", 0.05)
    fenced = ScriptedProducer(KafkaError(KafkaError._FENCED, fatal=True))
    fenced.abort_error = KafkaError(
        KafkaError._CONFLICT,
        "Conflicting commit_transaction API call is already in progress",
        retriable=True,
    )
    renewals = Renewals()
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(fenced, renewals)
    try:
        with pytest.raises(FatalWorkerError, match="fenced"):
            commit_once(strategy)
        assert strategy.abort() is False
        assert renewals.causes == []
        assert fenced.calls == ["init", "begin", "offsets", "commit"]
    finally:
        strategy.close()


class FatalProducer:
    """`produce` once librdkafka put the producer in a fatal state: `_FATAL`, whatever the cause
    (a lost sequence state, a fencing); only a transactional call names that cause."""

    def produce(self, *args: object, **kwargs: object) -> None:
        raise KafkaException(KafkaError(KafkaError._FATAL))


def test_a_produce_refused_by_a_fatal_producer_is_left_to_the_commit_under_exactly_once() -> None:
    """Under exactly-once the open transaction can no longer commit, so the commit that follows
    meets the producer's own error (replaced if a new producer recovers, fatal if fenced); under
    at-least-once, where offsets follow outputs, a record not produced stops the worker."""
    topics = TopicNames()
    limits = OutputLimits({name: 1_048_588 for name in topics.model_dump().values()})
    metrics = PrometheusMetrics(["bytes"], registry=None)
    writer = OutputWriter(
        FatalProducer(), limits, topics, object(), metrics, group="g", instance_id="w0"
    )
    with pytest.raises(ProducerFailed) as failed:
        writer.write(Output(topics.deltas, b"r1", b"{}"))
    exactly_once = ExactlyOnce("detok-g-w0", Deadline())
    exactly_once.producer_failed(failed.value)  # returns: the commit finds out
    exactly_once.close()
    with pytest.raises(ProducerFailed):
        AtLeastOnce(Deadline()).producer_failed(failed.value)


class ScriptedConsumer:
    """A consumer that plays one scripted `consume` answer per call and records each call's
    timeout; an answer that is a callable runs first (the group's assignment callback)."""

    def __init__(self, worker: Worker, answers: list) -> None:
        self.worker = worker
        self.answers = answers
        self.timeouts: list[float] = []
        self.calls: list[str] = []  # what the worker asked of it, in order, beside consume
        self.assignment_reads = 0  # each one wakes librdkafka's main thread (heartbeats)

    def assignment(self) -> list[TopicPartition]:
        self.assignment_reads += 1
        return []

    def consume(self, num_messages: int, timeout: float) -> list:
        self.timeouts.append(timeout)
        answer = self.answers.pop(0)
        return answer() if callable(answer) else answer

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def list_topics(self, topic: str, timeout: float) -> None:
        self.calls.append(f"metadata of {topic}")

    def close(self) -> None:
        pass


def test_an_assignments_first_records_commit_without_waiting_for_the_interval(
    worker, monkeypatch
) -> None:
    """Issue 15 item 5: a worker that joins has no visible output until its first commit, so
    the first records of a new assignment are committed in the step that handled them; later
    records wait for the commit interval (a minute here, so only the early path can commit)."""
    worker.loop.settings = worker.loop.settings.model_copy(update={"commit_interval_ms": 60_000})
    worker.checkpoint.started_at = float("inf")  # the interval never elapses in this test
    strategy = RecordingStrategy()
    strategy.refuse = False
    worker.strategy = strategy
    monkeypatch.setattr(
        worker.membership, "restore", lambda: worker.ownership.restoring.clear() or set()
    )

    def assign() -> list:
        worker.membership.on_assign(consumer, [TopicPartition(worker.topics.input, 0)])
        return []

    consumer = ScriptedConsumer(
        worker,
        [
            assign,
            [FakeMessage(b"not an event", partition_number=0, offset_number=0)],
            [FakeMessage(b"nor this one", partition_number=0, offset_number=1)],
        ],
    )
    real_consumer, worker.consumer = worker.consumer, consumer
    try:
        worker.loop.step()  # joined and assigned; nothing to commit yet
        assert strategy.offered == []
        worker.loop.step()  # the assignment's first records: committed at once
        assert strategy.offered == [[(0, 1)]]
        worker.loop.step()  # later records wait for the interval
        assert strategy.offered == [[(0, 1)]]
        assert worker.checkpoint.offsets == {0: 2}
    finally:
        worker.consumer = real_consumer
    # Unassigned, the worker does not sit out a batch wait inside the consume that delivers
    # its assignment: the restore then starts as soon as that call returns. The consume after
    # the restore takes what was fetched meanwhile without waiting for a full batch; later
    # ones wait for it again.
    unassigned, after_the_restore, later = consumer.timeouts
    assert after_the_restore == 0 < unassigned < later


def test_a_rebalance_callback_is_followed_by_one_metadata_request_after_any_restore(
    worker, monkeypatch
) -> None:
    """Issue 15 item 5: librdkafka lets a member join a cooperative rebalance's second round
    only a second after its first, unless a metadata response resets that interval; the worker
    asks for the input topic's metadata once after each rebalance callback (outside it, and
    after a restore, which a new assignment's first output waits for), so the group's next
    round is not held up. Steps without a callback ask nothing."""

    def restore() -> set[int]:
        consumer.calls.append("restore")
        worker.ownership.restoring.clear()
        return set()

    monkeypatch.setattr(worker.membership, "restore", restore)

    def assign() -> list:
        worker.membership.on_assign(consumer, [TopicPartition(worker.topics.input, 0)])
        return []

    def assign_nothing() -> list:
        worker.membership.on_assign(consumer, [])
        return []

    consumer = ScriptedConsumer(worker, [assign_nothing, [], assign, []])
    real_consumer, worker.consumer = worker.consumer, consumer
    try:
        for _ in range(4):
            worker.loop.step()
    finally:
        worker.consumer = real_consumer
    topic = worker.topics.input
    assert consumer.calls == [f"metadata of {topic}", "restore", f"metadata of {topic}"]


def test_the_loop_wakes_the_group_thread_once_per_notice_interval(worker, monkeypatch) -> None:
    """librdkafka heartbeats only when its main thread wakes, and that thread slept up to half a
    second in an unassigned member and up to 0.3 s in one draining a backlog (its fetches stop
    while its prefetch queue is full), so members noticed rebalances late. The loop reads the
    assignment (a request that thread serves) once per REBALANCE_NOTICE_MS, however many steps
    run in between, with partitions or without."""
    clock = [1000.0]
    monkeypatch.setattr("workers.runtime.worker_loop.time.monotonic", lambda: clock[0])
    monkeypatch.setattr(
        worker.membership, "restore", lambda: worker.ownership.restoring.clear() or set()
    )
    consumer = ScriptedConsumer(worker, [[] for _ in range(8)])
    real_consumer, worker.consumer = worker.consumer, consumer
    try:
        for _ in range(3):
            worker.loop.step()
        assert consumer.assignment_reads == 1, "steps within one interval wake it once"
        clock[0] += GROUP_THREAD_WAKE_S
        for _ in range(3):
            worker.loop.step()
        assert consumer.assignment_reads == 2, "the next interval wakes it again"
        worker.ownership.assigned.add(0)
        worker.loop.step()
        assert consumer.assignment_reads == 2, "a member with partitions: once per interval too"
        clock[0] += GROUP_THREAD_WAKE_S
        worker.loop.step()
        assert consumer.assignment_reads == 3, "a member with partitions is woken as well"
    finally:
        worker.consumer = real_consumer


def refused_by_a_new_generation() -> KafkaError:
    """How librdkafka reports offsets the group refused as sent under an old generation."""
    return KafkaError(KafkaError.ILLEGAL_GENERATION, txn_requires_abort=True)


def test_a_transaction_refused_by_a_new_generation_is_committed_again_unchanged() -> None:
    """Issue 15 item 5: in a cooperative rebalance the group's generation moves twice, and a
    transaction on its way at either moment is refused (ILLEGAL_GENERATION). Rolling back redid
    every partition's uncommitted work; instead the strategy aborts it, produces the same
    records again, and commits them with the same offsets under the member's new generation."""
    producer = ScriptedProducer()
    producer.offsets_errors = [refused_by_a_new_generation()]
    strategy = ExactlyOnce("detok-g-w0", Deadline())
    strategy.start(producer, Renewals())
    # The loop committed under generation 1; by the settle the consumer is in generation 2.
    consumer = GroupConsumer(group_metadata(1), group_metadata(2))
    records = [("out", b"delta", {"key": b"r1"}), ("log", b"snapshot", {"partition": 0})]
    offsets = [TopicPartition("in", 0, 5)]
    try:
        assert strategy.commit(consumer, offsets, decoded_tokens=3, records=records) is None
        outcome = strategy.settle(consumer)
    finally:
        strategy.close()
    assert outcome is not None
    assert outcome.committed and not outcome.rollback and outcome.recommits == 1
    assert producer.calls == [
        "init",
        "begin",
        "offsets",  # refused: the transaction must abort
        "abort",
        "begin",
        "produce b'delta'",
        "produce b'snapshot'",
        "offsets",
        "commit",
        "begin",
    ]
    assert producer.metadata == [group_metadata(1), group_metadata(2)]


def test_a_refused_transaction_rolls_back_when_the_member_changed_or_its_partitions_are_lost(
    monkeypatch,
) -> None:
    """A member the group removed rejoins under a new member id, and its partitions may be
    another member's by then: its refused transaction is rolled back (restore, re-consume), as
    is one settled while the partitions are being lost (no consumer to commit under)."""
    monkeypatch.setattr(checkpointing, "RECOMMIT_WAIT_S", 0.05)
    for consumer in (
        GroupConsumer(group_metadata(1), group_metadata(2, member=b"member-2")),
        GroupConsumer(group_metadata(1)),  # the new generation never comes
        None,  # lost partitions
    ):
        producer = ScriptedProducer()
        producer.offsets_errors = [refused_by_a_new_generation()]
        strategy = ExactlyOnce("detok-g-w0", Deadline())
        strategy.start(producer, Renewals())
        committer = consumer or GroupConsumer(group_metadata(1))
        try:
            strategy.commit(committer, [TopicPartition("in", 0, 5)], 3, [("out", b"x", {})])
            outcome = strategy.settle(consumer)
        finally:
            strategy.close()
        assert outcome is not None and outcome.rollback and outcome.recommits == 0
        assert producer.calls == ["init", "begin", "offsets", "abort", "begin"]


def test_the_worker_hands_each_commit_the_records_it_produced_for_it(worker) -> None:
    """What a transaction refused by a new generation is committed again with: exactly the
    records the writer produced for that checkpoint, and nothing once it is handed over."""
    strategy = RecordingStrategy()
    strategy.refuse = False
    worker.strategy = strategy
    worker.writer.producer = ScriptedProducer()
    worker.checkpoint.offsets[0] = 1
    worker.checkpoint.outputs.append(Output(worker.topics.completions, b"r1", b"done"))
    worker.emitter.commit()
    assert [(topic, value) for topic, value, _ in strategy.records[0]] == [
        (worker.topics.completions, b"done")
    ]
    assert worker.writer.produced is None


def test_a_transaction_committed_again_is_counted_once_for_dashboards(worker) -> None:
    """A recommit is neither an abort nor a redo: a counter of its own says rebalances are
    landing on commits (the run summary alone reached no dashboard)."""
    strategy = RecordingStrategy()
    strategy.refuse = False
    worker.strategy = strategy
    for recommits in (2, 0):  # refused twice and committed on the third attempt; then not
        strategy.recommits = recommits
        worker.checkpoint.offsets[0] = 1
        worker.emitter.commit()
    scraped = generate_latest(worker.metrics.registry).decode()
    assert "detok_transactions_recommitted_total 1.0" in scraped
    assert 'detok_transactions_total{outcome="committed"} 2.0' in scraped
    assert worker.stats.recommitted_commits == 1  # the run summary agrees with the dashboard


class StuckFlushProducer(ScriptedProducer):
    """Every commit times out, as when records wait for a partition deleted under them."""

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        raise KafkaException(
            KafkaError(
                KafkaError._TIMED_OUT, "Failed to flush all outstanding messages", retriable=True
            )
        )


def test_a_commit_timing_out_on_a_deleted_topic_stops_at_once_not_after_its_budget() -> None:
    """Records produced to a topic deleted under them are never flushed: each commit call times
    out. The strategy asks `topics_gone` after a timed-out call and stops the worker at the
    first, rather than retrying for the commit's whole budget (COMMIT_TIMEOUT_S, 120 s) and
    naming the topic only then (a CI run saw that outlast the test's wait)."""
    asked: list[str] = []
    gone = iter(["", "; topic(s) t.completions no longer exist"])

    def topics_gone() -> str:
        asked.append("asked")
        return next(gone)

    producer = StuckFlushProducer()
    strategy = ExactlyOnce("detok-g-w0", Deadline(), commit_timeout_s=5)
    strategy.topics_gone = topics_gone
    strategy.start(producer, Renewals())
    try:
        with pytest.raises(FatalWorkerError, match="committing a transaction failed"):
            commit_once(strategy)
        assert producer.calls.count("commit") == 2  # retried while every topic was there
        assert asked == ["asked", "asked"]
    finally:
        strategy.close()
