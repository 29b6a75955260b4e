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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import KafkaException, TopicPartition
from tqdm import tqdm

from pipeline.generations import DEFAULT_CHUNK_SIZE, generation_events
from pipeline.records import SourceRecord
from schemas.events import Completion
from schemas.fast_events import ParsedEvent, ParsedPrompt, ParsedTokens
from schemas.validation import Rejection, is_row_fault, parse_model
from workers.formats import completion_writer, format_of, reading, replacing
from workers.formats.base import RequestFailure, carries_chat
from workers.io.publish.events import RequestEvents
from workers.io.publish.publisher import FailedRecord, Publisher
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    KafkaConnection,
    as_connection,
    make_consumer,
    topic_partitions,
)

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


class EventTarget(Protocol):
    """Where replay's events go: a `Publisher`, or `_RecordList` (the same core, no broker)."""

    def open(
        self, request_id: str, model: str, prompt_token_ids: Sequence[int], **options: Any
    ) -> None: ...

    def append(
        self, request_id: str, token_ids: Sequence[int], logprobs: Any, top_logprobs: Any
    ) -> None: ...

    def finish(self, request_id: str, finish_reason: str | None) -> None: ...

    def pass_through(self, value: bytes) -> None: ...


class _RecordList:
    """The publisher's event core (`RequestEvents`, coalescing off) writing into a list."""

    def __init__(self, prompt_tail: int | None, max_record_bytes: int | None) -> None:
        self.records: list[KafkaRecord] = []
        events = RequestEvents(
            self._sink,
            coalesce=False,
            max_record_bytes=max_record_bytes,
            prompt_tail=prompt_tail,
            log=log,
        )
        self.open, self.append, self.finish = events.open, events.append, events.finish

    def _sink(self, key: bytes, value: bytes, _seq: int) -> None:
        self.records.append((key, value))

    def pass_through(self, value: bytes) -> None:
        self.records.append((None, value))


def replay_events(
    records: Iterable[SourceRecord],
    chunk_size: int,
    *,
    prompt_tail: int | None = None,
    max_record_bytes: int | None = None,
) -> Iterator[KafkaRecord]:
    """Kafka records for a stream of input records, REPLAY_WINDOW requests interleaved: what
    `replay` produces, built by the same publisher core without a broker.

    Prompts go whole unless `prompt_tail` asks for tails, or a prompt record would exceed
    `max_record_bytes` (see `RequestEvents.prompt_record`)."""
    target = _RecordList(prompt_tail, max_record_bytes)
    for _ in publish_records(records, chunk_size, target):
        yield from target.records
        target.records.clear()


def publish_records(
    records: Iterable[SourceRecord], chunk_size: int, target: EventTarget
) -> Iterator[ParsedEvent | bytes]:
    """Send every input record's events to `target`, REPLAY_WINDOW requests interleaved the way
    concurrent generations interleave; yields each event once sent (an invalid record's bytes).

    Each generation is cut as `detok run` cuts it (`generation_events`) and each cut is one
    publisher call, so the publisher's seqs are the cut's. An invalid record passes through
    unkeyed as it was read, so the worker dead-letters it exactly as a broken producer's record.
    """
    window: list[SourceRecord] = []
    for record in records:
        window.append(record)
        if len(window) == REPLAY_WINDOW:
            yield from _publish_window(window, chunk_size, target)
            window = []
    yield from _publish_window(window, chunk_size, target)


def _publish_window(
    window: list[SourceRecord], chunk_size: int, target: EventTarget
) -> Iterator[ParsedEvent | bytes]:
    streams = [_record_events(record, chunk_size) for record in window]
    for round_events in zip_longest(*streams):
        for event in round_events:
            if event is not None:
                _send_event(event, target)
                yield event


def _record_events(record: SourceRecord, chunk_size: int) -> list[ParsedEvent | bytes]:
    """One input record's events; an invalid record, or one whose generation the events
    refuse (a reader that let it through, issue 32), passes through unkeyed as it was read, so
    the worker dead-letters it as it would a broken producer's record; the rest is replayed."""
    if isinstance(record.parsed, Rejection):
        return [record.original()]
    try:
        return list(generation_events(record.parsed, chunk_size))
    except BaseException as error:
        if not is_row_fault(error):
            raise
        log.warning(
            "%s: not replayed as events (%s: %s)", record.position, type(error).__name__, error
        )
        return [record.original()]


def _send_event(event: ParsedEvent | bytes, target: EventTarget) -> None:
    """One event (or an invalid record's bytes) as its publisher call."""
    if isinstance(event, bytes):
        target.pass_through(event)
    elif type(event) is ParsedPrompt:
        target.open(
            event.request_id,
            event.model,
            event.prompt_token_ids,
            skip_special_tokens=event.skip_special_tokens,
            stop=event.stop,
            include_stop_str_in_output=event.include_stop_str_in_output,
            prompt_tokens=event.prompt_tokens,
            tools=event.tools,
        )
    elif type(event) is ParsedTokens:
        target.append(event.request_id, event.token_ids, event.logprobs, event.top_logprobs)
    else:
        target.finish(event.request_id, event.finish_reason)


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
    """Produce the events of every record of `input_path` to `topic`, through the engines'
    `Publisher` with coalescing off (each cut is one event).

    The producer's record limit is the topic's `max.message.bytes`, so a record the broker would
    refuse is refused alone, at once, instead of failing every record batched with it; it is
    counted, and the rest goes on. A prompt record that would pass the limit is sent as its tail;
    `prompt_tail` sends every prompt longer than that as its last `prompt_tail` ids. Raises
    UndeliveredRecords (after the whole file) if anything was not delivered, KafkaUnavailable or
    UnknownTopic before producing anything, FormatError when the file cannot be read as its
    format.
    """
    # The file is opened (and its format checked) before anything touches the cluster.
    with reading(input_path, format_of(input_path, input_format), progress=None) as records:
        publisher = Publisher(
            connection,
            topic,
            linger_s=0,
            on_error=_log_failure,
            prompt_tail=prompt_tail,
            delivery_timeout_s=DELIVERY_TIMEOUT_S,
            producer_settings=REPLAY_PRODUCER_SETTINGS,
            log=log,
        )
        try:
            totals = _produce(publisher, records, chunk_size, rate, progress)
        finally:
            # Past DELIVERY_TIMEOUT_S every record has its report; close raises if any failed.
            publisher.close()
    return totals


def _log_failure(failure: FailedRecord) -> None:
    """Replay goes on past a failed record and counts it (UndeliveredRecords at the end)."""
    log.warning("request %s seq %s not delivered: %s", failure.request_id, failure.seq,
                failure.error)  # fmt: skip


def _produce(
    publisher: Publisher,
    records: Iterable[SourceRecord],
    chunk_size: int,
    rate: float | None,
    progress: bool,
) -> ReplayTotals:
    totals = ReplayTotals()
    started = time.monotonic()
    bar = tqdm(desc="replay", unit="ev", file=sys.stderr, disable=not progress)
    for event in publish_records(records, chunk_size, publisher):
        totals.events += 1
        if isinstance(event, bytes):
            totals.invalid_records += 1
        elif type(event) is ParsedPrompt:
            totals.requests += 1
        elif type(event) is ParsedTokens:
            totals.generated_tokens += len(event.token_ids)
        if rate is not None:
            # Sleep off any lead over the schedule `rate` events per second sets.
            lead = totals.events / rate - (time.monotonic() - started)
            if lead > 0:
                time.sleep(lead)
        if totals.events % 1000 == 0:
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

    `created` stamps the OpenAI shapes (their `created` is a Unix time in seconds). Parquet has
    the chat outputs' columns when a completion carries one of them.
    """
    chat = any(carries_chat(completion) for completion in completions.values())
    with replacing(path) as destination:
        writer = completion_writer(destination, fmt, created=created, chat=chat)
        try:
            for request_id in sorted(completions):
                writer.write(completions[request_id], None)
        finally:
            writer.close()
    return writer.refused
