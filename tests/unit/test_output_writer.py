"""Records too large for their topic (issue 16 item 2), without a broker: whatever a topic
refuses fails only what it belongs to and leaves a valueless `output_too_large` dead letter
naming the input record; nothing is fatal and nothing is dropped without a trace."""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from pipeline.processor import BatchResult, DeadLetter
from schemas.events import DeadLetterReason
from tests.unit.fake_records import FakeMessage
from workers.kafka.origin import KafkaOrigin
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import RECORD_OVERHEAD_BYTES
from workers.runtime.checkpointing import Output
from workers.runtime.output_limits import OutputLimits
from workers.runtime.output_writer import OutputWriter
from workers.runtime.prometheus import PrometheusMetrics

NAMES = TopicNames()
LIMIT = 4096


class RecordingProducer:
    """Keeps what is produced; refuses, as librdkafka does, values above `refuse_above`."""

    def __init__(self, refuse_above: int | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self.refuse_above = refuse_above

    def produce(self, topic: str, value: bytes | None, **kwargs: Any) -> None:
        if self.refuse_above is not None and len(value or b"") > self.refuse_above:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        self.records.append({"topic": topic, "value": value, **kwargs})


class FailingProcessor:
    def __init__(self) -> None:
        self.failed: dict[str, DeadLetterReason] = {}

    def mark_failed(
        self, request_id: str, reason: DeadLetterReason, *, message: str | None = None
    ) -> BatchResult:
        self.failed[request_id] = reason
        return BatchResult()

    def changelog_records(self, request_id: str) -> list[tuple[bytes, bytes | None]]:
        if request_id not in self.failed:
            return [(request_id.encode(), b"{}")]
        return [
            (request_id.encode() + b"\xff0", None),
            (request_id.encode(), b'{"kind": "failed"}'),
        ]


def writer(producer: RecordingProducer, processor: FailingProcessor) -> OutputWriter:
    limits = OutputLimits({name: LIMIT for name in NAMES.model_dump().values()})
    metrics = PrometheusMetrics(["m"], registry=None)
    return OutputWriter(producer, limits, NAMES, processor, metrics, group="g", instance_id="i")


def headers_of(record: dict[str, Any]) -> dict[str, bytes | None]:
    return dict(record["headers"])


def test_a_completion_too_large_becomes_a_failed_completion_and_a_dead_letter() -> None:
    producer, processor = RecordingProducer(), FailingProcessor()
    completion = {"request_id": "r", "status": "ok", "text": "x" * LIMIT, "error": None}
    writer(producer, processor).write(
        Output(NAMES.completions, b"r", json.dumps(completion).encode(), request_id="r")
    )
    (replacement, letter) = producer.records
    assert replacement["topic"] == NAMES.completions
    assert json.loads(replacement["value"])["status"] == "failed"
    assert "output_too_large" in json.loads(replacement["value"])["error"]
    assert letter["topic"] == NAMES.dead_letters and letter["value"] is None
    assert headers_of(letter)["__detok.errors.reason"] == b"output_too_large"
    assert headers_of(letter)["__detok.errors.request_id"] == b"r"


def test_a_snapshot_too_large_fails_the_request_and_writes_its_failed_marker() -> None:
    producer, processor = RecordingProducer(), FailingProcessor()
    # A text segment too large: the marker goes under the head key, tombstones under segments.
    writer(producer, processor).write(
        Output(NAMES.changelog, b"r\xff0", b"s" * LIMIT, partition=3, request_id="r")
    )
    assert processor.failed == {"r": DeadLetterReason.OUTPUT_TOO_LARGE}
    (tombstone, marker, letter) = producer.records
    assert (tombstone["key"], tombstone["value"], tombstone["partition"]) == (b"r\xff0", None, 3)
    assert (marker["topic"], marker["key"], marker["value"], marker["partition"]) == (
        NAMES.changelog,
        b"r",
        b'{"kind": "failed"}',
        3,
    )
    assert headers_of(letter)["__detok.errors.reason"] == b"output_too_large"


def test_a_dead_letter_the_producer_refuses_names_its_input_record_without_its_value() -> None:
    producer, processor = RecordingProducer(refuse_above=100), FailingProcessor()
    record = FakeMessage(b"y" * 200, b"k", [("trace", b"t")], partition_number=5, offset_number=42)
    letter = DeadLetter(
        DeadLetterReason.MALFORMED_JSON, "DecodeError", "bad", None, None, KafkaOrigin(record)
    )
    out = writer(producer, processor)
    out.write(out.dead_letter(letter))
    (stand_in,) = producer.records
    headers = headers_of(stand_in)
    assert stand_in["value"] is None and stand_in["key"] == b"k"
    assert headers["__detok.errors.reason"] == b"output_too_large"
    assert (
        headers["__connect.errors.topic"],
        headers["__connect.errors.partition"],
        headers["__connect.errors.offset"],
    ) == (b"detok.tokens", b"5", b"42")
    assert "trace" not in headers, "the record's own headers may be what did not fit"


def test_records_that_fit_are_produced_unchanged() -> None:
    producer, processor = RecordingProducer(), FailingProcessor()
    value = b"v" * (LIMIT - RECORD_OVERHEAD_BYTES - 1)
    writer(producer, processor).write(Output(NAMES.deltas, None, value, request_id="r"))
    assert [(r["topic"], r["value"]) for r in producer.records] == [(NAMES.deltas, value)]
    assert processor.failed == {}
