"""`detok replay` and `detok collect`: logged generations onto Kafka, completions back off it.

Replay reads logged generations through `workers.formats` (JSONL, Parquet, OpenAI batch output),
cuts every one into the events an inference server would have sent (the same
cut as `detok run`), interleaves requests the way concurrent generations interleave, and produces
them keyed by request id with Java's murmur2 partitioner. Collect reads the completions topic
(read_committed) into `detok run`'s output formats, so the two can be compared line for line.

Both check the cluster first (KafkaUnavailable, UnknownTopic within METADATA_TIMEOUT_S), and replay
counts every delivery: it raises UndeliveredRecords, after sending everything it could, when a
record was refused (one over the topic's `max.message.bytes`, say) or never acknowledged.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import msgspec
from confluent_kafka import KafkaException, Producer, TopicPartition
from tqdm import tqdm

from pipeline.decode_state import PROMPT_CONTEXT_IDS
from pipeline.generations import DEFAULT_CHUNK_SIZE, generation_events
from pipeline.records import SourceRecord
from schemas.events import Completion
from schemas.fast_events import ParsedEvent, ParsedPrompt, encode_event
from schemas.validation import Rejection, is_record_fault, parse_model
from workers.formats import completion_writer, format_of, reading, replacing
from workers.formats.base import RequestFailure
from workers.kafka_clients import (
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
from workers.output_limits import RECORD_OVERHEAD_BYTES
from workers.topics import message_limit

log = logging.getLogger("detok.replay")

# Requests in flight at once while replaying; like `detok run`'s window, so per-partition event
# order looks like a server streaming this many generations concurrently.
REPLAY_WINDOW = 256
# How long one record may wait for its acknowledgement (librdkafka retries within it) before it
# counts as not delivered; a broker that goes away mid-replay ends the command within this bound.
DELIVERY_TIMEOUT_S = 60.0
# A 20 ms linger fills batches of many small events; lz4 halves the bytes of the JSON id lists at
# little CPU cost.
REPLAY_PRODUCER_SETTINGS = {"linger.ms": 20, "compression.type": "lz4"}


# One Kafka record: key (None for a record that is passed through unkeyed) and value.
KafkaRecord = tuple[bytes | None, bytes]


@dataclass
class ReplayTotals:
    requests: int = 0
    events: int = 0
    generated_tokens: int = 0
    invalid_records: int = 0


def replay_events(
    records: Iterable[SourceRecord],
    chunk_size: int,
    *,
    prompt_tail: int | None = None,
    max_record_bytes: int | None = None,
) -> Iterator[KafkaRecord]:
    """Kafka records for a stream of input records, REPLAY_WINDOW requests interleaved.

    Prompts go whole unless `prompt_tail` asks for tails, or a prompt record would exceed
    `max_record_bytes` (see `_prompt_record`)."""
    window: list[list[KafkaRecord]] = []
    for record in records:
        window.append(record_events(record, chunk_size, prompt_tail, max_record_bytes))
        if len(window) == REPLAY_WINDOW:
            yield from _interleave(window)
            window = []
    yield from _interleave(window)


def record_events(
    record: SourceRecord,
    chunk_size: int,
    prompt_tail: int | None = None,
    max_record_bytes: int | None = None,
) -> list[KafkaRecord]:
    """The Kafka records of one input record: its generation's events keyed by request id; an
    invalid record passes through unkeyed as it was read, so the worker dead-letters it exactly
    as it would a broken producer's record."""
    if isinstance(record.parsed, Rejection):
        return [(None, record.original())]
    key = record.parsed.request_id.encode()
    try:
        events = generation_events(record.parsed, chunk_size)
    except BaseException as error:
        # One generation the events refuse (a reader that let it through, issue 32) goes as
        # an invalid record does; the rest of the file is replayed.
        if not is_record_fault(error) or isinstance(error, MemoryError):
            raise
        log.warning(
            "%s: not replayed as events (%s: %s)", record.position, type(error).__name__, error
        )
        return [(None, record.original())]
    return [
        (key, _prompt_record(event, key, prompt_tail, max_record_bytes))
        if type(event) is ParsedPrompt
        else (key, encode_event(event))
        for event in events
    ]


def _prompt_record(
    event: ParsedEvent, key: bytes, prompt_tail: int | None, max_record_bytes: int | None
) -> bytes:
    """A prompt event's value: the whole prompt, or its tail with the full count.

    A tail of `PROMPT_CONTEXT_IDS` ids decodes exactly as the whole prompt
    (docs/production-shapes.md, 'Prompt tails'), so a prompt too large for the topic (a 150k-id
    prompt passes Kafka's default 1 MB) is sent as that tail rather than refused; `prompt_tail`
    asks for tails of every prompt.
    """
    assert type(event) is ParsedPrompt
    ids = event.prompt_token_ids
    count = len(ids) if event.prompt_tokens is None else event.prompt_tokens
    if prompt_tail is not None and len(ids) > prompt_tail:
        return encode_event(_with_tail(event, prompt_tail, count))
    value = encode_event(event)
    if (
        max_record_bytes is not None
        and len(value) + len(key) + RECORD_OVERHEAD_BYTES > max_record_bytes
        and len(ids) > PROMPT_CONTEXT_IDS
    ):
        log.info(
            "request %s: prompt of %d ids is %d bytes, over the record limit %d: sending its "
            "last %d ids with prompt_tokens=%d",
            event.request_id,
            count,
            len(value),
            max_record_bytes,
            PROMPT_CONTEXT_IDS,
            count,
        )
        return encode_event(_with_tail(event, PROMPT_CONTEXT_IDS, count))
    return value


def _with_tail(event: ParsedPrompt, tail: int, count: int) -> ParsedPrompt:
    return msgspec.structs.replace(
        event, prompt_token_ids=event.prompt_token_ids[-tail:], prompt_tokens=count
    )


def _interleave(window: list[list[KafkaRecord]]) -> Iterator[KafkaRecord]:
    for round_records in zip_longest(*window):
        yield from (record for record in round_records if record is not None)


def replay(
    connection: KafkaConnection | str,
    input_path: Path,
    topic: str,
    *,
    input_format: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    rate: float | None = None,
    progress: bool = True,
    prompt_tail: int | None = None,
) -> ReplayTotals:
    """Produce the events of every record of `input_path` to `topic`.

    The producer's record limit is the topic's `max.message.bytes`, so a record the broker would
    refuse is refused alone, at once, instead of failing every record batched with it; it is
    counted, and the rest goes on. A prompt record that would pass the limit is sent as its tail
    (`_prompt_record`); `prompt_tail` sends every prompt longer than that as its last
    `prompt_tail` ids. Raises UndeliveredRecords (after the whole file) if anything
    was not delivered, KafkaUnavailable or UnknownTopic before producing anything, FormatError
    when the file cannot be read as its format.
    """
    # The file is opened (and its format checked) before anything touches the cluster.
    with reading(input_path, format_of(input_path, input_format), progress=None) as records:
        connection = as_connection(connection)
        admin = make_admin(connection)
        topic_partitions(admin, topic, METADATA_TIMEOUT_S)
        limit = message_limit(admin, topic, METADATA_TIMEOUT_S)
        producer = make_producer(
            connection,
            {
                **REPLAY_PRODUCER_SETTINGS,
                **sized_for(limit),
                "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000),
            },
        )
        tracker = DeliveryTracker()
        events = replay_events(records, chunk_size, prompt_tail=prompt_tail, max_record_bytes=limit)
        totals = _produce(producer, tracker, events, topic, rate, progress)
    # Past DELIVERY_TIMEOUT_S every record has its report; the margin covers the last callbacks.
    tracker.settle(producer, DELIVERY_TIMEOUT_S + 5)
    return totals


def _produce(
    producer: Producer,
    tracker: DeliveryTracker,
    records: Iterator[KafkaRecord],
    topic: str,
    rate: float | None,
    progress: bool,
) -> ReplayTotals:
    totals = ReplayTotals()
    started = time.monotonic()
    bar = tqdm(desc="replay", unit="ev", file=sys.stderr, disable=not progress)
    for key, value in records:
        tracker.produce(producer, topic, value, key=key)
        totals.events += 1
        if key is None:
            totals.invalid_records += 1
        elif value.startswith(b'{"type":"prompt"'):
            totals.requests += 1
        if rate is not None:
            # Sleep off any lead over the schedule `rate` events per second sets.
            lead = totals.events / rate - (time.monotonic() - started)
            if lead > 0:
                time.sleep(lead)
        if totals.events % 1000 == 0:
            producer.poll(0)
            bar.update(1000)
    bar.update(totals.events % 1000)
    bar.close()
    return totals


@dataclass
class Collected:
    """What `collect` read: the latest completion per request id, and the records it left out.

    A tombstone (a null value: a compacted delete of the request's completion) deletes the
    completion read before it under its key, as compaction would; a value that is not a
    completion is skipped. Either used to end every collect of the topic with a traceback
    (issue 32); both are counted, for the command's summary.
    """

    completions: dict[str, Completion] = field(default_factory=dict)
    tombstones: int = 0
    invalid: int = 0

    def add(self, key: bytes | None, value: bytes | None, where: str) -> None:
        if value is None:
            self.tombstones += 1
            if key is not None:
                self.completions.pop(key.decode("utf-8", errors="replace"), None)
            return
        parsed = parse_model(Completion, value)
        if isinstance(parsed, Rejection):
            self.invalid += 1
            log.warning(
                "%s is not a completion, skipped: %s", where, parsed.message.splitlines()[0]
            )
            return
        self.completions[parsed.request_id] = parsed


def collect(
    connection: KafkaConnection | str,
    topic: str,
    *,
    expect: int | None = None,
    idle_timeout_s: float = 10.0,
) -> Collected:
    """Latest completion per request id, read_committed, until `expect` or idle.

    Raises KafkaUnavailable or UnknownTopic (within METADATA_TIMEOUT_S) before reading, and
    KafkaException on a fatal client error; transient errors are librdkafka's to retry.
    """
    consumer = make_consumer(
        as_connection(connection),
        {
            "group.id": f"detok-collect-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        },
        start_up=True,
    )
    collected = Collected()
    try:
        partitions = topic_partitions(consumer, topic, METADATA_TIMEOUT_S)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        last_new = time.monotonic()
        while time.monotonic() - last_new < idle_timeout_s:
            if expect is not None and len(collected.completions) >= expect:
                break
            for message in consumer.consume(1000, 0.2):
                error = message.error()
                if error is not None:
                    if error.fatal():
                        raise KafkaException(error)
                    continue
                where = f"{topic} partition {message.partition()} offset {message.offset()}"
                collected.add(message.key(), message.value(), where)
                last_new = time.monotonic()
    finally:
        consumer.close()
    return collected


def write_completions(
    path: Path, completions: dict[str, Completion], fmt: str = "jsonl", *, created: int = 0
) -> list[RequestFailure]:
    """Every completion, by request id, in `fmt` (an output format of `workers.formats`); the
    completions the format could not hold are left out and returned.

    `created` stamps the OpenAI shapes (their `created` is a Unix time in seconds).
    """
    with replacing(path) as destination:
        writer = completion_writer(destination, fmt, created=created)
        try:
            for request_id in sorted(completions):
                writer.write(completions[request_id], None)
        finally:
            writer.close()
    return writer.refused
