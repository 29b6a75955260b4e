"""Dead-letter records on Kafka, and `detok dlq redrive`.

A dead letter keeps the original key, value, timestamp and headers, then adds error headers under
the names Kafka Connect uses (so existing DLQ tooling reads them) plus detok's own. Error headers
already on the input record (`__connect.errors.*`, `__detok.errors.*`) are dropped, not kept:
they describe no failure of ours, and keeping them let any producer make a record appear in the
dead-letter topic with a reason and message of its choosing. The one exception is the attempt
count `__detok.errors.attempt`, which `dlq redrive` sets on the records it re-produces: a valid
count is kept (a redriven record that fails again says which attempt it was), anything else
counts as attempt 0.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from pipeline.dead_letter_reasons import REASONS
from pipeline.processor import DeadLetter
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    DeliveryTracker,
    KafkaConnection,
    as_connection,
    make_admin,
    make_consumer,
    make_producer,
    sized_for,
    topic_partitions,
)
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import message_limit

CONNECT = "__connect.errors."
DETOK = "__detok.errors."
ATTEMPT_HEADER = DETOK + "attempt"
# Connect truncates nothing, but a multi-kilobyte pydantic message in every header is noise and
# eats the record size limit; the first 4 KiB always holds the cause.
MAX_MESSAGE_BYTES = 4096


def dead_letter_headers(
    letter: DeadLetter, group: str, instance_id: str, *, keep_original: bool = True
) -> list[tuple[str, bytes | None]]:
    """The record's own headers (error headers removed), then this failure's error headers.

    `keep_original=False` leaves the record's own headers out: for an `output_too_large` dead
    letter, which must fit even when those headers are what made the record too large.
    """
    origin = letter.origin
    headers = list(origin.headers) if origin is not None else []
    attempt = next((_attempt(v) for k, v in headers if k == ATTEMPT_HEADER), 0)
    own = [(k, v) for k, v in headers if not k.startswith((CONNECT, DETOK))]
    error_headers = {
        CONNECT + "topic": origin.source if origin else "",
        CONNECT + "partition": str(origin.partition) if origin else "",
        CONNECT + "offset": str(origin.offset) if origin else "",
        CONNECT + "exception.class.name": letter.error_class,
        CONNECT + "exception.message": letter.message.encode()[:MAX_MESSAGE_BYTES].decode(
            "utf-8", "ignore"
        ),
        CONNECT + "stage": REASONS[letter.reason].stage,
        CONNECT + "connector.name": group,
        CONNECT + "task.id": instance_id,
        DETOK + "reason": letter.reason.value,
        DETOK + "request_id": letter.request_id or "",
        DETOK + "seq": "" if letter.seq is None else str(letter.seq),
        ATTEMPT_HEADER: str(attempt),
    }
    encoded = [(k, v.encode("utf-8", "surrogateescape")) for k, v in error_headers.items()]
    return (own if keep_original else []) + encoded


def dead_letter_key(letter: DeadLetter) -> bytes | None:
    if letter.origin is not None:
        return letter.origin.key
    return letter.request_id.encode() if letter.request_id else None


# How long one redriven record may wait for its acknowledgement before it counts as undelivered.
DELIVERY_TIMEOUT_S = 60.0


def redrive_headers(headers: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Strip this failure's error headers, keep the rest, count the attempt."""
    attempt = 0
    kept = []
    for key, value in headers:
        if key == ATTEMPT_HEADER:
            attempt = _attempt(value)
        elif not key.startswith((CONNECT, DETOK)):
            kept.append((key, value))
    return kept + [(ATTEMPT_HEADER, str(attempt + 1).encode())]


def _attempt(value: bytes | None) -> int:
    """The attempt count a dead letter carries; anything but a non-negative integer counts as 0.

    The header comes from whoever produced the record: a garbled or forged value must not stop a
    redrive halfway (which used to lose the record already queued).
    """
    try:
        attempt = int((value or b"0").decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return 0
    return max(attempt, 0)


def redrive(
    connection: KafkaConnection | str,
    names: TopicNames,
    *,
    reason: str | None = None,
    idle_timeout_s: float = 5.0,
) -> int:
    """Re-produce the dead letters present now (optionally of one reason) to the input topic, in
    order; the number delivered.

    Only records below each partition's end offset at the start are redriven: running workers
    dead-letter a redriven record again if it still fails, and reading on would send it round
    forever. Raises KafkaUnavailable or UnknownTopic before reading anything, and
    UndeliveredRecords (after the whole range) if any record was not delivered.
    """
    connection = as_connection(connection)
    consumer = make_consumer(
        connection,
        {
            "group.id": f"detok-redrive-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        },
        start_up=True,
    )
    tracker = DeliveryTracker()
    try:
        topic_partitions(consumer, names.input, METADATA_TIMEOUT_S)
        limit = message_limit(make_admin(connection), names.input, METADATA_TIMEOUT_S)
        producer = make_producer(
            connection, {**sized_for(limit), "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000)}
        )
        for message in _records_present(consumer, names.dead_letters, idle_timeout_s):
            headers = message.headers() or []
            if reason is not None and (DETOK + "reason", reason.encode()) not in headers:
                continue
            tracker.produce(
                producer, names.input, message.value(), key=message.key(),
                headers=redrive_headers(headers),
            )  # fmt: skip
            producer.poll(0)
    finally:
        consumer.close()
    return tracker.settle(producer, DELIVERY_TIMEOUT_S + 5).delivered


def _records_present(consumer: Consumer, topic: str, idle_timeout_s: float) -> Iterator[Message]:
    """The records of `topic` below each partition's end offset as of now, in partition order.

    A partition is done at its captured end, or at its end of partition (under read_committed
    that is the last stable offset, which may lie below the captured end while a transaction is
    open). Nothing arriving for `idle_timeout_s` also ends the read.
    """
    ends = {}
    for partition in topic_partitions(consumer, topic, METADATA_TIMEOUT_S):
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), METADATA_TIMEOUT_S, cached=False
        )
        if high > low:
            ends[partition] = (low, high)
    consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
    pending = set(ends)
    last_message = time.monotonic()
    while pending and time.monotonic() - last_message < idle_timeout_s:
        message = consumer.poll(0.5)
        if message is None:
            continue
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                pending.discard(message.partition())
            elif error.fatal():
                raise KafkaException(error)
            continue
        last_message = time.monotonic()
        partition, offset = message.partition(), message.offset()
        end = ends[partition][1]
        if offset + 1 >= end:
            pending.discard(partition)
        if offset < end:
            yield message
