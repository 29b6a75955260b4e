"""`StopSignals`: what an engine hears back from detok, the requests it may stop generating.

A tokens-only engine cannot see stop strings; the worker finds them, and ends requests for other
reasons too (a strict-decode failure, a text over the limit, the TTL). For each request it ends
before its finish event it writes a `StopSignal` to the control topic, keyed by the request id, in
the transaction of the request's completion. This reads them read_committed (a signal of an
aborted transaction never shows) from every partition: a request's signal lands on the partition
of its key in the control topic, which an engine cannot tell apart from its neighbours' without
the topic's partition count, and one engine's requests are spread over all of them anyway.

It starts at each partition's end as of its making, so an engine makes it before opening requests;
a signal committed later is delivered once (a reader restarted later does not see it again).
`requests`, when given, is what the engine is still generating (the publisher itself, say: its
open requests): a signal for any other id, a request the engine already finished, is skipped by
its key, before its value is parsed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Container, Iterator

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from pydantic import ValidationError

from schemas.events import StopSignal
from workers.kafka.acls import STOP_SIGNALS_GROUP_PREFIX
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    KafkaConnection,
    as_connection,
    make_admin,
    make_consumer,
    topic_partitions,
)
from workers.kafka.topic_names import TopicNames

LOG = logging.getLogger("detok.publish")
DEFAULT_CONTROL_TOPIC = TopicNames().control
# How long the broker may hold a fetch for new records: an idle reader asks this often. A
# committed signal ends the wait at once, so this is not the delay (the worker's commit is).
FETCH_WAIT_MS = 50
# How long one wait of the iterator and the callback thread lasts: `close` is seen within it.
WAIT_S = 0.1

OnStop = Callable[[StopSignal], None]
# A fresh topic's partitions answer these until their leader is elected (milliseconds).
NO_LEADER_YET = frozenset(
    {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
     KafkaError.UNKNOWN_TOPIC_OR_PART}
)  # fmt: skip
RETRY_S = 0.1


class StopSignals:
    """Stop signals for an engine's requests (see the module docstring); a context manager.

    Either poll (`poll`, or iterate, from one thread) or give `on_stop`, which a background
    thread calls with each signal (it must not block for long: signals wait behind it).
    `group` is the consumer group id it reads under (it commits nothing; a secured cluster's
    ACLs grant the producer role groups with prefix `detok-stop-signals-`, the default's).
    Raises KafkaUnavailable or UnknownTopic (within METADATA_TIMEOUT_S) when made.
    """

    def __init__(
        self,
        connection: KafkaConnection | str,
        topic: str = DEFAULT_CONTROL_TOPIC,
        *,
        group: str | None = None,
        requests: Container[str] | None = None,
        on_stop: OnStop | None = None,
    ) -> None:
        connection = as_connection(connection)
        partitions = topic_partitions(make_admin(connection), topic, METADATA_TIMEOUT_S)
        self.topic = topic
        self.requests = requests
        self.received = 0  # signals handed to the engine
        self.skipped = 0  # signals for requests not in `requests`, or unreadable
        self._consumer = make_consumer(
            connection,
            {
                "group.id": group or f"{STOP_SIGNALS_GROUP_PREFIX}{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": FETCH_WAIT_MS,
            },
        )
        self._consumer.assign(
            [TopicPartition(topic, p, self._end_of(p)) for p in sorted(partitions)]
        )
        self._closed = threading.Event()
        # Held while the consumer is in use: `close` from another thread waits for a poll.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if on_stop is not None:
            self._thread = threading.Thread(
                target=self._serve, args=(on_stop,), name="detok-stop-signals", daemon=True
            )
            self._thread.start()

    def _end_of(self, partition: int) -> int:
        """The partition's end for a read_committed reader now (its last stable offset): the
        first signal not yet committed, which an explicit start point cannot skip past later
        (OFFSET_END would be resolved at the first fetch, after signals made meanwhile).

        A topic created a moment ago may have no leader yet: asked again until
        METADATA_TIMEOUT_S, then the error is raised."""
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        while True:
            try:
                _, end = self._consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=METADATA_TIMEOUT_S
                )
                return end
            except KafkaException as error:
                if error.args[0].code() not in NO_LEADER_YET or time.monotonic() > deadline:
                    raise
                time.sleep(RETRY_S)

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def poll(self, timeout_s: float = 0.0) -> list[StopSignal]:
        """The signals committed since the last call, waiting up to `timeout_s` for a first.

        An engine loop calls it once per step with no wait; it costs a queue check when there
        is nothing. Raises KafkaException on a fatal client error."""
        with self._lock:
            if self._closed.is_set():
                return []
            # `poll` returns at the first record (a batch `consume` would wait out its timeout),
            # then what else is already fetched comes without waiting.
            first = self._consumer.poll(timeout_s)
            messages = [] if first is None else [first, *self._consumer.consume(1000, 0)]
        signals = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise KafkaException(error)
                continue
            signal = self._signal(message.key(), message.value())
            if signal is not None:
                signals.append(signal)
        self.received += len(signals)
        return signals

    def _signal(self, key: bytes | None, value: bytes | None) -> StopSignal | None:
        requests = self.requests
        if requests is not None and (key is None or key.decode(errors="replace") not in requests):
            self.skipped += 1
            return None
        try:
            return StopSignal.model_validate_json(value or b"")
        except ValidationError as error:  # a record of a newer worker, say: never fatal here
            LOG.warning("skipping an unreadable record on %s: %s", self.topic, error)
            self.skipped += 1
            return None

    def __iter__(self) -> Iterator[StopSignal]:
        """Every signal as it comes, until `close` (from another thread)."""
        while not self._closed.is_set():
            yield from self.poll(WAIT_S)

    def _serve(self, on_stop: OnStop) -> None:
        while not self._closed.is_set():
            try:
                signals = self.poll(WAIT_S)
            except KafkaException:
                LOG.exception(
                    "stop signals on %s: the consumer failed; no more signals", self.topic
                )
                return
            for signal in signals:
                try:
                    on_stop(signal)
                except Exception:
                    LOG.exception("on_stop raised for request %s", signal.request_id)

    def close(self) -> None:
        """Stop reading (and the callback thread) and close the consumer."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._consumer.close()
