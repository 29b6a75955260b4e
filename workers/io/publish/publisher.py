"""`Publisher`: an inference engine's requests onto detok's input topic, over Kafka.

An engine opens a request, appends the ids it generates and finishes it; the publisher numbers,
keys, partitions and coalesces the events (`workers.io.publish.events`) and produces them with
detok's producer defaults (murmur2 partitioner, idempotence, acks=all: `workers.kafka.clients`).

Three things an engine's own producer tends to get wrong are the publisher's job here:

- Coalescing. A background thread flushes buffered ids every `linger_s`, so an id waits at most
  that long (plus librdkafka's own `linger.ms`) and a request producing ids faster than that
  sends one tokens event per linger instead of one per id.
- Delivery. Every record has a delivery report. A failed one (refused at once, or not
  acknowledged within `delivery_timeout_s`, during which librdkafka retries) is never dropped:
  `on_error` receives it, or, without one, the next call into the publisher raises
  `PublishFailed`; `flush` and `close` raise `UndeliveredRecords` if anything failed at all.
- Threads. One lock serialises the calls, so engine threads may share a publisher; records of
  one request are produced in seq order whichever thread appends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from confluent_kafka import KafkaError, KafkaException, Message

from workers.io.publish.events import LOG, PromptOptions, RequestEvents
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    DeliveryReport,
    KafkaConnection,
    UndeliveredRecords,
    as_connection,
    make_admin,
    make_producer,
    produce,
    sized_for,
    topic_partitions,
)
from workers.kafka.topics import message_limit

# How long an appended id may wait for others of its request before it is sent. 5 ms is small
# next to a token's time on any engine (20-50 ms per step at batch sizes worth streaming), and
# at high rates gathers a few hundred ids per event (bench/bench_publisher.py).
DEFAULT_LINGER_S = 0.005
# How long one record may wait for its acknowledgement (librdkafka retries within it) before it
# counts as not delivered: a broker away for less than this costs a delay, not a record.
DEFAULT_DELIVERY_TIMEOUT_S = 60.0
# librdkafka's own batching on top of the coalescing (small: the records are few and large),
# and lz4, which halves the bytes of JSON id lists at little CPU cost.
PUBLISHER_PRODUCER_SETTINGS: Mapping[str, Any] = {"linger.ms": 5, "compression.type": "lz4"}
# When coalescing is off the background thread only serves delivery reports, at this period.
POLL_PERIOD_S = 0.05


@dataclass(frozen=True)
class FailedRecord:
    """One record that was not delivered: which request and event, and the client's error."""

    request_id: str | None
    seq: int | None
    error: str  # librdkafka's error name, e.g. _MSG_TIMED_OUT, MSG_SIZE_TOO_LARGE


class PublishFailed(Exception):
    """Records were not delivered (raised by the call after their reports, when the publisher
    has no `on_error`). The affected requests are incomplete on the topic: the worker ends them
    by its request TTL, or the engine may publish them again under new request ids."""

    def __init__(self, failures: Sequence[FailedRecord]) -> None:
        self.failures = list(failures)
        names = sorted({f.request_id or "?" for f in self.failures})
        super().__init__(
            f"{len(self.failures)} records not delivered ({self.failures[0].error}); "
            f"requests: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}"
        )


class Publisher:
    """Publishes live requests to `topic` (see the module docstring); a context manager.

    Raises KafkaUnavailable or UnknownTopic (within METADATA_TIMEOUT_S) when made, before
    anything is produced. The topic's `max.message.bytes` bounds every record: a prompt over it
    goes as its tail with `prompt_tokens`, a coalesced tokens event over it is split.
    """

    def __init__(
        self,
        connection: KafkaConnection | str,
        topic: str,
        *,
        linger_s: float = DEFAULT_LINGER_S,
        on_error: Callable[[FailedRecord], None] | None = None,
        prompt_tail: int | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        producer_settings: Mapping[str, Any] | None = None,
        log: logging.Logger = LOG,
    ) -> None:
        connection = as_connection(connection)
        admin = make_admin(connection)
        topic_partitions(admin, topic, METADATA_TIMEOUT_S)
        self.max_record_bytes = message_limit(admin, topic, METADATA_TIMEOUT_S)
        self.topic = topic
        self._producer = make_producer(
            connection,
            {
                **PUBLISHER_PRODUCER_SETTINGS,
                **sized_for(self.max_record_bytes),
                "message.timeout.ms": int(delivery_timeout_s * 1000),
                **(producer_settings or {}),
            },
        )
        self._delivery_timeout_s = delivery_timeout_s
        self._events = RequestEvents(
            self._send,
            coalesce=linger_s > 0,
            max_record_bytes=self.max_record_bytes,
            prompt_tail=prompt_tail,
            log=log,
        )
        self._lock = threading.Lock()
        self._on_error = on_error
        # Delivery reports arrive on whichever thread polls (the ticker, or a caller waiting for
        # queue room), so their counters have a lock of their own.
        self._reports_lock = threading.Lock()
        self.records_sent = 0
        self.delivered = 0
        self._failed: list[FailedRecord] = []
        self._unraised: list[FailedRecord] = []
        self._closed = threading.Event()
        self._ticker = threading.Thread(
            target=self._tick,
            args=(linger_s if linger_s > 0 else POLL_PERIOD_S,),
            name="detok-publisher",
            daemon=True,
        )
        self._ticker.start()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: Sequence[int],
        **options: Unpack[PromptOptions],
    ) -> None:
        """Open a request: its prompt event (seq 0), with the prompt event's optional fields
        (docs/decode-options.md). Raises msgspec.ValidationError for a value outside the schema's
        bounds and RequestStateError for an id already open, before anything is sent."""
        with self._lock:
            self._raise_failures()
            self._events.open(
                request_id,
                model,
                prompt_token_ids,
                **options,
            )

    def append(
        self,
        request_id: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> None:
        """Generated ids of an open request, in order; with the engine's logprob of each id and
        its alternatives ((id, logprob) pairs, at most 20) when the request asked for them."""
        with self._lock:
            if self._unraised:
                self._raise_failures()
            self._events.append(request_id, token_ids, logprobs, top_logprobs)

    def append_many(self, steps: Sequence[tuple[str, Sequence[int]]]) -> None:
        """One engine step: (request_id, new ids) for each running request, under one lock."""
        with self._lock:
            if self._unraised:
                self._raise_failures()
            self._events.append_many(steps)

    def finish(self, request_id: str, finish_reason: str | None = None) -> None:
        """Close a request: its buffered ids, then its finish event ("stop", "length", ...)."""
        with self._lock:
            self._raise_failures()
            self._events.finish(request_id, finish_reason)

    def abandon(self, request_id: str) -> bool:
        """Close a request the worker ended (a stop signal) without sending more: no finish
        event, its buffered ids dropped. False when it was not open (finished already)."""
        with self._lock:
            return self._events.abandon(request_id)

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` is open: `StopSignals(requests=publisher)` skips the others."""
        return request_id in self._events  # a dict lookup: atomic, no lock needed

    def pass_through(self, value: bytes) -> None:
        """Produce `value` unkeyed, as it is: `detok replay` sends an input line it could not
        read this way, so the worker dead-letters it as it would a broken producer's record."""
        with self._lock:
            self._produce(None, value, None)

    def flush(self, timeout_s: float | None = None) -> DeliveryReport:
        """Send everything buffered and wait (up to `timeout_s`, default the delivery timeout
        and a margin) for every report. Raises UndeliveredRecords if any record ever failed."""
        with self._lock:
            self._events.flush()
        bound = self._delivery_timeout_s + 5 if timeout_s is None else timeout_s
        remaining = self._producer.flush(bound)
        with self._reports_lock:
            self._unraised = []
            failed: dict[str, int] = {}
            for failure in self._failed:
                failed[failure.error] = failed.get(failure.error, 0) + 1
            if remaining:
                failed["_MSG_TIMED_OUT"] = failed.get("_MSG_TIMED_OUT", 0) + remaining
            report = DeliveryReport(self.delivered, failed)
        if report.undelivered:
            raise UndeliveredRecords(report)
        return report

    def close(self, timeout_s: float | None = None) -> DeliveryReport:
        """`flush`, then stop the background thread. Requests still open stay open on the
        topic (the worker ends them by its TTL): finish them first."""
        try:
            return self.flush(timeout_s)
        finally:
            self._closed.set()
            self._ticker.join()

    def _tick(self, period_s: float) -> None:
        while not self._closed.wait(period_s):
            with self._lock:
                self._events.flush()
            self._producer.poll(0)

    def _send(self, key: bytes, value: bytes, seq: int) -> None:
        self._produce(key, value, seq)

    def _produce(self, key: bytes | None, value: bytes, seq: int | None) -> None:
        """Queue one record (the lock is held, so a request's records keep their order)."""
        self.records_sent += 1
        request_id = None if key is None else key.decode()

        def on_delivery(error: KafkaError | None, _message: Message) -> None:
            self._report(request_id, seq, error)

        try:
            produce(self._producer, self.topic, value, key=key, on_delivery=on_delivery)
        except KafkaException as refused:
            self._report(request_id, seq, refused.args[0])

    def _report(self, request_id: str | None, seq: int | None, error: KafkaError | None) -> None:
        with self._reports_lock:
            if error is None:
                self.delivered += 1
                return
            failure = FailedRecord(request_id, seq, error.name())
            self._failed.append(failure)
            if self._on_error is None:
                self._unraised.append(failure)
        if self._on_error is not None:
            self._on_error(failure)

    def _raise_failures(self) -> None:
        with self._reports_lock:
            unraised, self._unraised = self._unraised, []
        if unraised:
            raise PublishFailed(unraised)
