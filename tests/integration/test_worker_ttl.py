"""The request TTL against a backlog (issue 16 item 9): a worker that was away longer than the
TTL does not expire restored requests whose next events are waiting in its input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    completions_on,
    pipeline_topics,
    read_topic,
    start_worker,
    wait_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 100
TTL_S = 15
GPT2_PROMPT = [15496, 995]


def produce(bootstrap: str, topic: str, events: list[dict], timestamp_ms: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random"})
    for event in events:
        producer.produce(
            topic,
            json.dumps(event).encode(),
            event["request_id"].encode(),
            timestamp=timestamp_ms,
        )
    assert producer.flush(WAIT_BOUND_S) == 0


def test_a_backlog_older_than_the_ttl_does_not_expire_its_requests(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    group = unique_name("g")
    ids = [f"r{i:03d}" for i in range(REQUESTS)]
    started_ms = int(time.time() * 1000)
    first_half = [
        event
        for request_id in ids
        for event in (
            {"type": "prompt", "request_id": request_id, "model": "gpt2",
             "prompt_token_ids": GPT2_PROMPT},
            {"type": "tokens", "request_id": request_id, "seq": 1, "token_ids": [11]},
        )
    ]  # fmt: skip
    produce(kafka_bootstrap, names.input, first_half, started_ms)
    ttl = ["--request-ttl", str(TTL_S)]
    first = start_worker(
        kafka_bootstrap,
        names,
        group,
        instance_id="ttl",
        extra=[*ttl, "--exit-when-idle", "2"],
        log_dir=tmp_path,
    )
    assert wait_exit(first) == 0
    # The rest of every request, generated a second after the first half (its record time),
    # reaches a worker only after an outage longer than the TTL.
    second_half = [
        event
        for request_id in ids
        for event in (
            {"type": "tokens", "request_id": request_id, "seq": 2, "token_ids": [11]},
            {"type": "finish", "request_id": request_id, "seq": 3},
        )
    ]
    produce(kafka_bootstrap, names.input, second_half, started_ms + 1000)
    time.sleep(TTL_S + 2)
    # Small batches: the backlog takes many loop turns, and TTL sweeps run between them.
    second = start_worker(
        kafka_bootstrap,
        names,
        group,
        instance_id="ttl",
        extra=[*ttl, "--exit-when-idle", "3", "--max-batch", "10"],
        log_dir=tmp_path,
    )
    assert wait_exit(second) == 0

    completions = completions_on(kafka_bootstrap, names)
    statuses = [completions[request_id]["status"] for request_id in ids]
    assert statuses == ["ok"] * REQUESTS
    expired = [h for _, _, h in read_topic(kafka_bootstrap, names.dead_letters)]
    assert expired == []
