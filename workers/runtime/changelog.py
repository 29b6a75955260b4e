"""The worker's changelog: request snapshots written at commit, and read back on assignment.

A compacted topic with the input's partition count: the snapshot of a request on input
partition p goes to changelog partition p, so whoever is assigned p restores exactly p's
requests. A request's snapshot is its head record (keyed by request id) and its text segments
(keyed by request id, 0xFF, number), written incrementally (`pipeline.request_state`,
'Incremental changelog'): a restore puts each head back with the segments of its key. Each
record carries the input offset its snapshot reflects (Quix Streams' processed-offset header,
from its `state/recovery.py`), so a guarantee whose snapshots can run ahead of its committed
input (at-least-once) can skip those on restore.

Restoring is guarded per record, like the input: a changelog value that cannot become request
state (garbage, a snapshot of an older format, a model no longer configured) fails only its
request, goes to the dead-letter topic as `restore_failed` with its original bytes, and the
restore goes on. One bad record must not stop every future owner of the partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from pipeline.processor import BatchResult, DeadLetter
from pipeline.request_state import SEGMENT_SEPARATOR, split_changelog_key
from schemas.events import DeadLetterReason
from workers.kafka.clients import KafkaConnection, make_consumer
from workers.kafka.origin import KafkaOrigin
from workers.runtime.checkpointing import COORDINATOR_MOVING_ERRORS, FatalWorkerError, Output

log = logging.getLogger("detok.worker")

PROCESSED_OFFSET_HEADER = "__detok.processed_offset"
# The restore consumer's fetch wait and consume timeout: short, because it only reads to the end
# of what is already there; a broker holding a fetch open for data that will never come (the
# default 500 ms) only delays the end-of-partition. `consume` returns when its batch is full or
# its timeout ends, so the call that brings the last end-of-partition event waits out the whole
# timeout: at 50 ms, a restore of an empty changelog spent half of its ~0.1 s there. At 5 ms the
# loop asks again 200 times a second while a fetch is on its way, each call a few microseconds.
RESTORE_FETCH_WAIT_MS = 10
RESTORE_CONSUME_TIMEOUT_S = 0.005
RESTORE_BATCH = 10_000
# A restore that makes no progress (a broker outage) logs this often while it waits; it waits
# for as long as the broker is away, but a stop request ends it at once.
STALL_LOG_INTERVAL_S = 10.0
# Bounds the one metadata lookup before reading (see `_look_up_metadata`).
METADATA_TIMEOUT_S = 10.0
# Bounds the lookup made again when a restore stalls: short, since the loop is not watching
# for a stop request meanwhile.
STALL_METADATA_TIMEOUT_S = 1.0


# How long one lookup of the group's committed offsets waits for a pending transaction before
# the restore logs that it still waits and asks again (see `settled_commits`).
SETTLE_LOOKUP_TIMEOUT_S = 5.0
# The pause after a lookup refused at once, doubling up to the longest: a moving coordinator is
# not asked hundreds of times a second.
LOOKUP_RETRY_PAUSE_S = 0.2
LOOKUP_MAX_RETRY_PAUSE_S = 2.0


class RestoreInterrupted(Exception):
    """A stop was requested while restoring; the partitions stay unrestored, and none of their
    records is handled."""


class ChangelogPartitionsMissing(FatalWorkerError):
    """Partitions to restore that the changelog topic does not have: the input grew and the
    changelog did not. Their restore would wait for them forever; the worker stops instead, and
    names both counts (`workers.runtime.output_limits.changelog_too_small`)."""

    def __init__(self, topic: str, partitions: int, missing: list[int]) -> None:
        super().__init__(
            f"changelog topic {topic} has {partitions} partitions; partitions {missing} to "
            "restore do not exist"
        )
        self.partitions = partitions


def changelog_record(
    topic: str,
    request_id: str,
    snapshot: bytes | None,
    partition: int,
    processed_offset: int,
    key: bytes | None = None,
) -> Output:
    """A record of a request's snapshot (None: a tombstone): its head by default, else `key`
    (one of its text segments)."""
    return Output(
        topic,
        request_id.encode() if key is None else key,
        snapshot,
        headers=[(PROCESSED_OFFSET_HEADER, str(processed_offset).encode())],
        partition=partition,
        request_id=request_id,
    )


class RestoreTarget(Protocol):
    """What a restore puts state back into: the processor's contract-4 calls."""

    retired_segments: dict[str, int]

    def restore(
        self, request_id: str, snapshot: bytes | None, segments: Mapping[int, bytes] | None = None
    ) -> None: ...
    def fail_restore(self, request_id: str, value: bytes | None, message: str) -> BatchResult: ...


@dataclass
class Restored:
    """The outcome of one restore: the requests now in memory and the records that failed."""

    owners: dict[str, int] = field(default_factory=dict)  # request id -> partition
    failed: list[DeadLetter] = field(default_factory=list)
    records: int = 0
    # What failing the requests of `failed` gave (`fail_restore`): their failed completions.
    failed_requests: BatchResult = field(default_factory=BatchResult)


def settled_commits(
    consumer: Consumer,
    topic: str,
    partitions: Iterable[int],
    should_stop: Callable[[], bool],
    lookup_timeout_s: float = SETTLE_LOOKUP_TIMEOUT_S,
) -> dict[int, int]:
    """The group's committed offsets of `topic`'s `partitions`, once no transaction holds any of
    them pending; asked of the group's own read_committed consumer before the changelog is read
    (a restore) and before the input is rewound to them (the rollback after an abort).

    The previous owner's last transaction carries its final snapshots and its offsets together,
    and `commit_transaction` returns before the commit markers are written to each partition:
    a restore that read the changelog to its end (the last stable offset) in between missed
    those snapshots, while the input fetch, which waits for stable offsets, started after them.
    A joining worker then dead-lettered its requests' next events as `missing_prompt` (a
    `bench_e2e` join run: 431 events of 36 requests, so it became observable once the second
    round of a join came in 0.13 s). A read_committed consumer's lookup asks for stable offsets
    (librdkafka retries while the broker answers UNSTABLE_OFFSET_COMMIT), and the broker settles
    a transaction's offsets after appending its markers, so once they settle the snapshots of
    the same transaction can be read. Waiting costs nothing the input would not wait for anyway.

    A coordinator on the move (COORDINATOR_MOVING_ERRORS) is waited out the same way, since the
    cluster recovers from it by itself; either wait ends at once on a stop (RestoreInterrupted).
    """
    wanted = [TopicPartition(topic, p) for p in sorted(partitions)]
    pause = LOOKUP_RETRY_PAUSE_S
    while True:
        try:
            return {tp.partition: tp.offset for tp in consumer.committed(wanted, lookup_timeout_s)}
        except KafkaException as exception:
            error: KafkaError = exception.args[0]
            if error.code() != KafkaError._TIMED_OUT and error.code() not in (
                COORDINATOR_MOVING_ERRORS
            ):
                raise
        if should_stop():
            raise RestoreInterrupted(f"stopped while waiting for the commits of {topic} {wanted}")
        if error.code() == KafkaError._TIMED_OUT:
            log.warning(
                "the lookup of partitions %s waits for a transaction to settle",
                sorted(partitions),
            )
            continue
        log.warning(
            "the lookup of partitions %s waits for the group coordinator (%s)",
            sorted(partitions),
            error.name(),
        )
        time.sleep(pause)
        pause = min(pause * 2, LOOKUP_MAX_RETRY_PAUSE_S)


def _look_up_metadata(
    consumer: Consumer, topic: str, partitions: list[int], timeout_s: float | None = None
) -> None:
    """Ask for the changelog's metadata before reading: without it at hand, librdkafka looks it
    up on its own slower schedule, and asking first took an empty restore from ~2 s to ~0.1 s.

    Raises FatalWorkerError for a changelog that does not exist, and ChangelogPartitionsMissing
    for `partitions` it does not have: librdkafka waits for an assigned partition to appear,
    silently, so the restore would wait forever (an input grown, its changelog not).

    Otherwise only a head start: when no broker answers (every broker of a cluster restarting),
    the restore goes on and waits for the cluster in its reading loop, which a stop ends. Raised
    from here, the lookup's transport error ended the worker instead (exit 1)."""
    try:
        metadata = consumer.list_topics(topic, timeout_s or METADATA_TIMEOUT_S)
    except KafkaException as exception:
        log.warning("restore: metadata of %s not at hand (%s); reading on", topic, exception)
        return
    found = metadata.topics.get(topic)
    if found is None:
        return
    if found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
        raise FatalWorkerError(f"changelog topic {topic} does not exist")
    missing = [p for p in partitions if p not in found.partitions]
    if found.error is None and found.partitions and missing:
        raise ChangelogPartitionsMissing(topic, len(found.partitions), missing)


def read_latest(
    connection: KafkaConnection,
    group: str,
    topic: str,
    partitions: Iterable[int],
    should_stop: Callable[[], bool],
    committed_input: Mapping[int, int] | None = None,
) -> dict[bytes | None, Message]:
    """The latest changelog record per key of `partitions`, read to each partition's end.

    With `committed_input` (partition -> committed input offset; at-least-once), the latest
    record per key *not ahead of* that commit: a snapshot written for input the group never
    committed is passed over for the one before it. Skipping only after reading (keeping the
    newest and dropping it when ahead) lost the request: after a kill -9 between a snapshot and
    its offset commit, the restore had no state for a request whose prompt lay before the
    commit, the replayed chunks after it found nothing to extend, and its completion never
    came (the at-least-once kill -9 test missed 6 of 240 completions in 1 run of 5).

    Reads to partition EOF, never "offset == high watermark - 1": under read_committed,
    transaction markers occupy offsets and that test can hang. Compaction keeps this proportional
    to live requests. Waits through a broker outage (logging), never past a stop request.
    """
    numbers = sorted(partitions)
    consumer = make_consumer(
        connection,
        {
            "group.id": f"{group}-restore",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "fetch.wait.max.ms": RESTORE_FETCH_WAIT_MS,
        },
    )
    latest: dict[bytes | None, Message] = {}
    try:
        _look_up_metadata(consumer, topic, numbers)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in numbers])
        remaining = set(numbers)
        last_progress = time.monotonic()
        while remaining:
            if should_stop():
                raise RestoreInterrupted(f"stopped while restoring partitions {numbers}")
            messages = consumer.consume(RESTORE_BATCH, RESTORE_CONSUME_TIMEOUT_S)
            if messages:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress >= STALL_LOG_INTERVAL_S:
                # Asked again: the first lookup may have met no broker.
                _look_up_metadata(consumer, topic, sorted(remaining), STALL_METADATA_TIMEOUT_S)
                log.warning(
                    "restore of %s partitions %s: no progress for %.0f s (broker away?); "
                    "still waiting",
                    topic,
                    sorted(remaining),
                    time.monotonic() - last_progress,
                )
                last_progress = time.monotonic()
            for message in messages:
                error = message.error()
                if error is None:
                    if committed_input is None or not _surely_ahead(message, committed_input):
                        latest[message.key()] = message
                elif error.code() == KafkaError._PARTITION_EOF:
                    remaining.discard(message.partition())
                elif error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise FatalWorkerError(f"changelog topic {topic} does not exist")
                elif error.fatal():
                    raise FatalWorkerError(f"restore consumer: {error.str()}")
                else:
                    log.warning("restore consumer: %s", error.str())
    finally:
        consumer.close()
    return latest


def apply_latest(
    latest: dict[bytes | None, Message],
    target: RestoreTarget,
    committed_input: dict[int, int] | None,
) -> Restored:
    """Put each latest snapshot into `target`, guarded record by record.

    `committed_input` (partition -> committed input offset) is given when snapshots ahead of the
    committed input must be skipped (at-least-once); `read_latest` given it too has already
    passed those over for the record before them, so here it fails a record whose offset header
    does not parse.
    """
    restored = Restored()
    heads, segments = _heads_and_segments(latest, committed_input)
    owners = restored.owners
    restore = target.restore
    for key, message in heads.items():
        restored.records += 1
        request_id: str | None = None
        own_segments = segments.get(key)
        try:
            request_id = key.decode() if key is not None else None
            if request_id is None:
                raise ValueError("changelog record without a key")
            if committed_input is not None and _ahead_of_commit(message, committed_input):
                continue
            value = message.value()
            restore(request_id, value, own_segments)
            if value is not None:
                owners[request_id] = message.partition()
        except Exception as error:  # the per-record rule: any failure fails this record only
            text = f"changelog record cannot be restored: {error}"
            restored.failed.append(
                DeadLetter(
                    DeadLetterReason.RESTORE_FAILED,
                    type(error).__name__,
                    text,
                    request_id,
                    None,
                    KafkaOrigin(message),
                )
            )
            if request_id is not None:
                failed = target.fail_restore(request_id, message.value(), text)
                restored.failed_requests.merge(failed)
                owners[request_id] = message.partition()
                if own_segments:
                    # Its segments can never be read now: tombstones with its failed marker.
                    target.retired_segments[request_id] = max(own_segments) + 1
    return restored


def _heads_and_segments(
    latest: dict[bytes | None, Message], committed_input: dict[int, int] | None
) -> tuple[dict[bytes | None, Message], dict[bytes, dict[int, bytes]]]:
    """The head records, and each head key's live text segments (number -> text bytes).

    A segment is skipped like a head when it is ahead of the committed input; a segment whose
    key or offset header does not parse is left out (its head, if any, then misses it and
    fails, dead-lettered).
    """
    heads: dict[bytes | None, Message] = {}
    segments: dict[bytes, dict[int, bytes]] = {}
    for key, message in latest.items():
        if key is None or SEGMENT_SEPARATOR not in key:
            heads[key] = message
            continue
        value = message.value()
        if value is None:
            continue
        try:
            if committed_input is not None and _ahead_of_commit(message, committed_input):
                continue
            head, number = split_changelog_key(key)
        except ValueError:  # a damaged offset header or key: its head misses it and fails
            continue
        segments.setdefault(head, {})[number] = value  # type: ignore[index]
    return heads, segments


def _surely_ahead(message: Message, committed_input: Mapping[int, int]) -> bool:
    """`_ahead_of_commit`, False for a damaged offset header: such a record is kept, and
    `apply_latest` fails its request (dead-lettered) rather than restoring an older state."""
    try:
        return _ahead_of_commit(message, committed_input)
    except ValueError:
        return False


def _ahead_of_commit(message: Message, committed_input: Mapping[int, int]) -> bool:
    """Under at-least-once: was this snapshot written for input the group never committed?
    ValueError for a damaged offset header (a header without a value is one)."""
    for key, value in message.headers() or ():
        if key == PROCESSED_OFFSET_HEADER:
            if value is None:
                raise ValueError(f"{PROCESSED_OFFSET_HEADER} has no value")
            return int(value) > committed_input.get(message.partition(), -1)
    return False
