"""Every Kafka client detok makes is made here: consumers, producers, admin clients.

One place owns how detok talks to a cluster, so a setting every client needs (the bootstrap
address today; TLS and SASL properties tomorrow) is added once, and the producer defaults that
keep detok compatible with Java clients are written once:

- `partitioner=murmur2_random`: Java producers hash keys with murmur2. A request's events and
  outputs must land on the partition a Java producer would choose for the same key, or a mixed
  fleet would split one request across partitions.
- `enable.idempotence=true`: a retried send is never written twice, and order per partition is
  kept across retries (the worker's changelog and the input's seq order rely on both).
- `acks=all`: a record is acknowledged once every in-sync replica has it (at least
  `min.insync.replicas`, 2 on a three-broker cluster), so a leader that dies right after the
  acknowledgement loses nothing. Idempotence already implies it; it is written out because
  durability must not depend on a default a reader has to know.

Callers pass only what their role needs (a group id, a transactional id, fetch tuning); the
connection's passthrough properties are applied last, as `detok worker` always did.

Commands that write to Kafka produce through a `DeliveryTracker`, so what was not delivered is
counted and reported instead of lost silently; `topic_partitions` turns "no broker" and "no such
topic" into two clear errors within a bound.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ClusterMetadata

PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": True,
    "acks": "all",
}
# While librdkafka's local queue is full, `produce` raises BufferError; waiting this long for it
# to send lets the queue drain without spinning.
QUEUE_FULL_WAIT_S = 0.05
# librdkafka's default `batch.size`.
DEFAULT_BATCH_BYTES = 1_000_000
# A command's first request to the cluster (metadata, a topic's config): a live cluster answers in
# milliseconds; 15 s covers a broker that is still starting, and turns an unreachable one into a
# clear error instead of a hang.
METADATA_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class KafkaConnection:
    """How to reach one cluster: the bootstrap address and client properties passed through
    unchanged to every client (librdkafka names, e.g. `security.protocol`)."""

    bootstrap_servers: str
    properties: Mapping[str, Any] = field(default_factory=dict)

    def client_config(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """`settings` for one client on this connection."""
        return {"bootstrap.servers": self.bootstrap_servers, **settings, **self.properties}


def as_connection(connection: KafkaConnection | str) -> KafkaConnection:
    """A bare bootstrap address is a connection with no extra properties; library functions take
    either, so scripts and tests that only know an address need no wrapper."""
    if isinstance(connection, KafkaConnection):
        return connection
    return KafkaConnection(connection)


def make_consumer(connection: KafkaConnection, settings: Mapping[str, Any]) -> Consumer:
    return Consumer(connection.client_config(settings))


def make_producer(
    connection: KafkaConnection, settings: Mapping[str, Any] | None = None
) -> Producer:
    """A producer with detok's defaults (see the module docstring) under `settings`."""
    return Producer(connection.client_config({**PRODUCER_DEFAULTS, **(settings or {})}))


def sized_for(max_message_bytes: int) -> dict[str, Any]:
    """Producer settings for a topic that accepts records up to `max_message_bytes`.

    A record over the limit is then refused by the client, alone and at once (a counted delivery
    failure), instead of by the broker, which refuses its whole batch and so every record batched
    with it. Batches stay within the limit for the same reason (librdkafka's default is 1 MB).
    """
    return {
        "message.max.bytes": max_message_bytes,
        "batch.size": min(DEFAULT_BATCH_BYTES, max_message_bytes),
    }


def make_admin(connection: KafkaConnection) -> AdminClient:
    return AdminClient(connection.client_config({}))


def produce(producer: Producer, topic: str, value: bytes | None, **kwargs: Any) -> None:
    """`producer.produce`, waiting for room while the local queue is full."""
    while True:
        try:
            producer.produce(topic, value, **kwargs)
            return
        except BufferError:
            producer.poll(QUEUE_FULL_WAIT_S)


class KafkaUnavailable(Exception):
    """No broker answered within a command's bound: a clear message instead of a hang or a
    librdkafka traceback."""


class UnknownTopic(LookupError):
    """A command was pointed at a topic the cluster does not have."""


class UndeliveredRecords(Exception):
    """Some records a command produced were not delivered; `report` says how many and why."""

    def __init__(self, report: DeliveryReport) -> None:
        self.report = report
        super().__init__(report.describe())


@dataclass(frozen=True)
class DeliveryReport:
    """What became of the records one command produced."""

    delivered: int
    # Error name (e.g. MSG_SIZE_TOO_LARGE, UNKNOWN_TOPIC_OR_PART, _MSG_TIMED_OUT) -> records.
    failed: Mapping[str, int]

    @property
    def undelivered(self) -> int:
        return sum(self.failed.values())

    def describe(self) -> str:
        reasons = ", ".join(f"{name}={count}" for name, count in sorted(self.failed.items()))
        total = self.delivered + self.undelivered
        return f"{self.undelivered} of {total} records not delivered ({reasons})"


class DeliveryTracker:
    """Counts delivery reports, so a command that writes to Kafka can say what did not arrive.

    Without a delivery callback librdkafka drops its errors silently: a record to a topic that
    does not exist, or one over the topic's `max.message.bytes` (which fails every record of its
    batch with it), disappears while `flush` returns 0. Every record goes through `produce` here
    and is counted once: delivered, refused at once by the client (a record over the producer's
    `message.max.bytes`), or failed by the broker. `settle` flushes and returns the totals; a
    record still queued after its bound counts as `_MSG_TIMED_OUT`.
    """

    def __init__(self) -> None:
        self.delivered = 0
        self.failed: Counter[str] = Counter()

    def on_delivery(self, error: KafkaError | None, _message: Message) -> None:
        if error is None:
            self.delivered += 1
        else:
            self.failed[error.name()] += 1

    def produce(self, producer: Producer, topic: str, value: bytes | None, **kwargs: Any) -> bool:
        """Queue one record; False (and counted) if the client refuses it outright."""
        try:
            produce(producer, topic, value, on_delivery=self.on_delivery, **kwargs)
        except KafkaException as error:
            self.failed[error.args[0].name()] += 1
            return False
        return True

    def settle(self, producer: Producer, timeout_s: float) -> DeliveryReport:
        """Wait up to `timeout_s` for every report; raise UndeliveredRecords if any failed."""
        remaining = producer.flush(timeout_s)
        if remaining:
            self.failed["_MSG_TIMED_OUT"] += remaining
        report = DeliveryReport(self.delivered, dict(self.failed))
        if report.undelivered:
            raise UndeliveredRecords(report)
        return report


def cluster_metadata(
    client: Consumer | Producer | AdminClient, timeout_s: float, topic: str | None = None
) -> ClusterMetadata:
    """The cluster's metadata (of one topic, or of all), or KafkaUnavailable after `timeout_s`."""
    try:
        return client.list_topics(topic, timeout=timeout_s)
    except KafkaException as error:
        raise KafkaUnavailable(
            f"no Kafka broker answered within {timeout_s:.0f} s ({error.args[0].str()})"
        ) from error


def topic_partitions(
    client: Consumer | Producer | AdminClient, topic: str, timeout_s: float
) -> list[int]:
    """The partition ids of `topic`, asked of the cluster within `timeout_s`.

    Raises KafkaUnavailable when no broker answers and UnknownTopic when the topic does not exist,
    so a command says which of the two it met instead of producing into the void or waiting.
    """
    found = cluster_metadata(client, timeout_s, topic).topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise UnknownTopic(f"topic {topic!r} does not exist (create it with `detok topics ensure`)")
    return sorted(found.partitions)
