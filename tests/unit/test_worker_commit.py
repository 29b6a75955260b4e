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
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.fake_records import FakeMessage
from tests.unit.small_tokenizers import byte_level
from workers import checkpointing
from workers.checkpointing import (
    AtLeastOnce,
    CommitOutcome,
    Deadline,
    ExactlyOnce,
    FatalWorkerError,
    Output,
    ProducerFailed,
)
from workers.config import WorkerSettings
from workers.output_limits import OutputLimits
from workers.output_writer import OutputWriter
from workers.prometheus import PrometheusMetrics
from workers.topic_names import TopicNames
from workers.worker import Worker


class RefusingConsumer:
    """A consumer whose group is rebalancing: every offset commit is refused."""

    def __init__(self) -> None:
        self.offered: list[list[tuple[int, int]]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.offered.append([(tp.partition, tp.offset) for tp in offsets])
        raise KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION))


class DeliveredProducer:
    """A producer whose every record was delivered."""

    def flush(self, timeout: float) -> int:
        return 0


class RecordingStrategy:
    """A commit strategy that answers what it is told to, and records what it was offered."""

    guarantee = "at-least-once"
    restore_skips_ahead_of_commit = True

    def __init__(self) -> None:
        self.offered: list[list[tuple[int, int]]] = []
        self.refuse = True

    def producer_settings(self) -> dict:
        return {}

    def start(self, producer: object, renew: object) -> None:
        pass

    def producer_failed(self, failure: Exception) -> None:
        raise failure

    def commit(
        self, consumer: object, offsets: list[TopicPartition], decoded_tokens: int
    ) -> CommitOutcome:
        sent = [(tp.partition, tp.offset) for tp in offsets]
        self.offered.append(sent)
        refused = dict(sent) if self.refuse else {}
        return CommitOutcome(not refused, 0.0, 0.0, decoded_tokens, refused_offsets=refused)

    def settle(self) -> None:
        return None

    def committing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_at_least_once_reports_offsets_a_rebalance_refused() -> None:
    strategy = AtLeastOnce(Deadline())
    strategy.start(DeliveredProducer(), lambda cause: DeliveredProducer())
    consumer = RefusingConsumer()
    offsets = [TopicPartition("in", 0, 10), TopicPartition("in", 1, 20)]
    outcome = strategy.commit(consumer, offsets, decoded_tokens=7)
    assert consumer.offered == [[(0, 10), (1, 20)]]
    assert not outcome.committed and not outcome.rollback
    assert outcome.refused_offsets == {0: 10, 1: 20}
    assert outcome.decoded_tokens == 7


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
    worker.assigned = {0, 2}  # partition 1 went to another member in the rebalance
    worker.checkpoint.offsets.update({0: 10, 1: 20, 2: 30})
    worker.commit()
    assert strategy.offered[0] == [(0, 10), (1, 20), (2, 30)]
    assert worker.checkpoint.offsets == {0: 10, 2: 30}
    assert worker.stats.commits == 0

    strategy.refuse = False
    worker.commit()
    assert strategy.offered[1] == [(0, 10), (2, 30)]
    assert worker.checkpoint.offsets == {} and worker.stats.commits == 1


def test_ttl_clock_is_record_time_until_a_partition_is_caught_up(worker) -> None:
    """Issue 16 item 9: idleness is measured against the partition's own progress."""
    worker.owners.update({"caught-up": 0, "behind": 1, "not-read-yet": 2})
    worker.at_end.add(0)
    worker.newest_timestamp[1] = 1000.0
    reference = worker.ttl_reference(now=5000.0)
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
            membership = worker._membership_settings()
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

    def restore_all() -> None:
        calls.append(sorted(worker.restoring))
        worker.restoring.clear()

    worker.assigned = {0, 1}
    worker._begin_restore([1])
    monkeypatch.setattr(worker, "_restore", restore_all)
    assert worker._restore_before_handling(batch) == batch
    assert calls == [[1]]

    worker._begin_restore([1])
    monkeypatch.setattr(worker, "_restore", lambda: calls.append(sorted(worker.restoring)))
    assert [m.partition() for m in worker._restore_before_handling(batch)] == [0]
    assert calls[-1] == [1]


class ScriptedProducer:
    """A transactional producer's calls as the strategy makes them; `commit_transaction` raises
    `commit_error` once, or blocks until `release` (a call wedged in the client) when set."""

    def __init__(self, commit_error: KafkaError | None = None, wedge: bool = False) -> None:
        self.calls: list[str] = []
        self.commit_error = commit_error
        self.wedge = wedge
        self.release = threading.Event()

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: list, metadata: object, timeout: float) -> None:
        self.calls.append("offsets")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        if self.wedge:
            self.release.wait()
        elif self.commit_error is not None:
            error, self.commit_error = self.commit_error, None
            raise KafkaException(error)

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


class GroupConsumer:
    def consumer_group_metadata(self) -> object:
        return object()


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
    assert strategy.commit(GroupConsumer(), [TopicPartition("in", 0, 5)], decoded_tokens=3) is None
    outcome = strategy.settle()
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
