"""Dead-letter records on Kafka, and `detok dlq redrive`.

A dead letter keeps the original key, value, timestamp and headers, then adds error headers under
the names Kafka Connect uses (so existing DLQ tooling reads them) plus detok's own. Error headers
already on the input record (`__connect.errors.*`, `__detok.errors.*`) are dropped, not kept:
they describe no failure of ours, and keeping them let any producer make a record appear in the
dead-letter topic with a reason and message of its choosing. The one exception is the attempt
count `__detok.errors.attempt`, which `dlq redrive` sets on the records it re-produces: a valid
count is kept (a redriven record that fails again says which attempt it was), anything else
counts as attempt 0.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from pipeline.processor import DeadLetter
from workers.kafka_options import add_bootstrap_servers
from workers.topics import TopicNames

CONNECT = "__connect.errors."
DETOK = "__detok.errors."
ATTEMPT_HEADER = DETOK + "attempt"
# Connect truncates nothing, but a multi-kilobyte pydantic message in every header is noise and
# eats the record size limit; the first 4 KiB always holds the cause.
MAX_MESSAGE_BYTES = 4096
STAGE_OF_REASON = {
    "malformed_json": "deserialize",
    "schema_violation": "validate",
    "token_id_out_of_range": "validate",
    "unknown_model": "validate",
    "missing_prompt": "sequence",
    "event_after_finish": "sequence",
    "sequence_gap": "sequence",
    "strict_decode_failure": "decode",
    "request_already_failed": "upstream_failed",
    "ttl_expired": "ttl",
    "unexpected_error": "process",
    "output_too_large": "produce",
    "restore_failed": "restore",
    "key_mismatch": "validate",
    "partition_mismatch": "sequence",
}


def dead_letter_headers(
    letter: DeadLetter, group: str, instance_id: str, *, keep_original: bool = True
) -> list[tuple[str, bytes | None]]:
    """The record's own headers (error headers removed), then this failure's error headers.

    `keep_original=False` leaves the record's own headers out: for an `output_too_large` dead
    letter, which must fit even when those headers are what made the record too large.
    """
    origin = letter.origin
    original = _own_headers(origin.headers) if origin is not None and keep_original else []
    attempt = _attempt(origin.headers) if origin is not None else 0
    error_headers = {
        CONNECT + "topic": origin.source if origin else "",
        CONNECT + "partition": str(origin.partition) if origin else "",
        CONNECT + "offset": str(origin.offset) if origin else "",
        CONNECT + "exception.class.name": letter.error_class,
        CONNECT + "exception.message": letter.message.encode()[:MAX_MESSAGE_BYTES].decode(
            "utf-8", "ignore"
        ),
        CONNECT + "stage": STAGE_OF_REASON[letter.reason.value],
        CONNECT + "connector.name": group,
        CONNECT + "task.id": instance_id,
        DETOK + "reason": letter.reason.value,
        DETOK + "request_id": letter.request_id or "",
        DETOK + "seq": "" if letter.seq is None else str(letter.seq),
        ATTEMPT_HEADER: str(attempt),
    }
    return original + [(k, v.encode("utf-8", "surrogateescape")) for k, v in error_headers.items()]


def _own_headers(
    headers: Iterable[tuple[str, bytes | None]],
) -> list[tuple[str, bytes | None]]:
    return [(k, v) for k, v in headers if not k.startswith((CONNECT, DETOK))]


def _attempt(headers: Iterable[tuple[str, bytes | None]]) -> int:
    """The redrive attempt the record carries; 0 when absent or not a count."""
    for key, value in headers:
        if key == ATTEMPT_HEADER:
            try:
                count = int(value or b"")
            except ValueError:
                return 0
            return count if 0 <= count < 2**31 else 0
    return 0


def dead_letter_key(letter: DeadLetter) -> bytes | None:
    if letter.origin is not None:
        return letter.origin.key
    return letter.request_id.encode() if letter.request_id else None


def redrive_headers(headers: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Strip this failure's error headers, keep the rest, count the attempt."""
    attempt = 0
    kept = []
    for key, value in headers:
        if key == ATTEMPT_HEADER:
            attempt = int(value or b"0")
        elif not key.startswith((CONNECT, DETOK)):
            kept.append((key, value))
    return kept + [(ATTEMPT_HEADER, str(attempt + 1).encode())]


def redrive(
    bootstrap_servers: str,
    names: TopicNames,
    *,
    reason: str | None = None,
    idle_timeout_s: float = 5.0,
) -> int:
    """Re-produce every dead letter (optionally of one reason) to the input topic, in order."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"detok-redrive-{os.getpid()}-{time.time_ns()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
        }
    )
    metadata = consumer.list_topics(names.dead_letters, timeout=30)
    partitions = metadata.topics[names.dead_letters].partitions
    consumer.assign([TopicPartition(names.dead_letters, p, 0) for p in partitions])
    at_end: set[int] = set()
    sent = 0
    last_message = time.monotonic()
    while len(at_end) < len(partitions) and time.monotonic() - last_message < idle_timeout_s:
        message = consumer.poll(0.5)
        if message is None:
            continue
        if message.error():
            if message.error().code() == KafkaError._PARTITION_EOF:
                at_end.add(message.partition())
                continue
            raise RuntimeError(f"dead-letter read failed: {message.error()}")
        last_message = time.monotonic()
        headers = message.headers() or []
        if reason is not None and (DETOK + "reason", reason.encode()) not in headers:
            continue
        producer.produce(
            names.input, message.value(), message.key(), headers=redrive_headers(headers)
        )
        producer.poll(0)
        sent += 1
    producer.flush(30)
    consumer.close()
    return sent


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dlq", help="inspect and redrive dead letters")
    actions = parser.add_subparsers(dest="dlq_action", required=True, metavar="ACTION")
    redrive_parser = actions.add_parser(
        "redrive", help="re-produce dead letters to the input topic (original key and value)"
    )
    add_bootstrap_servers(redrive_parser)
    redrive_parser.add_argument("--input-topic", default=TopicNames().input)
    redrive_parser.add_argument("--dead-letter-topic", default=TopicNames().dead_letters)
    redrive_parser.add_argument("--reason", help="only dead letters of this reason")
    redrive_parser.set_defaults(func=_cli_redrive)


def _cli_redrive(args: argparse.Namespace) -> int:
    names = TopicNames(input=args.input_topic, dead_letters=args.dead_letter_topic)
    sent = redrive(args.bootstrap_servers, names, reason=args.reason)
    print(f"redriven {sent} dead letters to {names.input}")
    return 0
