"""Every Kafka client detok makes is made here: consumers, producers, admin clients.

One place owns how detok talks to a cluster, so a setting every client needs (the bootstrap
address today; TLS and SASL properties tomorrow) is added once, and the producer defaults that
keep detok compatible with Java clients are written once:

- `partitioner=murmur2_random`: Java producers hash keys with murmur2. A request's events and
  outputs must land on the partition a Java producer would choose for the same key, or a mixed
  fleet would split one request across partitions.
- `enable.idempotence=true`: a retried send is never written twice, and order per partition is
  kept across retries (the worker's changelog and the input's seq order rely on both).

Callers pass only what their role needs (a group id, a transactional id, fetch tuning); the
connection's passthrough properties are applied last, as `detok worker` always did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": True,
}
# While librdkafka's local queue is full, `produce` raises BufferError; waiting this long for it
# to send lets the queue drain without spinning.
QUEUE_FULL_WAIT_S = 0.05


@dataclass(frozen=True)
class KafkaConnection:
    """How to reach one cluster: the bootstrap address and client properties passed through
    unchanged to every client (librdkafka names, e.g. `security.protocol`)."""

    bootstrap_servers: str
    properties: Mapping[str, Any] = field(default_factory=dict)

    def client_config(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """`settings` for one client on this connection."""
        return {"bootstrap.servers": self.bootstrap_servers, **settings, **self.properties}


def make_consumer(connection: KafkaConnection, settings: Mapping[str, Any]) -> Consumer:
    return Consumer(connection.client_config(settings))


def make_producer(
    connection: KafkaConnection, settings: Mapping[str, Any] | None = None
) -> Producer:
    """A producer with detok's defaults (see the module docstring) under `settings`."""
    return Producer(connection.client_config({**PRODUCER_DEFAULTS, **(settings or {})}))


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
