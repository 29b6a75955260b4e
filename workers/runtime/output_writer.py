"""Producing the worker's records, each checked against what its topic accepts.

A record its topic refuses as too large used to be a fatal producer error, repeated on every
restart. Here it fails only what it belongs to, keeps a reference to the input, and the stream
goes on. The check runs before producing (the topic limits read at start,
workers/runtime/output_limits.py); a refusal librdkafka still reports synchronously takes the same
path.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Producer

from pipeline.dead_letter_reasons import REASONS
from pipeline.processor import BatchResult, DeadLetter
from schemas.events import DeadLetterReason, dump_json
from workers.kafka.clients import produce
from workers.kafka.dead_letters import dead_letter_headers, dead_letter_key
from workers.kafka.topic_names import TopicNames
from workers.runtime.checkpointing import (
    FatalWorkerError,
    Output,
    ProducedRecord,
    ProducerFailed,
    describe_error,
)
from workers.runtime.output_limits import OutputLimits
from workers.runtime.prometheus import PrometheusMetrics

log = logging.getLogger("detok.worker")

# A key longer than this is left off a valueless dead letter (the request id and the input
# coordinates in its headers still name the record).
MAX_STAND_IN_KEY_BYTES = 1024
SIZE_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE})


class FailsRequests(Protocol):
    """What the writer needs of the processor to fail a request whose output cannot be written."""

    def mark_failed(
        self, request_id: str, reason: DeadLetterReason, *, message: str | None = None
    ) -> BatchResult: ...
    def changelog_records(self, request_id: str) -> list[tuple[bytes, bytes | None]]: ...


class OutputWriter:
    """Turns dead letters into records and produces records, standing in for refused ones."""

    def __init__(
        self,
        producer: Producer,
        limits: OutputLimits,
        topics: TopicNames,
        processor: FailsRequests,
        metrics: PrometheusMetrics,
        *,
        group: str,
        instance_id: str,
    ) -> None:
        self.producer = producer
        self.limits = limits
        self.topics = topics
        self.processor = processor
        self.metrics = metrics
        self.group = group
        self.instance_id = instance_id
        # When a list: every record produced is added to it (the exactly-once strategy keeps
        # a transaction's records to produce them again, workers/runtime/checkpointing.py).
        self.produced: list[ProducedRecord] | None = None

    def dead_letter(self, letter: DeadLetter) -> Output:
        """The dead-letter record of `letter`: the original key, bytes, timestamp and headers,
        then this failure's error headers."""
        self.metrics.dead_letters.labels(reason=letter.reason.value).inc()
        timestamp = letter.origin.timestamp_ms if letter.origin else None
        return Output(
            self.topics.dead_letters,
            dead_letter_key(letter),
            letter.value,
            dead_letter_headers(letter, self.group, self.instance_id),
            timestamp or 0,
            request_id=letter.request_id,
            origin=letter.origin,
        )

    def write(self, output: Output) -> None:
        """Produce one record, or, if its topic cannot take it, what stands in for it."""
        if self.limits.fits(output.topic, output.key, output.value, output.headers):
            kwargs: dict[str, Any] = {
                "key": output.key,
                "headers": output.headers,
                "timestamp": output.timestamp,
            }
            if output.partition is not None:
                kwargs["partition"] = output.partition
            try:
                self._produce(output.topic, output.value, kwargs)
                return
            except KafkaException as exception:
                error: KafkaError = exception.args[0]
                if error.code() == KafkaError._FATAL:
                    raise ProducerFailed(f"producing to {output.topic}: {error.str()}") from None
                if error.code() not in SIZE_ERRORS:
                    failure = describe_error(error)
                    raise FatalWorkerError(f"producing to {output.topic}: {failure}") from None
        self._too_large(output)

    def write_failure(self, result: BatchResult) -> None:
        """Produce at once what failing a request during a commit gave (`mark_failed`): its
        final delta, its failed completion and its dead letters go out in the same transaction
        as its failed marker, never the marker alone (issue 32 item 1)."""
        for delta in result.deltas:
            key = delta.request_id.encode()
            self.write(
                Output(self.topics.deltas, key, delta.to_wire_json(), request_id=delta.request_id)
            )
        for completion in result.completions:
            key = completion.request_id.encode()
            value = dump_json(completion)
            self.write(Output(self.topics.completions, key, value, request_id=key.decode()))
        for letter in result.dead_letters:
            self.write(self.dead_letter(letter))
        for output in self.stop_signals(result):
            self.write(output)
        self.metrics.observe_outputs(result)

    def stop_signals(self, result: BatchResult) -> list[Output]:
        """The control records of the requests `result` ended before their finish event, keyed
        by request id, for the engines (`workers.io.publish.StopSignals`): produced with the
        completions, so in the same transaction under exactly-once."""
        return [
            Output(
                self.topics.control,
                signal.request_id.encode(),
                dump_json(signal),
                request_id=signal.request_id,
            )
            for signal in result.stop_signals
        ]

    def write_stand_in(self, letter: DeadLetter, *, keep_original: bool) -> None:
        """Produce a valueless dead letter at once: it stands in for a record that could not be
        written, during a commit (the checkpoint's records are already being produced)."""
        key = dead_letter_key(letter)
        if key is not None and len(key) > MAX_STAND_IN_KEY_BYTES:
            key = None
        headers = dead_letter_headers(
            letter, self.group, self.instance_id, keep_original=keep_original
        )
        self.metrics.dead_letters.labels(reason=letter.reason.value).inc()
        if self.limits.fits(self.topics.dead_letters, key, None, headers):
            self._produce(self.topics.dead_letters, None, {"key": key, "headers": headers})
        else:
            log.error("a %s dead letter itself does not fit; counted only", letter.reason.value)

    def _produce(self, topic: str, value: bytes | None, kwargs: dict[str, Any]) -> None:
        """Produce one record, and keep it in `produced` when that is a list."""
        produce(self.producer, topic, value, **kwargs)
        if self.produced is not None:
            self.produced.append((topic, value, kwargs))

    def _too_large(self, output: Output) -> None:
        """Stand in for a record its topic refuses: fail its request, keep every reference.

        - a dead letter: written without its value (the input keeps the original bytes), its
          headers naming the input topic, partition and offset;
        - a snapshot (head or text segment): the request is marked failed, its (small) failed
          marker written under its head key and tombstones under its segment keys;
        - a completion: replaced by a failed completion without text;
        - a delta, a filtered-ids record or a stop signal: left out (the completion carries the
          text and the outcome).
        Each also leaves an `output_too_large` dead letter naming the request.
        """
        size = self.limits.record_bytes(output.key, output.value, output.headers)
        limit = self.limits.limits[output.topic]
        message = f"a {size}-byte record for {output.topic} exceeds its max.message.bytes ({limit})"
        request_id = output.request_id
        if output.topic == self.topics.dead_letters:
            message += "; the input record keeps the original bytes"
        elif output.topic == self.topics.changelog and request_id is not None:
            self.write_failure(
                self.processor.mark_failed(
                    request_id, DeadLetterReason.OUTPUT_TOO_LARGE, message=message
                )
            )
            # The marker under the request's head key, tombstones for its text segments.
            for key, value in self.processor.changelog_records(request_id):
                self.write(
                    Output(
                        output.topic,
                        key,
                        value,
                        output.headers,
                        partition=output.partition,
                        request_id=request_id,
                    )
                )
        elif output.topic == self.topics.completions and output.value is not None:
            replacement = json.loads(output.value)
            replacement.update(status="failed", text="", error=f"output_too_large: {message}")
            self.write(
                Output(
                    output.topic,
                    output.key,
                    json.dumps(replacement).encode(),
                    request_id=request_id,
                )
            )
        log.warning("%s (request %s)", message, request_id)
        letter = DeadLetter(
            DeadLetterReason.OUTPUT_TOO_LARGE,
            REASONS[DeadLetterReason.OUTPUT_TOO_LARGE].error_class_name,
            message,
            request_id,
            None,
            output.origin,
        )
        self.write_stand_in(letter, keep_original=False)
