"""The pipeline's Kafka topics: their required shape, created or checked by `detok topics ensure`.

Why explicit: the local broker has `auto.create.topics.enable=false`, and a production cluster
usually does too, so every topic is created here with the shape the pipeline relies on:

- `completions` and `changelog` are compacted: only the latest record per key matters, and a
  compacted log stays bounded while still rebuilding state from the beginning.
- Every topic has `--partitions` partitions (by default the input's count when it exists, else
  DEFAULT_PARTITIONS), and in particular the changelog has at least the input's: worker state for
  input partition p is written to changelog partition p (by explicit partition, never by key
  hash), and a worker refuses a changelog with fewer partitions than its input. A topic with
  fewer partitions is grown: the changelog first, then the other outputs, the input last, so a
  running worker is never assigned an input partition whose changelog partition does not exist
  yet. Growing the changelog moves none of its records; growing the input moves the keys of new
  requests (docs/growing-partitions.md says what that does to requests in flight), so the input
  is only grown to a count given explicitly. A topic with more partitions is refused: Kafka
  cannot shrink a topic.
- Record size limits (`max.message.bytes`), so that no output the worker writes is refused by the
  broker (a refused output would otherwise stop a partition):
  - the input topic keeps whatever limit it has (the broker's `message.max.bytes`, 1,048,588
    bytes by default, when `ensure` creates it): what producers may send is the operator's call;
  - deltas, completions, metrics and the changelog get OUTPUT_MAX_MESSAGE_BYTES (8 MiB). A
    completion and a changelog snapshot each carry a request's whole text, so their limit is the
    longest text detok can publish; 8 MiB holds a million-token generation at four bytes per token
    with room for JSON escaping, far beyond today's context windows, while still bounding what
    one record costs a reader's memory. The worker reads these limits at start and fails a
    longer request with `output_too_large` instead of producing what the broker would refuse.
  - the dead-letter topic gets the larger of the input's and the changelog's limit plus
    DEAD_LETTER_HEADER_ALLOWANCE (64 KiB): a dead letter is an input record (or, for a failed
    restore, a changelog record) with its original bytes and headers, plus the error headers
    (a message capped at 4 KiB, the source topic name of at most 249 characters, a request id of
    at most 512, and a few short fields), so any record either topic accepts fits.
  - the control topic (stop signals for engines) gets OUTPUT_MAX_MESSAGE_BYTES too. Its records
    are small, but `max.message.bytes` bounds a record *batch*, and the worker's producer fills
    batches up to librdkafka's `batch.size` (1 MB) when thousands of requests end in one
    transaction (20k TTL expiries): a 64 KiB limit refused such a batch and failed the worker.
  An existing topic whose limit is lower is raised to these values (raising a limit never breaks
  a reader or a writer); a higher limit is left as it is.

Replication: by default every topic gets min(3, brokers in the cluster) replicas, and where that
is 3, `min.insync.replicas=2`. The workers produce with acks=all (idempotence implies it), so a
record is acknowledged once two replicas hold it: one broker may fail (or be restarted in a
rolling upgrade) without losing an acknowledged record or blocking writers. On one broker there
is nothing to replicate to, so the same command keeps working for the local single-node setup.

`ensure_topics` is idempotent: it creates what is missing and validates what exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    KafkaConnection,
    as_connection,
    cluster_metadata,
    describe_topic_configs,
    make_admin,
)
from workers.kafka.topic_names import TopicNames

__all__ = [
    "DEFAULT_PARTITIONS",
    "EnsuredTopics",
    "TopicConfigurationMismatch",
    "TopicNames",
    "default_replication_factor",
    "delete_topics",
    "ensure_topics",
    "message_limit",
    "required_message_limits",
]

# Admin requests on a healthy cluster take milliseconds; 30 s covers a broker that is still
# electing leaders for freshly created topics, without letting the CLI hang forever.
ADMIN_TIMEOUT_S = 30.0
DEFAULT_PARTITIONS = 4
COMPACTED_CONFIG = {"cleanup.policy": "compact"}
MAX_MESSAGE_BYTES = "max.message.bytes"
# See the module docstring for why each value.
OUTPUT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DEAD_LETTER_HEADER_ALLOWANCE = 64 * 1024
# Three replicas survive one broker failure with two in sync; more cost disk and write latency
# for a second simultaneous failure, the operator's call (`--replication-factor`).
MAX_DEFAULT_REPLICATION_FACTOR = 3
# With 3 replicas and acks=all, a write needs 2 in sync: one broker may be down, and an
# acknowledged record is on two disks. With fewer replicas the broker default (1) stays.
MIN_INSYNC_REPLICAS = {3: "2"}
# How often `ensure` looks again for configs still on their way to the brokers: they arrive in
# milliseconds, so a short pause costs nothing.
POLL_INTERVAL_S = 0.1


class TopicConfigurationMismatch(Exception):
    """An existing topic's shape contradicts what the pipeline needs; it is not changed."""


@dataclass(frozen=True)
class EnsuredTopics:
    """What `ensure_topics` did: topics it created, existing topics it validated, existing
    topics whose `max.message.bytes` it raised, and existing topics it grew to `partitions`."""

    created: tuple[str, ...]
    validated: tuple[str, ...]
    raised_limits: tuple[str, ...] = ()
    grown: tuple[str, ...] = ()
    partitions: int = DEFAULT_PARTITIONS


def required_message_limits(names: TopicNames, input_limit: int) -> dict[str, int]:
    """The `max.message.bytes` every topic but the input needs, given the input's limit."""
    outputs = (names.deltas, names.completions, names.metrics, names.changelog, names.control)
    limits = dict.fromkeys(outputs, OUTPUT_MAX_MESSAGE_BYTES)
    limits[names.dead_letters] = (
        max(input_limit, OUTPUT_MAX_MESSAGE_BYTES) + DEAD_LETTER_HEADER_ALLOWANCE
    )
    return limits


# What a record costs beyond its key, value and header bytes: the record batch header (61 bytes),
# the record's own framing (varints, attributes, deltas: up to ~20), and a few bytes per header.
# 512 covers a record with a hundred headers; an estimate that errs high only makes a record
# that would have just fitted take the too-large path.
RECORD_OVERHEAD_BYTES = 512


def message_limit(admin: AdminClient, topic: str, timeout_s: float = ADMIN_TIMEOUT_S) -> int:
    """The `max.message.bytes` a topic accepts (its own setting, else the broker's)."""
    return int(topic_configs(admin, [topic], timeout_s)[topic][MAX_MESSAGE_BYTES])


def ensure_topics(
    connection: KafkaConnection | str,
    names: TopicNames,
    partitions: int | None = None,
    replication_factor: int | None = None,
) -> EnsuredTopics:
    """Create the pipeline's missing topics, validate the existing ones, grow those with fewer
    than `partitions` partitions, raise too-low limits.

    `partitions` defaults to the input's count if it exists, else DEFAULT_PARTITIONS: growing the
    input moves keys, so it happens only for a count asked for. `replication_factor` defaults to
    `default_replication_factor` of the cluster's size. Raises TopicConfigurationMismatch, listing
    every problem at once, if an existing topic has more partitions than `partitions` or a
    compacted topic lacks `cleanup.policy=compact`; KafkaUnavailable if no broker answers.
    """
    if (partitions is not None and partitions < 1) or (
        replication_factor is not None and replication_factor < 1
    ):
        raise ValueError("partitions and replication_factor must be at least 1")
    admin = make_admin(as_connection(connection))
    if replication_factor is None:
        replication_factor = default_replication_factor(
            len(cluster_metadata(admin, METADATA_TIMEOUT_S).brokers)
        )
    wanted = list(names.all)
    existing = _partition_counts(admin, wanted)
    if partitions is None:
        partitions = existing.get(names.input, DEFAULT_PARTITIONS)
    # Validate before creating, so a refused run leaves the cluster as it found it.
    _validate(admin, names, partitions, existing)
    missing = [name for name in wanted if name not in existing]
    # The input first: the dead-letter topic's limit follows from the input's actual one.
    if names.input in missing:
        _create(admin, {names.input: {}}, partitions, replication_factor)
    limits = required_message_limits(names, message_limit(admin, names.input))
    to_create = {
        name: {
            **(COMPACTED_CONFIG if name in names.compacted else {}),
            MAX_MESSAGE_BYTES: str(limits[name]),
        }
        for name in missing
        if name != names.input
    }
    _create(admin, to_create, partitions, replication_factor)
    if missing:
        # Another `ensure` (or an operator) may have created some of them meanwhile.
        existing = _partition_counts(admin, wanted)
        _validate(admin, names, partitions, existing)
    grown = _grow(admin, names, partitions, existing)
    raised = _raise_limits(admin, limits)
    _await_limits(admin, limits)
    return EnsuredTopics(
        created=tuple(missing),
        validated=tuple(name for name in wanted if name in existing and name not in missing),
        raised_limits=raised,
        grown=grown,
        partitions=partitions,
    )


def default_replication_factor(brokers: int) -> int:
    """min(3, brokers): see the module docstring."""
    return max(1, min(MAX_DEFAULT_REPLICATION_FACTOR, brokers))


def delete_topics(
    connection: KafkaConnection | str, topics: list[str], timeout_s: float = 60.0
) -> list[str]:
    """Delete throwaway topics (a demo's, a benchmark run's); returns what could not be deleted.

    Runs that make fresh topics must drop them: a local broker left with thousands of partitions
    spends its CPU on their background upkeep, which showed up as stalled transaction commits.
    Never raises: a leftover topic only costs disk, so callers report it and go on.
    """
    admin = make_admin(as_connection(connection))
    failed = []
    for topic, future in admin.delete_topics(topics).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException:
            failed.append(topic)
    return failed


def _create(
    admin: AdminClient,
    configs: Mapping[str, dict[str, str]],
    partitions: int,
    replication_factor: int,
) -> None:
    if not configs:
        return  # create_topics refuses an empty request
    replication = {}
    if replication_factor in MIN_INSYNC_REPLICAS:
        replication["min.insync.replicas"] = MIN_INSYNC_REPLICAS[replication_factor]
    new_topics = [
        NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config={**replication, **config},
        )
        for name, config in configs.items()
    ]
    futures = admin.create_topics(new_topics, operation_timeout=ADMIN_TIMEOUT_S)
    for future in futures.values():
        try:
            future.result(timeout=ADMIN_TIMEOUT_S)
        except KafkaException as error:
            # A concurrent `ensure` created it first; the re-validation checks it.
            if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def _grow(
    admin: AdminClient, names: TopicNames, partitions: int, existing: Mapping[str, int]
) -> tuple[str, ...]:
    """Grow every topic with fewer than `partitions` partitions to that many; the topics grown.

    The changelog and the outputs first, the input once they show their new partitions: a
    running worker is assigned an input partition only after its changelog partition exists
    (a worker refuses an input partition without one)."""
    short = [name for name in names.all if existing.get(name, partitions) < partitions]
    outputs = [name for name in short if name != names.input]
    for step in (outputs, [name for name in short if name == names.input]):
        if not step:
            continue
        futures = admin.create_partitions(
            [NewPartitions(name, partitions) for name in step],
            operation_timeout=ADMIN_TIMEOUT_S,
            request_timeout=ADMIN_TIMEOUT_S,
        )
        for future in futures.values():
            future.result(timeout=ADMIN_TIMEOUT_S)
        _await_partitions(admin, step, partitions)
    return tuple(short)


def _await_partitions(admin: AdminClient, topics: list[str], partitions: int) -> None:
    """Return once every one of `topics` lists `partitions` partitions (new partitions reach the
    brokers' metadata a moment after the request returns); raise TopicConfigurationMismatch if
    one does not within ADMIN_TIMEOUT_S."""
    deadline = time.monotonic() + ADMIN_TIMEOUT_S
    while True:
        counts = _partition_counts(admin, topics)
        short = [name for name in topics if counts.get(name, 0) < partitions]
        if not short:
            return
        if time.monotonic() > deadline:
            raise TopicConfigurationMismatch(
                f"{short} still list fewer than {partitions} partitions "
                f"{ADMIN_TIMEOUT_S:.0f} s after growing them"
            )
        time.sleep(POLL_INTERVAL_S)


def _raise_limits(admin: AdminClient, limits: Mapping[str, int]) -> tuple[str, ...]:
    """Raise `max.message.bytes` of existing topics that are below `limits`; the topics raised."""
    current = topic_configs(admin, list(limits))
    too_low = [
        name for name, limit in limits.items() if int(current[name][MAX_MESSAGE_BYTES]) < limit
    ]
    if not too_low:
        return ()
    resources = [
        ConfigResource(
            ResourceType.TOPIC,
            name,
            incremental_configs=[
                ConfigEntry(
                    MAX_MESSAGE_BYTES,
                    str(limits[name]),
                    incremental_operation=AlterConfigOpType.SET,
                )
            ],
        )
        for name in too_low
    ]
    futures = admin.incremental_alter_configs(resources, request_timeout=ADMIN_TIMEOUT_S)
    for future in futures.values():
        future.result(timeout=ADMIN_TIMEOUT_S)
    return tuple(too_low)


def _await_limits(admin: AdminClient, limits: Mapping[str, int]) -> None:
    """Return once every topic shows at least its limit; raise TopicConfigurationMismatch if one
    does not within ADMIN_TIMEOUT_S.

    A created topic or an altered config reaches the brokers a moment after the admin request
    returns; a worker started right after `ensure` reads these limits, so `ensure` returns only
    once they can be read.
    """
    deadline = time.monotonic() + ADMIN_TIMEOUT_S
    while True:
        current = topic_configs(admin, list(limits))
        short = [n for n, limit in limits.items() if int(current[n][MAX_MESSAGE_BYTES]) < limit]
        if not short:
            return
        if time.monotonic() > deadline:
            raise TopicConfigurationMismatch(
                f"max.message.bytes of {short} still below {[limits[n] for n in short]} "
                f"{ADMIN_TIMEOUT_S:.0f} s after setting it"
            )
        time.sleep(POLL_INTERVAL_S)


def _validate(
    admin: AdminClient, names: TopicNames, partitions: int, existing: dict[str, int]
) -> None:
    """Raise TopicConfigurationMismatch listing every way `existing` topics differ from the need.

    A topic with fewer than `partitions` partitions is not a problem (`_grow` grows it); one with
    more is, since Kafka cannot shrink a topic.
    """
    problems = []
    for name, count in existing.items():
        if count > partitions:
            problems.append(
                f"{name} has {count} partitions, expected {partitions} (a topic cannot shrink; "
                f"--partitions {count} grows the others to match)"
            )
    compacted_existing = [name for name in names.compacted if name in existing]
    for name, config in topic_configs(admin, compacted_existing).items():
        policy = config["cleanup.policy"]
        if "compact" not in policy.split(","):
            problems.append(f"{name} must be compacted (cleanup.policy=compact), has {policy!r}")
    if problems:
        raise TopicConfigurationMismatch("; ".join(problems))


def _partition_counts(admin: AdminClient, topics: list[str]) -> dict[str, int]:
    """Partition counts of those of `topics` that exist."""
    metadata = cluster_metadata(admin, METADATA_TIMEOUT_S)
    return {
        name: len(metadata.topics[name].partitions) for name in topics if name in metadata.topics
    }


def topic_configs(
    admin: AdminClient, topics: Iterable[str], timeout_s: float = ADMIN_TIMEOUT_S
) -> dict[str, dict[str, str]]:
    """Each topic's effective configuration. Every topic asked about exists (ensure made it), so
    one the answering broker does not know yet is asked about again for all of `timeout_s`, and
    so is an ask that timed out (`describe_topic_configs`)."""
    deadline = time.monotonic() + timeout_s
    return describe_topic_configs(admin, topics, deadline, unknown_until=deadline)
