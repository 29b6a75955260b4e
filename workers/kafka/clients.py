"""Every Kafka client detok makes is made here: consumers, producers, admin clients.

One place owns how detok talks to a cluster, so a setting every client needs (the bootstrap
address, TLS and SASL properties from `workers.kafka.config`) is added once, and the producer
defaults that keep detok compatible with Java clients are written once:

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
connection's properties (the user's file and `-X`) are applied last, so they tune any client;
the settings detok's guarantees depend on are refused when the connection is made
(`kafka_config.check_protected`), so applying them last can never weaken those.

Commands that write to Kafka produce through a `DeliveryTracker`, so what was not delivered is
counted and reported instead of lost silently; `topic_partitions` turns "no broker" and "no such
topic" into two clear errors within a bound.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, ResourceType

from workers.kafka.config import (
    KafkaConfigError,
    check_protected,
    client_properties,
    redact_text,
    redacted,
)

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "partitioner": "murmur2_random",
    "enable.idempotence": True,
    "acks": "all",
}
# Over TLS, librdkafka's default (Nagle's algorithm on) held the last segment of each request
# until the broker's delayed ACK: a transaction's commit is several small requests in a row,
# and one worker's commits took 10-16 s of a 17 s SASL_SSL run against 0.2-0.6 s in plaintext;
# with TCP_NODELAY (what Java clients always set) 0.5 s (bench_e2e --sasl-ssl). Plaintext
# connections keep librdkafka's default: unmeasured there, so unchanged. `-X` overrides it.
TLS_DEFAULTS: Mapping[str, Any] = {"socket.nagle.disable": True}
# Every client's first requests waited ~50 ms for nothing: once the first metadata names the
# cluster's brokers, librdkafka drops the bootstrap connection (the metadata request in flight
# on it fails, "Broker handle destroyed"), and its next connection to any broker is held back
# for half of `reconnect.backoff.ms` ("Not selecting any broker for cluster connection: still
# suppressed for 49ms", debug=broker). A fresh client's first metadata took 53-54 ms against a
# local broker, with this 1-14 ms: the changelog restore makes a fresh consumer per assignment,
# and a joining worker's restore of an empty changelog took ~0.1 s. The cost: a client retries a
# broker that went away from 10 ms, doubling up to `reconnect.backoff.max.ms` (10 s) as before,
# so three more attempts per outage. `-X` overrides it.
CLIENT_DEFAULTS: Mapping[str, Any] = {"reconnect.backoff.ms": 10}
# librdkafka stops fetching while its local queue holds `queued.min.messages` (100,000) records or
# `queued.max.messages.kbytes`, and then waits `fetch.queue.backoff.ms` (1 s by default) before it
# looks again, however fast the queue drains. For a subscribed or assigned consumer the queue is
# the consumer's one queue, so the limits count every partition's records together. A restore
# reading a million changelog heads (~370 bytes each) filled it to 100,000 records every few
# tenths of a second and then sat on an empty queue: 622 of its 5 ms `consume` calls came back
# empty, and reading took 7.5-8.6 s against 3.9-4.2 s with the fetch decided again after 10 ms
# (same CPU). The worker's own consumer stops at its 16 MB the same way while it drains a backlog,
# but it has not starved there: a full `bench_e2e` drain took the same time either way, its
# queue lasting longer than the second. `-X` overrides it.
CONSUMER_DEFAULTS: Mapping[str, Any] = {"fetch.queue.backoff.ms": 10}
# While librdkafka's local queue is full, `produce` raises BufferError; waiting this long for it
# to send lets the queue drain without spinning.
QUEUE_FULL_WAIT_S = 0.05
# librdkafka's default `batch.size`.
DEFAULT_BATCH_BYTES = 1_000_000
# A command's first request to the cluster (metadata, a topic's config): a live cluster answers in
# milliseconds; 15 s covers a broker that is still starting, and turns an unreachable one into a
# clear error instead of a hang.
METADATA_TIMEOUT_S = 15.0
# Errors no retry can cure: an ACL is missing (which one, the error's name says).
AUTHORIZATION_ERRORS = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)
# Metadata is asked for in slices this long, so a refused connection is noticed between them;
# a live cluster answers the first slice in milliseconds.
METADATA_SLICE_S = 0.5
# A topic reaches each broker of a cluster a moment after it is created: `detok topics ensure`
# returns once one broker shows it, and the broker a command asks next may not know it yet (a CI
# run saw UNKNOWN_TOPIC_OR_PART from a broker restarted seconds before). A topic is asked about
# again for this long before it is called missing; that only delays the refusal of a command
# whose topic truly does not exist.
NEW_TOPIC_GRACE_S = 5.0
# How long to wait between two asks about a topic not known yet.
NEW_TOPIC_RETRY_S = 0.05
# librdkafka sends DescribeConfigs to the broker its metadata names the controller (in KRaft a
# live broker names any broker it believes alive) and waits for that broker's connection however
# long it stays down. A worker started two seconds after one broker of a three-node cluster was
# killed asked the dead one and heard nothing for 30 s while the other two were up, and exited
# ("did not answer within 30 s"; CI, test_kill_9_a_worker_while_a_broker_is_down). So an ask
# for topic configurations ends after this long, the client's metadata is read again
# (`reread_metadata`: once the dead broker is fenced, ~9 s after it died, no live broker names
# it), and the ask is made again, until the caller's own bound. Short, because a live broker
# answers in milliseconds and the wait for a dead one is not idle: librdkafka 2.16 reconnects to
# it in a tight loop (the CI worker's log: 345,800 refused connections in 30 s; two such admin
# clients in one process used 15.6 s of CPU in 8 s).
CONFIG_ASK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class KafkaConnection:
    """How to reach one cluster: the bootstrap address and client properties passed through
    unchanged to every client (librdkafka names, e.g. `security.protocol`).

    Made only with checked properties (ProtectedSetting otherwise), and printed only redacted:
    a connection ends up in error messages and logs, its password must not.
    """

    bootstrap_servers: str
    properties: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_protected(self.properties)

    def __repr__(self) -> str:
        return f"KafkaConnection({self.bootstrap_servers!r}, {redacted(self.properties)!r})"

    def redact(self, text: str) -> str:
        """`text` (an error or log message: librdkafka's may echo a secret) with every secret of
        this connection's properties replaced (`kafka_config.redact_text`)."""
        return redact_text(text, self.properties)

    def client_config(
        self, settings: Mapping[str, Any], *, start_up: bool = False
    ) -> dict[str, Any]:
        """`settings` for one client on this connection. A `start_up` client (a command's
        first requests: admin clients, a short command's reader) also gets the error callback
        that ends a refused connection at once (`RefusalWatch`)."""
        watch = {"error_cb": RefusalWatch(self.bootstrap_servers, self.properties)}
        protocol = str(self.properties.get("security.protocol", "")).upper()
        return {
            "bootstrap.servers": self.bootstrap_servers,
            **CLIENT_DEFAULTS,
            **(TLS_DEFAULTS if protocol in ("SSL", "SASL_SSL") else {}),
            **(watch if start_up else {}),
            **settings,
            **self.properties,
        }


class RefusalWatch:
    """A start-up client's `error_cb`: raises (from the poll that serves it) when the cluster
    refuses the client, so a wrong password or certificate ends a command within a second,
    naming the cause, instead of as a metadata timeout (librdkafka retries a refused login
    forever and only logs).

    Refusals: a failed SASL login (`_AUTHENTICATION`) and a failed TLS handshake (`_SSL`: an
    untrusted certificate, a TLS client on a plaintext port). A plaintext client on a TLS or SASL
    listener gets no error of its own: the broker just closes each connection during the first
    request, which librdkafka reports as "all brokers down" with no transport error before it
    (a stopped broker refuses the connection first: `_TRANSPORT`).

    Only start-up clients get it: a running worker's clients must ride out a restarting broker,
    which can look like the last pattern, and an error callback on a transactional client was
    seen to abort the process inside confluent-kafka (CallState_get assertion) when an error
    arrived during a rebalance's abort. The worker's start-up admin client meets a refusal
    before its consumer and producer exist.
    """

    def __init__(self, bootstrap_servers: str, properties: Mapping[str, Any]) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.properties = properties
        self.protocol = str(properties.get("security.protocol", "plaintext")).upper()
        self.transport_errors = 0

    def __call__(self, error: KafkaError) -> None:
        code = error.code()
        if code in (KafkaError._AUTHENTICATION, KafkaError._SSL):
            # The text may quote a secret (a malformed sasl.oauthbearer.config, from where
            # librdkafka stopped reading it): the exception travels on without it.
            raise KafkaException(KafkaError(code, redact_text(error.str(), self.properties)))
        if code == KafkaError._TRANSPORT:
            self.transport_errors += 1
        elif code == KafkaError._ALL_BROKERS_DOWN and not self.transport_errors:
            raise KafkaException(
                KafkaError(
                    KafkaError._ALL_BROKERS_DOWN,
                    f"the broker at {self.bootstrap_servers} closed every connection during the "
                    f"first request: its listener likely expects another security.protocol "
                    f"(this client uses {self.protocol}; see --kafka-config)",
                )
            )


def configured_connection(
    bootstrap_servers: str | None,
    config_file: Path | None,
    overrides: Iterable[str] = (),
    fallback: Callable[[], str] | None = None,
) -> KafkaConnection:
    """The connection a command's flags describe: `kafka_config.client_properties` for the
    settings; the address from `bootstrap_servers` (a flag), else `bootstrap.servers` of the
    config, else $KAFKA_BOOTSTRAP_SERVERS, else `fallback()` (the demo's local broker).

    Raises KafkaConfigError (never quoting a secret) for a config detok refuses or no address,
    before any client is made.
    """
    properties = client_properties(config_file, overrides)
    from_config = properties.pop("bootstrap.servers", None)
    bootstrap = bootstrap_servers or from_config or os.environ.get(BOOTSTRAP_ENV)
    if not bootstrap and fallback is not None:
        bootstrap = fallback()
    if not bootstrap:
        raise KafkaConfigError(
            "no Kafka bootstrap servers: pass --bootstrap-servers, set "
            f"${BOOTSTRAP_ENV}, or put bootstrap.servers in the Kafka config file"
        )
    return KafkaConnection(bootstrap, properties)


def as_connection(connection: KafkaConnection | str) -> KafkaConnection:
    """A bare bootstrap address is a connection with no extra properties; library functions take
    either, so scripts and tests that only know an address need no wrapper."""
    if isinstance(connection, KafkaConnection):
        return connection
    return KafkaConnection(connection)


def make_consumer(
    connection: KafkaConnection, settings: Mapping[str, Any], *, start_up: bool = False
) -> Consumer:
    """A consumer with detok's defaults under `settings`; `start_up` for a short command's
    reader (see `RefusalWatch`)."""
    settings = {**CONSUMER_DEFAULTS, **settings}
    return Consumer(connection.client_config(settings, start_up=start_up))


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
    """An admin client; commands use one for their first requests, so it is a start-up client
    (see `RefusalWatch`)."""
    return AdminClient(connection.client_config({}, start_up=True))


def produce(producer: Producer, topic: str, value: bytes | None, **kwargs: Any) -> None:
    """`producer.produce`, waiting for room while the local queue is full."""
    while True:
        try:
            producer.produce(topic, value, **kwargs)
            return
        except BufferError:
            producer.poll(QUEUE_FULL_WAIT_S)


def kafka_error_text(error: KafkaException) -> str:
    """The client library's message in `error`, else the error's name (a message can be empty),
    never an empty cause. Not redacted: print it through `KafkaConnection.redact`."""
    if not error.args or not isinstance(error.args[0], KafkaError):
        return str(error) or type(error).__name__
    return error.args[0].str() or error.args[0].name()


class KafkaUnavailable(Exception):
    """No broker answered within a command's bound: a clear message instead of a hang or a
    librdkafka traceback."""


class NotAuthorized(Exception):
    """The cluster's ACLs do not let this principal use a resource the command needs."""


class UnknownTopic(LookupError):
    """A command was pointed at a topic the cluster does not have."""


class TopicConfigUnread(KafkaException):
    """A topic's configuration could not be read: the broker's error (`args[0]`, as any
    KafkaException) and which topic it was about (`topic`)."""

    def __init__(self, topic: str, error: KafkaError) -> None:
        super().__init__(error)
        self.topic = topic


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


def serve_refusals(client: Consumer | Producer | AdminClient) -> None:
    """Serve a start-up client's callbacks (`poll(0)`), raising the refusal `RefusalWatch` saw.

    Raised again as a new exception: confluent-kafka keeps an extra reference to an exception
    raised in a callback, so that one lives forever, and with it its traceback, the frames it
    passed and the client in them. An admin client left alive so is destroyed only at interpreter
    exit, while its background thread still calls into Python to complete a pending request: a
    worker refused at start-up (a listener closing every connection) exited 1 with rc 139 now and
    then (issue 32 #14). The original is left with no traceback and no context (an exception
    being handled when the callback ran, whose own traceback holds the client too).
    """
    try:
        client.poll(0)
    except KafkaException as refusal:
        refusal.__traceback__ = refusal.__context__ = refusal.__cause__ = None
        raise KafkaException(*refusal.args) from None


def cluster_metadata(
    client: Consumer | Producer | AdminClient, timeout_s: float, topic: str | None = None
) -> ClusterMetadata:
    """The cluster's metadata (of one topic, or of all), or KafkaUnavailable after `timeout_s`.

    Asked in slices of METADATA_SLICE_S with the client's callbacks served between them, so a
    refused login or handshake (`RefusalWatch`) ends the wait at once, naming its cause. Only
    called before a consumer is assigned anything, so its poll returns no record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.list_topics(topic, timeout=min(METADATA_SLICE_S, timeout_s))
        except KafkaException as error:
            serve_refusals(client)
            if time.monotonic() >= deadline:
                raise KafkaUnavailable(
                    f"no Kafka broker answered within {timeout_s:.0f} s ({error.args[0].str()})"
                ) from error


def topic_partitions(
    client: Consumer | Producer | AdminClient, topic: str, timeout_s: float
) -> list[int]:
    """The partition ids of `topic`, asked of the cluster within `timeout_s`.

    Raises KafkaUnavailable when no broker answers and UnknownTopic when the topic does not exist
    (still unknown after NEW_TOPIC_GRACE_S), so a command says which of the two it met instead of
    producing into the void or waiting.
    """
    grace_ends = time.monotonic() + NEW_TOPIC_GRACE_S
    while True:
        found = cluster_metadata(client, timeout_s, topic).topics.get(topic)
        unknown = found is None or (
            found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        )
        if not unknown or time.monotonic() > grace_ends:
            break
        time.sleep(NEW_TOPIC_RETRY_S)
    if (
        found is not None
        and found.error is not None
        and found.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    ):
        raise NotAuthorized(
            f"not authorized to use topic {topic!r} (the principal of --kafka-config has no "
            "ACL for it; see `detok acls grant`)"
        )
    if found is None or found.error is not None or not found.partitions:
        raise UnknownTopic(f"topic {topic!r} does not exist (create it with `detok topics ensure`)")
    return sorted(found.partitions)


def describe_topic_configs(
    admin: AdminClient,
    topics: Iterable[str],
    deadline: float,
    unknown_until: float,
    await_answer: Callable[[Future], None] | None = None,
) -> dict[str, dict[str, str]]:
    """Each topic's effective configuration (its own settings over the broker's defaults).

    Two answers are asked about again instead of raised, each within its own bound (monotonic
    times): UNKNOWN_TOPIC_OR_PART until `unknown_until` (a topic created a moment ago that the
    answering broker does not know yet: NEW_TOPIC_GRACE_S), and an ask that timed out, on fresh
    metadata, until `deadline` (its broker may be down: CONFIG_ASK_TIMEOUT_S). Any other error,
    or either past its bound, raises TopicConfigUnread. `await_answer` waits for one answer
    before it is read (the worker's serves its callbacks and its stop request); without it the
    ask's own timeout bounds the wait.
    """
    wanted = list(dict.fromkeys(topics))
    configs: dict[str, dict[str, str]] = {}
    while True:
        pending = [ConfigResource(ResourceType.TOPIC, t) for t in wanted if t not in configs]
        if not pending:  # also for no topics at all: describe_configs refuses an empty request
            return configs
        ask_s = max(0.1, min(CONFIG_ASK_TIMEOUT_S, deadline - time.monotonic()))
        timed_out = False
        for resource, future in admin.describe_configs(pending, request_timeout=ask_s).items():
            if await_answer is not None:
                await_answer(future)
            try:
                entries = future.result()
            except KafkaException as exception:
                error, now = exception.args[0], time.monotonic()
                if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and now < unknown_until:
                    continue
                if error.code() == KafkaError._TIMED_OUT and now < deadline:
                    timed_out = True
                    continue
                raise TopicConfigUnread(resource.name, error) from None
            configs[resource.name] = {key: entry.value for key, entry in entries.items()}
        if len(configs) == len(wanted):
            return configs
        if timed_out:
            reread_metadata(admin, deadline)
        time.sleep(NEW_TOPIC_RETRY_S)


def reread_metadata(admin: AdminClient, deadline: float) -> None:
    """Read the cluster's metadata again (any live broker answers), so that the next
    controller-bound ask goes where a live broker points now (see CONFIG_ASK_TIMEOUT_S); a
    failure leaves the next ask to its own bound."""
    remaining = deadline - time.monotonic()
    with contextlib.suppress(KafkaException):
        admin.list_topics(timeout=max(0.1, min(CONFIG_ASK_TIMEOUT_S, remaining)))
