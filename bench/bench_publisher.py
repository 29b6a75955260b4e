"""The engines' publisher: generated ids per second from one Python thread, and records per id.

Issue 31 item 1 targets at least 1M generated ids/s from one thread into a local broker with
the default linger. The workload is an engine's: `--requests` requests run together, each engine
step gives every running request one new id, until each has `--tokens` ids; then all finish.
Rows, each into a fresh topic, timed from the first open to `close()` returning (every record
acknowledged), wall clock and this process's CPU:

  step      `Publisher.append_many` once per engine step (one lock per step), default linger
  append    `Publisher.append` once per request per step (one lock per id), default linger
  threads   `append` as above from 4 threads sharing the publisher, each with a quarter of
            the requests: the one lock under contention (the GIL serialises Python anyway)
  baseline  one record per id, produced as `detok replay` produced before the publisher
            (encode the tokens event, `produce` with a delivery callback): the plain
            one-record-per-chunk producer an engine would write without it

Figures are medians of `--repeats` (rows in rotating order); ratios are against the baseline.
`ids/CPU s` is the rate the thread's own CPU allows (1 / CPU per id): on a shared host the wall
rate also counts the time the broker and other processes hold the cores. No timing is asserted
anywhere.

    detok broker start   # or any broker: --bootstrap-servers / $KAFKA_BOOTSTRAP_SERVERS
    python -m bench.bench_publisher [--requests 256] [--tokens 4000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, Message

from schemas.fast_events import ParsedFinish, ParsedPrompt, ParsedTokens, encode_event
from workers.commands.options import add_connection_options, connection_from
from workers.io.publish import DEFAULT_LINGER_S, Publisher
from workers.io.publish.publisher import PUBLISHER_PRODUCER_SETTINGS
from workers.kafka.clients import KafkaConnection, make_producer, produce
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import ensure_topics

TARGET_IDS_PER_S = 1_000_000
THREADS = 4
PROMPT = list(range(1000, 1200))


def run_step(publisher: Publisher, requests: int, tokens: int) -> None:
    ids = [f"r{i}" for i in range(requests)]
    with publisher:
        for request_id in ids:
            publisher.open(request_id, "gpt2", PROMPT)
        for step in range(tokens):
            token = [step % 50_000]
            publisher.append_many([(request_id, token) for request_id in ids])
        for request_id in ids:
            publisher.finish(request_id, "length")


def run_append(publisher: Publisher, requests: int, tokens: int) -> None:
    with publisher:
        append_per_id(publisher, [f"r{i}" for i in range(requests)], tokens)


def append_per_id(publisher: Publisher, ids: list[str], tokens: int) -> None:
    """Open `ids`, one `append` call per request per step, finish them."""
    append = publisher.append
    for request_id in ids:
        publisher.open(request_id, "gpt2", PROMPT)
    for step in range(tokens):
        token = [step % 50_000]
        for request_id in ids:
            append(request_id, token)
    for request_id in ids:
        publisher.finish(request_id, "length")


def run_threads(publisher: Publisher, requests: int, tokens: int) -> None:
    """`append` rows of THREADS engine threads sharing the publisher (and its one lock), each
    with its share of the requests: what the lock costs under contention."""
    shares = [[f"r{i}" for i in range(t, requests, THREADS)] for t in range(THREADS)]
    with publisher:
        threads = [
            threading.Thread(target=append_per_id, args=(publisher, share, tokens))
            for share in shares
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def run_baseline(connection: KafkaConnection, topic: str, requests: int, tokens: int) -> int:
    """One record per id, as replay produced before the publisher (its settings, lz4)."""
    producer = make_producer(connection, {**PUBLISHER_PRODUCER_SETTINGS})
    failed: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            failed.append(error)

    def send(request_id: str, value: bytes) -> None:
        produce(producer, topic, value, key=request_id.encode(), on_delivery=on_delivery)

    ids = [f"r{i}" for i in range(requests)]
    for request_id in ids:
        send(request_id, encode_event(ParsedPrompt(request_id=request_id, model="gpt2",
                                                   prompt_token_ids=PROMPT)))  # fmt: skip
    for step in range(tokens):
        token = [step % 50_000]
        for request_id in ids:
            send(request_id, encode_event(ParsedTokens(request_id=request_id, seq=step + 1,
                                                       token_ids=token)))  # fmt: skip
        producer.poll(0)
    for request_id in ids:
        send(request_id, encode_event(ParsedFinish(request_id=request_id, seq=tokens + 1)))
    if producer.flush(120) or failed:
        raise RuntimeError(f"baseline: records not delivered ({len(failed)} failed)")
    return requests * (tokens + 2)


PUBLISHER_ROWS: dict[str, Callable[[Publisher, int, int], None]] = {
    "step": run_step,
    "append": run_append,
    "threads": run_threads,
}
ROWS = (*PUBLISHER_ROWS, "baseline")


def timed_row(
    connection: KafkaConnection, topic: str, row: str, requests: int, tokens: int
) -> tuple[float, float, int]:
    """(wall s, CPU s, records) of one row; the clients are made (metadata, topic limit)
    before the clock starts, as an engine makes them once."""
    if row == "baseline":
        wall, cpu = time.perf_counter(), time.process_time()
        records = run_baseline(connection, topic, requests, tokens)
    else:
        publisher = Publisher(connection, topic)
        wall, cpu = time.perf_counter(), time.process_time()
        PUBLISHER_ROWS[row](publisher, requests, tokens)
        records = publisher.records_sent
    return time.perf_counter() - wall, time.process_time() - cpu, records


def measure(
    connection: KafkaConnection, row: str, requests: int, tokens: int, partitions: int
) -> dict[str, float]:
    names = TopicNames.with_prefix(f"bench-pub-{uuid.uuid4().hex[:8]}")
    ensure_topics(connection, names, partitions)
    wall, cpu, records = timed_row(connection, names.input, row, requests, tokens)
    generated = requests * tokens
    return {
        "ids_per_s": generated / wall,
        "cpu_us_per_id": cpu / generated * 1e6,
        "records_per_id": records / generated,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_connection_options(parser)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4000, help="ids per request")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    connection = connection_from(args)
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    order = list(ROWS)
    for repeat in range(args.repeats):
        for row in order[repeat % len(order) :] + order[: repeat % len(order)]:
            runs[row].append(measure(connection, row, args.requests, args.tokens, args.partitions))
    figures: dict[str, Any] = {
        row: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for row, results in runs.items()
    }
    base = figures["baseline"]["ids_per_s"]
    for row in ROWS:
        figures[row]["vs_baseline"] = figures[row]["ids_per_s"] / base
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    linger_ms = DEFAULT_LINGER_S * 1000
    print(f"{args.requests} requests x {args.tokens} ids, linger {linger_ms:.0f} ms, median of "
          f"{args.repeats} (target {TARGET_IDS_PER_S:,} ids/s from one thread)")  # fmt: skip
    print(f"{'row':<9} {'ids/s':>12} {'CPU us/id':>10} {'ids/CPU s':>12} {'records/id':>11} "
          f"{'vs baseline':>12}")  # fmt: skip
    for row, f in figures.items():
        print(f"{row:<9} {f['ids_per_s']:>12,.0f} {f['cpu_us_per_id']:>10.3f} "
              f"{1e6 / f['cpu_us_per_id']:>12,.0f} {f['records_per_id']:>11.4f} "
              f"{f['vs_baseline']:>11.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
