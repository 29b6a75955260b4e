"""The worker's bookkeeping without a broker: commits, and the TTL clock.

What a broker answers is covered by tests/integration; here what happens when the group refuses
an offset commit (a rebalance), which no broker produces on demand: the at-least-once strategy
reports the refused offsets, and the worker offers them again for the partitions it kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.fake_records import FakeMessage
from tests.unit.small_tokenizers import byte_level
from workers.checkpointing import (
    AtLeastOnce,
    CommitOutcome,
    Deadline,
    FatalWorkerError,
    restart_recovers,
)
from workers.config import WorkerSettings
from workers.output_limits import OutputLimits
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

    def start(self, producer: object) -> None:
        pass

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
    strategy.start(DeliveredProducer())
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


def test_a_producers_lost_sequence_state_asks_for_a_restart_and_a_fencing_does_not() -> None:
    """After a partition leader dies with records in flight, librdkafka may declare the
    producer's sequence state lost (fatal); a restarted worker recovers, so the worker exits with
    RESTART_EXIT_CODE. A fencing means another worker owns the id: a restart would not help."""
    lost = KafkaException(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True))
    fenced = KafkaException(KafkaError(KafkaError._FENCED, fatal=True))
    wrapped = FatalWorkerError("committing a transaction failed")
    wrapped.__cause__ = lost
    assert restart_recovers(lost)
    assert restart_recovers(wrapped)
    assert not restart_recovers(fenced)
    assert not restart_recovers(FatalWorkerError("input topic gone"))


class ScriptedConsumer:
    """A consumer that plays one scripted `consume` answer per call and records each call's
    timeout; an answer that is a callable runs first (the group's assignment callback)."""

    def __init__(self, worker: Worker, answers: list) -> None:
        self.worker = worker
        self.answers = answers
        self.timeouts: list[float] = []
        self.calls: list[str] = []  # what the worker asked of it, in order, beside consume

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
    worker.settings = worker.settings.model_copy(update={"commit_interval_ms": 60_000})
    worker.checkpoint.started_at = float("inf")  # the interval never elapses in this test
    strategy = RecordingStrategy()
    strategy.refuse = False
    worker.strategy = strategy
    monkeypatch.setattr(worker, "_restore", lambda: worker.restoring.clear())

    def assign() -> list:
        worker._on_assign(consumer, [TopicPartition(worker.topics.input, 0)])
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
        worker._step()  # joined and assigned; nothing to commit yet
        assert strategy.offered == []
        worker._step()  # the assignment's first records: committed at once
        assert strategy.offered == [[(0, 1)]]
        worker._step()  # later records wait for the interval
        assert strategy.offered == [[(0, 1)]]
        assert worker.checkpoint.offsets == {0: 2}
    finally:
        worker.consumer = real_consumer
    # Unassigned, the worker does not sit out a batch wait inside the consume that delivers
    # its assignment: the restore then starts as soon as that call returns.
    unassigned, assigned = consumer.timeouts[0], consumer.timeouts[1]
    assert unassigned < assigned


def test_a_rebalance_callback_is_followed_by_one_metadata_request_after_any_restore(
    worker, monkeypatch
) -> None:
    """Issue 15 item 5: librdkafka lets a member join a cooperative rebalance's second round
    only a second after its first, unless a metadata response resets that interval; the worker
    asks for the input topic's metadata once after each rebalance callback (outside it, and
    after a restore, which a new assignment's first output waits for), so the group's next
    round is not held up. Steps without a callback ask nothing."""

    def restore() -> None:
        consumer.calls.append("restore")
        worker.restoring.clear()

    monkeypatch.setattr(worker, "_restore", restore)

    def assign() -> list:
        worker._on_assign(consumer, [TopicPartition(worker.topics.input, 0)])
        return []

    def assign_nothing() -> list:
        worker._on_assign(consumer, [])
        return []

    consumer = ScriptedConsumer(worker, [assign_nothing, [], assign, []])
    real_consumer, worker.consumer = worker.consumer, consumer
    try:
        for _ in range(4):
            worker._step()
    finally:
        worker.consumer = real_consumer
    topic = worker.topics.input
    assert consumer.calls == [f"metadata of {topic}", "restore", f"metadata of {topic}"]
