"""The Kafka guarantees the pipeline is built on, checked against the real broker.

The worker will consume token events, produce deltas and commit its input offsets in one
transaction; these tests pin down that the broker really gives that: a read_committed reader sees
committed transactions only (aborted records exist in the log but stay hidden), offsets sent with
a transaction are committed with it, and consumers of one group split the partitions.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from tests.integration.conftest import WAIT_BOUND_S, consumer_config, poll_until, unique_name

pytestmark = pytest.mark.integration

RECORD_COUNT = 6
END_MARKER = b"end-marker"


def read_partition_until_marker(bootstrap: str, topic: str, isolation_level: str) -> list[bytes]:
    """All values of partition 0 of `topic`, from the start up to and including END_MARKER."""
    reader = Consumer(
        consumer_config(bootstrap, unique_name("reader"), **{"isolation.level": isolation_level})
    )
    reader.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    try:
        poll_until(
            [reader],
            lambda: END_MARKER in values,
            lambda _, message: values.append(message.value()),
        )
    finally:
        reader.close()
    return values


def test_transaction_commits_output_and_input_offsets_and_hides_aborted_records(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    source = create_topic("semantics-source", partitions=2)
    sink = create_topic("semantics-sink", partitions=1)
    group = unique_name("processor")

    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    for index in range(RECORD_COUNT):
        plain.produce(source, key=str(index).encode(), value=f"record-{index}".encode())
    assert plain.flush(WAIT_BOUND_S) == 0

    # Consume → transform → produce, committing the input offsets inside the transaction.
    processor = Consumer(
        consumer_config(kafka_bootstrap, group, **{"isolation.level": "read_committed"})
    )
    processor.subscribe([source])
    consumed: list[Message] = []
    poll_until(
        [processor],
        lambda: len(consumed) == RECORD_COUNT,
        lambda _, message: consumed.append(message),
    )

    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": unique_name("txn")}
    )
    producer.init_transactions(WAIT_BOUND_S)
    producer.begin_transaction()
    for message in consumed:
        producer.produce(sink, value=message.value().upper())
    producer.send_offsets_to_transaction(
        processor.position(processor.assignment()),
        processor.consumer_group_metadata(),
        WAIT_BOUND_S,
    )
    producer.commit_transaction(WAIT_BOUND_S)

    # An aborted transaction: its records reach the log but must never be read as committed.
    producer.begin_transaction()
    producer.produce(sink, value=b"aborted-1")
    producer.produce(sink, value=b"aborted-2")
    producer.flush(WAIT_BOUND_S)
    producer.abort_transaction(WAIT_BOUND_S)

    producer.begin_transaction()
    producer.produce(sink, value=END_MARKER)
    producer.commit_transaction(WAIT_BOUND_S)
    processor.close()

    expected = sorted(f"RECORD-{index}".encode() for index in range(RECORD_COUNT))
    committed_view = read_partition_until_marker(kafka_bootstrap, sink, "read_committed")
    assert sorted(committed_view[:-1]) == expected
    assert committed_view[-1] == END_MARKER

    # The aborted records really are in the log: a read_uncommitted reader sees them.
    uncommitted_view = read_partition_until_marker(kafka_bootstrap, sink, "read_uncommitted")
    assert b"aborted-1" in uncommitted_view and b"aborted-2" in uncommitted_view

    # The offsets sent with the committed transaction are the group's committed offsets.
    inspector = Consumer(consumer_config(kafka_bootstrap, group))
    committed = inspector.committed(
        [TopicPartition(source, 0), TopicPartition(source, 1)], timeout=WAIT_BOUND_S
    )
    inspector.close()
    assert sum(partition.offset for partition in committed) == RECORD_COUNT


def test_two_consumers_in_one_group_split_the_partitions(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    partition_count = 4
    topic = create_topic("semantics-split", partitions=partition_count)
    group = unique_name("splitters")
    first = Consumer(consumer_config(kafka_bootstrap, group))
    second = Consumer(consumer_config(kafka_bootstrap, group))
    first.subscribe([topic])
    second.subscribe([topic])

    def assigned(consumer: Consumer) -> set[int]:
        return {partition.partition for partition in consumer.assignment()}

    def split_settled() -> bool:
        mine, theirs = assigned(first), assigned(second)
        return bool(mine) and bool(theirs) and mine | theirs == set(range(partition_count))

    # Wait for the rebalance that gives both members a share before producing anything.
    poll_until([first, second], split_settled, lambda *_: pytest.fail("topic should be empty"))
    assert not assigned(first) & assigned(second)
    owner = {partition: first for partition in assigned(first)}
    owner.update({partition: second for partition in assigned(second)})

    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for partition in range(partition_count):
        producer.produce(topic, value=f"to-{partition}".encode(), partition=partition)
    assert producer.flush(WAIT_BOUND_S) == 0

    reader_of: dict[int, Consumer] = {}
    poll_until(
        [first, second],
        lambda: len(reader_of) == partition_count,
        lambda consumer, message: reader_of.__setitem__(message.partition(), consumer),
    )
    first.close()
    second.close()
    assert reader_of == owner
