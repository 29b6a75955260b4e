"""How large a record each topic the worker writes accepts, read from the topics at start.

A record the broker refuses as too large used to be a fatal producer error, and the same input
made every restart fail the same way: a crash loop. The worker reads each topic's effective
`max.message.bytes` once at start (contract 6: `detok topics ensure` sets generous ones), sizes
its producer to match, tells the processor how large a text and its held events may grow, and
checks every record against its topic before producing it.

The same start-up read takes the input's and the changelog's partition counts: the state of
input partition p lives in changelog partition p, and the restore of an input partition the
changelog does not have waited forever for it (an input grown with `kafka-topics --alter`, its
changelog left behind). Such a worker now refuses to start, naming both counts and the fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient

from workers.kafka.clients import (
    NEW_TOPIC_GRACE_S,
    KafkaConnection,
    KafkaUnavailable,
    TopicConfigUnread,
    cluster_metadata,
    describe_topic_configs,
    make_admin,
    serve_refusals,
)
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import RECORD_OVERHEAD_BYTES

# The error headers a dead letter adds to an input record: the exception message is cut to
# 4 KiB (workers/kafka/dead_letters.py), the other dozen headers are names and numbers. A
# dead-letter topic must accept any record the input accepts plus this, or a large bad record could
# not be set aside with its original bytes.
DEAD_LETTER_HEADER_ROOM = 8192
# A snapshot holds the text once, plus the decode window, counters and held events: half of the
# changelog's limit for the text leaves the other half for the rest and for JSON escapes
# (quotes and backslashes double).
TEXT_SHARE_OF_LIMIT = 2
# Held events are stored in the snapshot base64-encoded with their origin (value, headers):
# ~2.3x their size. A quarter of the changelog's limit for all of them keeps that inside it.
HELD_SHARE_OF_LIMIT = 4
# librdkafka refuses a producer `message.max.bytes` above this.
LIBRDKAFKA_MAX_MESSAGE_BYTES = 1_000_000_000
# Bounds each wait for the broker's answer, so a stop request is noticed between waits.
POLL_S = 0.5


class TopicLimitError(Exception):
    """The topics cannot hold what the worker must be able to write; says which and why."""


class TopicsUnavailable(Exception):
    """A topic is missing, or the broker did not answer within the start-up bound."""


def changelog_too_small(
    names: TopicNames, input_partitions: int | None, changelog_partitions: int
) -> str:
    """What a worker says when its changelog has fewer partitions than its input: both counts
    (the input's None when the cluster did not say), why it cannot go on, and the fix
    (workers/kafka/topics.py grows the changelog to the input's count)."""
    count = "more" if input_partitions is None else str(input_partitions)
    wanted = "N (the input's count)" if input_partitions is None else str(input_partitions)
    return (
        f"input topic {names.input} has {count} partitions but changelog topic "
        f"{names.changelog} has {changelog_partitions}: the state of input partition p lives in "
        f"changelog partition p, so input partitions from {changelog_partitions} on have nowhere "
        f"to keep theirs; grow the changelog with the input: `detok topics ensure "
        f"--partitions {wanted}` (docs/growing-partitions.md)"
    )


@dataclass(frozen=True)
class OutputLimits:
    """`max.message.bytes` of every topic the worker reads or writes (topic -> bytes), and the
    partition counts of the input and the changelog (topic -> count; empty when not read)."""

    limits: dict[str, int]
    partitions: dict[str, int] = field(default_factory=dict)

    def record_bytes(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[tuple[str, bytes | None]] | None,
    ) -> int:
        size = len(key or b"") + len(value or b"") + RECORD_OVERHEAD_BYTES
        for name, header in headers or ():
            size += len(name.encode("utf-8", "surrogateescape")) + len(header or b"")
        return size

    def fits(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Iterable[tuple[str, bytes | None]] | None = None,
    ) -> bool:
        return self.record_bytes(key, value, headers) <= self.limits[topic]

    def producer_message_max_bytes(self) -> int:
        """The producer's own limit: the largest topic's, so it never refuses what a topic takes
        (each record is checked against its own topic first)."""
        return min(max(self.limits.values()) + RECORD_OVERHEAD_BYTES, LIBRDKAFKA_MAX_MESSAGE_BYTES)

    def max_text_bytes(self, names: TopicNames) -> int:
        """How long a request's text may grow: it travels whole in a completion and a snapshot."""
        smallest = min(self.limits[names.completions], self.limits[names.changelog])
        return (smallest - RECORD_OVERHEAD_BYTES) // TEXT_SHARE_OF_LIMIT

    def max_held_bytes(self, names: TopicNames) -> int:
        return self.limits[names.changelog] // HELD_SHARE_OF_LIMIT

    def check_dead_letters_hold_input(self, names: TopicNames) -> None:
        """Refuse to start when a bad input record could not be dead-lettered whole."""
        needed = self.limits[names.input] + DEAD_LETTER_HEADER_ROOM
        if self.limits[names.dead_letters] < needed:
            raise TopicLimitError(
                f"dead-letter topic {names.dead_letters} accepts records up to "
                f"{self.limits[names.dead_letters]} bytes (max.message.bytes), but a bad record "
                f"of input topic {names.input} may need {needed} "
                f"({self.limits[names.input]} + {DEAD_LETTER_HEADER_ROOM} for error headers); "
                f"raise its max.message.bytes (e.g. `detok topics ensure`) to at least {needed}"
            )

    def check_changelog_covers_input(self, names: TopicNames) -> None:
        """Refuse to start when an input partition has no changelog partition for its state
        (its restore would wait for it forever)."""
        inputs, changelogs = self.partitions.get(names.input), self.partitions.get(names.changelog)
        if inputs is not None and changelogs is not None and changelogs < inputs:
            raise TopicLimitError(changelog_too_small(names, inputs, changelogs))


def read_output_limits(
    connection: KafkaConnection,
    names: TopicNames,
    timeout_s: float,
    should_stop: Callable[[], bool],
) -> OutputLimits:
    """Each pipeline topic's effective `max.message.bytes`.

    Raises TopicsUnavailable when a topic does not exist or the broker does not answer within
    `timeout_s` (or a stop is requested first): every later wait of the worker assumes both. A
    topic the answering broker does not know is asked about again for NEW_TOPIC_GRACE_S first,
    and an ask that timed out is made again (`describe_topic_configs`).
    """
    topics = list(dict.fromkeys(names.model_dump().values()))
    admin = make_admin(connection)
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        configs = describe_topic_configs(
            admin,
            topics,
            deadline,
            unknown_until=started + min(NEW_TOPIC_GRACE_S, timeout_s),
            await_answer=partial(
                _await_answer, admin, connection, timeout_s, deadline, should_stop
            ),
        )
    except TopicConfigUnread as unread:
        raise _unusable(unread.topic, unread.args[0], connection, timeout_s) from None
    return OutputLimits(
        {t: int(configs[t]["max.message.bytes"]) for t in topics},
        _partition_counts(admin, connection, [names.input, names.changelog], timeout_s, deadline),
    )


def _partition_counts(
    admin: AdminClient,
    connection: KafkaConnection,
    topics: list[str],
    timeout_s: float,
    deadline: float,
) -> dict[str, int]:
    """The partition counts of `topics`, all of which were just described (so they exist), asked
    within what is left of the start-up bound."""
    counts = {}
    for topic in topics:
        try:
            metadata = cluster_metadata(admin, max(0.1, deadline - time.monotonic()), topic)
        except KafkaUnavailable:
            raise _no_answer(connection, timeout_s) from None
        found = metadata.topics.get(topic)
        if found is not None and found.error is None:
            counts[topic] = len(found.partitions)
    return counts


def _await_answer(
    admin: AdminClient,
    connection: KafkaConnection,
    timeout_s: float,
    deadline: float,
    should_stop: Callable[[], bool],
    future: Future,
) -> None:
    # The stop request is checked before each answer is read, even one already there, so it also
    # ends a round of asking again about topics not known yet.
    while True:
        serve_refusals(admin)  # a refused login ends the wait, named (see RefusalWatch)
        if should_stop():
            raise TopicsUnavailable("stopped while reading the topic configurations")
        if future.done():
            return
        if time.monotonic() > deadline:
            raise _no_answer(connection, timeout_s)
        time.sleep(POLL_S / 10)


def _no_answer(connection: KafkaConnection, timeout_s: float) -> TopicsUnavailable:
    return TopicsUnavailable(
        f"Kafka at {connection.bootstrap_servers} did not answer within "
        f"{timeout_s:.0f} s (is the broker up and reachable?)"
    )


def _unusable(
    topic: str, error: KafkaError, connection: KafkaConnection, timeout_s: float
) -> TopicsUnavailable:
    if error.code() == KafkaError._TIMED_OUT:
        return _no_answer(connection, timeout_s)
    if error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return TopicsUnavailable(
            f"not authorized to describe the configuration of topic {topic} "
            "(DESCRIBE_CONFIGS; `detok acls grant --role worker` grants the worker's ACLs)"
        )
    return TopicsUnavailable(
        f"topic {topic} is not usable: {error.str()} (does it "
        "exist? create the pipeline's topics with `detok topics ensure`)"
    )
