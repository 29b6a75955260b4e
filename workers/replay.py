"""`detok replay` and `detok collect`: logged generations onto Kafka, completions back off it.

Replay cuts every logged generation into the events an inference server would have sent (the same
cut as `detok run`), interleaves requests the way concurrent generations interleave, and produces
them keyed by request id with Java's murmur2 partitioner. Collect reads the completions topic
(read_committed) into the JSONL format of `detok run`, so the two can be compared line for line.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from tqdm import tqdm

from pipeline.generations import DEFAULT_CHUNK_SIZE, generation_events
from schemas.events import Completion, LoggedGeneration
from schemas.fast_events import encode_event
from schemas.validation import Rejection, parse_model
from workers.kafka_options import add_bootstrap_servers
from workers.topics import TopicNames

# Requests in flight at once while replaying; like `detok run`'s window, so per-partition event
# order looks like a server streaming this many generations concurrently.
REPLAY_WINDOW = 256


@dataclass
class ReplayTotals:
    requests: int = 0
    events: int = 0
    generated_tokens: int = 0
    invalid_lines: int = 0


def replay_events(lines: Iterator[bytes], chunk_size: int) -> Iterator[tuple[bytes | None, bytes]]:
    """(key, value) records for a stream of JSONL lines; invalid lines pass through unkeyed, so
    the worker dead-letters them exactly as it would a broken producer's record."""
    window: list[list[tuple[bytes | None, bytes]]] = []
    for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            continue
        parsed = parse_model(LoggedGeneration, line)
        if isinstance(parsed, Rejection):
            window.append([(None, line)])
        else:
            key = parsed.request_id.encode()
            window.append([(key, encode_event(e)) for e in generation_events(parsed, chunk_size)])
        if len(window) == REPLAY_WINDOW:
            yield from _interleave(window)
            window = []
    yield from _interleave(window)


def _interleave(
    window: list[list[tuple[bytes | None, bytes]]],
) -> Iterator[tuple[bytes | None, bytes]]:
    for round_records in zip_longest(*window):
        yield from (record for record in round_records if record is not None)


def replay(
    bootstrap_servers: str,
    input_path: Path,
    topic: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    rate: float | None = None,
    progress: bool = True,
) -> ReplayTotals:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
        }
    )
    totals = ReplayTotals()
    started = time.monotonic()
    with input_path.open("rb") as source:
        bar = tqdm(desc="replay", unit="ev", file=sys.stderr, disable=not progress)
        for key, value in replay_events(iter(source), chunk_size):
            while True:
                try:
                    producer.produce(topic, value, key)
                    break
                except BufferError:
                    producer.poll(0.05)
            totals.events += 1
            if key is None:
                totals.invalid_lines += 1
            elif value.startswith(b'{"type":"prompt"'):
                totals.requests += 1
            if rate is not None:
                # Sleep off any lead over the schedule `rate` events per second sets.
                lead = totals.events / rate - (time.monotonic() - started)
                if lead > 0:
                    time.sleep(lead)
            if totals.events % 1000 == 0:
                producer.poll(0)
                bar.update(1000)
        bar.update(totals.events % 1000)
        bar.close()
    remaining = producer.flush(60)
    if remaining:
        raise RuntimeError(f"{remaining} events not delivered")
    return totals


def collect(
    bootstrap_servers: str,
    topic: str,
    *,
    expect: int | None = None,
    idle_timeout_s: float = 10.0,
) -> dict[str, Completion]:
    """Latest completion per request id, read_committed, until `expect` or idle."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"detok-collect-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    metadata = consumer.list_topics(topic, timeout=30)
    partitions = metadata.topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    completions: dict[str, Completion] = {}
    last_new = time.monotonic()
    try:
        while time.monotonic() - last_new < idle_timeout_s:
            if expect is not None and len(completions) >= expect:
                break
            for message in consumer.consume(1000, 0.2):
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"collect failed: {message.error()}")
                completion = Completion.model_validate_json(message.value())
                completions[completion.request_id] = completion
                last_new = time.monotonic()
    finally:
        consumer.close()
    return completions


def add_command(subparsers: argparse._SubParsersAction) -> None:
    replay_parser = subparsers.add_parser(
        "replay", help="produce logged generations (detok run input) as events to the input topic"
    )
    add_bootstrap_servers(replay_parser)
    replay_parser.add_argument("--input", required=True, type=Path)
    replay_parser.add_argument("--topic", default=TopicNames().input)
    replay_parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    replay_parser.add_argument(
        "--rate", type=float, help="events per second (default: as fast as possible)"
    )
    replay_parser.set_defaults(func=_cli_replay)

    collect_parser = subparsers.add_parser(
        "collect", help="read completions into JSONL (the format of detok run), by request id"
    )
    add_bootstrap_servers(collect_parser)
    collect_parser.add_argument("--output", required=True, type=Path)
    collect_parser.add_argument("--topic", default=TopicNames().completions)
    collect_parser.add_argument("--expect", type=int, help="stop after this many completions")
    collect_parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="stop after this many seconds without a new completion",
    )
    collect_parser.set_defaults(func=_cli_collect)


def _cli_replay(args: argparse.Namespace) -> int:
    totals = replay(
        args.bootstrap_servers,
        args.input,
        args.topic,
        chunk_size=args.chunk_size,
        rate=args.rate,
        progress=sys.stderr.isatty(),
    )
    print(
        f"replayed {totals.requests} requests as {totals.events} events "
        f"({totals.invalid_lines} invalid lines passed through) to {args.topic}"
    )
    return 0


def _cli_collect(args: argparse.Namespace) -> int:
    completions = collect(
        args.bootstrap_servers, args.topic, expect=args.expect, idle_timeout_s=args.timeout
    )
    write_completions(args.output, completions)
    print(f"collected {len(completions)} completions -> {args.output}")
    if args.expect is not None and len(completions) < args.expect:
        print(f"detok collect: expected {args.expect}", file=sys.stderr)
        return 1
    return 0


def write_completions(path: Path, completions: dict[str, Completion]) -> None:
    with path.open("w", encoding="utf-8") as output:
        for request_id in sorted(completions):
            output.write(completions[request_id].model_dump_json() + "\n")
