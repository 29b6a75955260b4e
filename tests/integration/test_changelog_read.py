"""What a restore reads from a real changelog topic (`workers.runtime.changelog`), and when.

Under at-least-once a snapshot is produced before its input offsets commit, so a kill -9 can
leave a request's newest snapshot ahead of the commit. The restore must then take the snapshot
before it, never nothing: the input replayed from the commit continues that older state. (The
kill -9 test in test_worker_at_least_once.py met this now and then, as missing completions.)
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.integration.conftest import unique_name
from tests.integration.worker_harness import pipeline_topics
from workers.kafka.clients import KafkaConnection
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, read_latest, settled_commits

pytestmark = pytest.mark.integration


def _write(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, bytes]]) -> None:
    """(key, value, processed-offset header) records, in order, to partition 0."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value, processed in records:
        producer.produce(
            topic, value, key, partition=0, headers=[(PROCESSED_OFFSET_HEADER, processed)]
        )
    assert producer.flush(30) == 0


def _read(bootstrap: str, topic: str, committed_input: dict[int, int] | None) -> dict:
    latest = read_latest(
        KafkaConnection(bootstrap), unique_name("g"), topic, [0], lambda: False, committed_input
    )
    return {key: message.value() for key, message in latest.items()}


def test_a_snapshot_ahead_of_the_commit_gives_way_to_the_one_before_it(
    kafka_bootstrap: str,
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=1)
    _write(
        kafka_bootstrap,
        names.changelog,
        [
            (b"older", b"older@3", b"3"),
            (b"older", b"older@9", b"9"),  # the input up to 9 committed (next offset 10)
            (b"older", b"older@14", b"14"),  # written, then killed before its offsets committed
            (b"new", b"new@12", b"12"),  # a request opened after the commit: replayed whole
            (b"damaged", b"damaged@?", b"x"),  # kept: the restore dead-letters it
        ],
    )
    assert _read(kafka_bootstrap, names.changelog, {0: 10}) == {
        b"older": b"older@9",
        b"damaged": b"damaged@?",
    }
    # Exactly-once reads only committed snapshots (read_committed): the newest is the state.
    assert _read(kafka_bootstrap, names.changelog, None) == {
        b"older": b"older@14",
        b"new": b"new@12",
        b"damaged": b"damaged@?",
    }


def test_the_restore_waits_for_the_previous_owners_last_transaction(kafka_bootstrap: str) -> None:
    """The previous owner's last transaction holds its final snapshot and its offsets; a new
    owner must not read the changelog before that transaction settles, or it restores without
    the snapshot while its input starts after it (a join run dead-lettered 431 events so)."""
    names = pipeline_topics(kafka_bootstrap, partitions=1)
    group = unique_name("g")
    member = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": group,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    previous_owner = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": unique_name("owner")}
    )
    previous_owner.init_transactions(30)
    previous_owner.begin_transaction()
    previous_owner.produce(
        names.changelog, b"last@41", b"req", partition=0, headers=[(PROCESSED_OFFSET_HEADER, b"41")]
    )
    previous_owner.send_offsets_to_transaction(
        [TopicPartition(names.input, 0, 42)], member.consumer_group_metadata(), 30
    )
    previous_owner.flush(30)
    waits: list[bool] = []

    def should_stop() -> bool:  # asked after each lookup that timed out on the pending offsets
        waits.append(True)
        if len(waits) == 2:
            previous_owner.commit_transaction(30)
        return False

    try:
        committed = settled_commits(member, names.input, [0], should_stop, lookup_timeout_s=0.5)
    finally:
        member.close()
    assert waits, "the lookup waited while the transaction was open"
    assert committed == {0: 42}
    assert _read(kafka_bootstrap, names.changelog, None) == {b"req": b"last@41"}
