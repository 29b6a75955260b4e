"""`detok dlq redrive`: dead letters go back to the input with their original bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import pipeline_topics, read_topic, start_worker, wait_exit
from workers.kafka.dead_letters import redrive

pytestmark = pytest.mark.integration


def test_redriven_dead_letters_keep_their_bytes_and_count_attempts(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    orphan = json.dumps({"type": "tokens", "request_id": "o", "seq": 1, "token_ids": [1]}).encode()
    garbage = b"not json at all"
    producer.produce(names.input, orphan, b"o", headers=[("origin", b"upstream")])
    producer.produce(names.input, garbage, b"g")
    assert producer.flush(WAIT_BOUND_S) == 0

    group = unique_name("g")  # the second run resumes where the first committed

    def run_worker() -> None:
        worker = start_worker(
            kafka_bootstrap,
            names,
            group,
            instance_id="dlq",
            extra=["--exit-when-idle", "3"],
            log_dir=tmp_path,
        )
        assert wait_exit(worker) == 0

    run_worker()
    assert redrive(kafka_bootstrap, names, reason="missing_prompt") == 1
    records = [(k, v, dict(h)) for k, v, h in read_topic(kafka_bootstrap, names.input)]
    redriven = [r for r in records if "__detok.errors.attempt" in r[2]]
    assert [(k, v) for k, v, _ in redriven] == [(b"o", orphan)]
    assert redriven[0][2]["origin"] == b"upstream"
    assert redriven[0][2]["__detok.errors.attempt"] == b"1"
    assert not any(key.startswith("__connect.") for key in redriven[0][2])

    run_worker()  # it fails again, and its dead letter says this was attempt 1
    letters = [(v, dict(h)) for _, v, h in read_topic(kafka_bootstrap, names.dead_letters)]
    attempts = sorted((v, h["__detok.errors.attempt"]) for v, h in letters)
    assert attempts == [(garbage, b"0"), (orphan, b"0"), (orphan, b"1")]
