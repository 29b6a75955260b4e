"""Follow requests' text as the workers commit it: `detok follow` and a library iterator.

A read_committed consumer reads the deltas and completions topics from their start (a request's
deltas are on one partition, but which one depends on the topic's partition count, so every
partition is read and other requests' records are skipped by key) and hands them to
`TextAssembler`, which places each delta by its offset under either guarantee. Following one
request ends at its completion; following all of them ends only after `idle_timeout_s` without
a record, or never.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from pipeline.text_assembly import TextAssembler, TextUpdate
from schemas.events import Completion, TextDelta
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    KafkaConnection,
    as_connection,
    make_consumer,
    topic_partitions,
)
from workers.kafka.topic_names import TopicNames

# How long the broker may hold a fetch for new records: a follower shows text this long (at
# most) after it is committed, past the worker's own commit interval.
FETCH_WAIT_MS = 50


def follow(
    connection: KafkaConnection | str,
    names: TopicNames,
    request_id: str | None = None,
    *,
    idle_timeout_s: float | None = None,
) -> Iterator[TextUpdate]:
    """The committed text of `request_id` (or of every request), update by update, until its
    completion (for one request) or `idle_timeout_s` without a record (None: wait forever).

    Raises KafkaUnavailable or UnknownTopic (within METADATA_TIMEOUT_S) before reading, and
    KafkaException on a fatal client error.
    """
    consumer = make_consumer(
        as_connection(connection),
        {
            "group.id": f"detok-follow-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": FETCH_WAIT_MS,
        },
        start_up=True,
    )
    wanted = None if request_id is None else request_id.encode()
    assembler = TextAssembler()
    try:
        consumer.assign(
            [
                TopicPartition(topic, partition, OFFSET_BEGINNING)
                for topic in (names.deltas, names.completions)
                for partition in topic_partitions(consumer, topic, METADATA_TIMEOUT_S)
            ]
        )
        last_record = time.monotonic()
        while idle_timeout_s is None or time.monotonic() - last_record < idle_timeout_s:
            for message in consumer.consume(1000, 0.1):
                error = message.error()
                if error is not None:
                    if error.fatal():
                        raise KafkaException(error)
                    continue
                last_record = time.monotonic()
                if wanted is not None and message.key() != wanted:
                    continue
                if message.topic() == names.deltas:
                    yield from assembler.delta(TextDelta.model_validate_json(message.value()))
                    continue
                update = assembler.completion(Completion.model_validate_json(message.value()))
                if update is not None:
                    yield update
                    if wanted is not None:
                        return
    finally:
        consumer.close()
