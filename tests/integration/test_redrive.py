"""`detok dlq redrive` (issue 16 #7, #8, #17): it checks delivery, redrives only what was dead
when it started (so it ends while workers run), and a garbled attempt header stops nothing."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.test_replay import detok
from tests.integration.worker_harness import pipeline_topics, read_topic, start_worker, stop
from workers.kafka.clients import UndeliveredRecords
from workers.kafka.dead_letters import ATTEMPT_HEADER, redrive
from workers.kafka.topic_names import TopicNames

pytestmark = pytest.mark.integration


def test_a_non_integer_attempt_header_counts_as_attempt_zero(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    names = TopicNames(input=create_topic("in"), dead_letters=create_topic("dlq"))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(names.dead_letters, b"first", b"a", headers=[(ATTEMPT_HEADER, b"2")])
    producer.produce(names.dead_letters, b"forged", b"b", headers=[(ATTEMPT_HEADER, b"x\xff")])
    producer.produce(names.dead_letters, b"last", b"c", headers=[(ATTEMPT_HEADER, b"-3")])
    assert producer.flush(WAIT_BOUND_S) == 0

    assert redrive(kafka_bootstrap, names) == 3
    redriven = [
        (value, dict(headers)) for _, value, headers in read_topic(kafka_bootstrap, names.input)
    ]
    assert [(value, headers[ATTEMPT_HEADER]) for value, headers in redriven] == [
        (b"first", b"3"), (b"forged", b"1"), (b"last", b"1"),
    ]  # fmt: skip


def test_redrive_to_a_missing_input_topic_says_so(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    dead_letters = create_topic("dlq")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(dead_letters, b"letter", b"k")
    assert producer.flush(WAIT_BOUND_S) == 0
    result = detok("dlq", "redrive", "--dead-letter-topic", dead_letters,
                   "--input-topic", unique_name("absent"), bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert "redriven" not in result.stdout


def test_redrive_while_a_worker_runs_ends_after_what_was_dead_at_its_start(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The worker dead-letters the redriven record again at once; redrive must not read that
    copy back (it used to bounce one record hundreds of times and never end)."""
    names = pipeline_topics(kafka_bootstrap, partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(names.input, b"not json", b"bad")
    assert producer.flush(WAIT_BOUND_S) == 0
    worker = start_worker(
        kafka_bootstrap, names, unique_name("g"), instance_id="redrive", log_dir=tmp_path
    )
    try:
        wait_for_records(kafka_bootstrap, names.dead_letters, 1)
        try:
            result = detok("dlq", "redrive", "--input-topic", names.input,
                           "--dead-letter-topic", names.dead_letters,
                           bootstrap=kafka_bootstrap)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("detok dlq redrive did not end while the worker ran")
        assert result.returncode == 0, result.stderr
        assert f"redriven 1 dead letters to {names.input}" in result.stdout
        letters = wait_for_records(kafka_bootstrap, names.dead_letters, 2)
    finally:
        assert stop(worker) == 0
    assert [dict(headers)[ATTEMPT_HEADER] for _, _, headers in letters] == [b"0", b"1"]


def wait_for_records(bootstrap: str, topic: str, count: int) -> list[tuple]:
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        records = list(read_topic(bootstrap, topic))
        if len(records) >= count:
            return records
        if time.monotonic() > deadline:
            pytest.fail(f"{topic} did not reach {count} records: {json.dumps(len(records))}")
        time.sleep(0.5)


def test_a_dead_letter_over_the_input_limit_is_counted_and_the_rest_redriven(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    names = TopicNames(
        input=create_topic("small-in", config={"max.message.bytes": "20000"}),
        dead_letters=create_topic("dlq"),
    )
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for value in (b"small-1", b"x" * 50_000, b"small-2"):
        producer.produce(names.dead_letters, value, b"k")
    assert producer.flush(WAIT_BOUND_S) == 0
    with pytest.raises(UndeliveredRecords) as error:
        redrive(kafka_bootstrap, names)
    assert (error.value.report.delivered, error.value.report.failed) == (
        2, {"MSG_SIZE_TOO_LARGE": 1},
    )  # fmt: skip
    assert [value for _, value, _ in read_topic(kafka_bootstrap, names.input)] == [
        b"small-1", b"small-2",
    ]  # fmt: skip
