"""A worker that cannot start says why and exits non-zero, within a bound (issue 16 items 2, 5,
16): no broker, a missing topic, a dead-letter topic too small for what the input accepts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.integration.conftest import WAIT_BOUND_S, free_port_pair, unique_name
from tests.integration.worker_harness import pipeline_topics, start_worker, wait_exit
from workers.kafka.clients import KafkaConnection
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import OUTPUT_MAX_MESSAGE_BYTES, ensure_topics
from workers.runtime.changelog import RestoreInterrupted, read_latest
from workers.runtime.output_limits import read_output_limits

pytestmark = pytest.mark.integration


def worker_log(log_dir: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(log_dir.glob("worker-*.log")))


@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_no_broker_at_start_is_a_clear_error_not_a_hang(tmp_path: Path, guarantee: str) -> None:
    nothing_listens = f"127.0.0.1:{free_port_pair()}"
    worker = start_worker(
        nothing_listens,
        TopicNames.with_prefix(unique_name("wt")),
        unique_name("g"),
        instance_id="nobroker",
        extra=["--guarantee", guarantee, "--exit-when-idle", "1", "--startup-timeout", "3"],
        log_dir=tmp_path,
    )
    assert wait_exit(worker) == 1
    log = worker_log(tmp_path)
    assert f"Kafka at {nothing_listens} did not answer within 3 s" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("role", ["input", "changelog"])
def test_a_missing_topic_is_named_and_the_worker_exits(
    kafka_bootstrap: str, tmp_path: Path, role: str
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    missing = getattr(names, role)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([missing])[missing].result(timeout=WAIT_BOUND_S)
    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="notopic",
        extra=["--exit-when-idle", "1"],
        log_dir=tmp_path,
    )
    assert wait_exit(worker) == 1
    log = worker_log(tmp_path)
    assert f"topic {missing} is not usable" in log and "detok topics ensure" in log
    assert "Traceback" not in log


def test_topics_created_a_moment_after_the_worker_asks_are_read_not_called_missing(
    kafka_bootstrap: str,
) -> None:
    """A broker of a cluster learns of a new topic a moment after `detok topics ensure` returns
    (a CI run saw UNKNOWN_TOPIC_OR_PART from a broker restarted seconds before): the worker asks
    again for a few seconds before calling a topic missing. Here the topics appear after 1 s."""
    names = TopicNames.with_prefix(unique_name("wt"))
    creator = threading.Timer(1.0, ensure_topics, (kafka_bootstrap, names, 1))
    creator.start()
    try:
        limits = read_output_limits(
            KafkaConnection(kafka_bootstrap), names, WAIT_BOUND_S, lambda: False
        )
    finally:
        creator.join()
    assert set(limits.limits) == set(names.model_dump().values())
    assert limits.limits[names.deltas] == OUTPUT_MAX_MESSAGE_BYTES


def test_a_dead_letter_topic_smaller_than_the_input_allows_is_refused(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Issue 16 item 2: a large bad input record could not be dead-lettered whole."""
    names = TopicNames.with_prefix(unique_name("wt"))
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # Every topic at the broker's default limit (`detok topics ensure` would raise them).
    created = admin.create_topics([NewTopic(t, 1, 1) for t in names.model_dump().values()])
    for future in created.values():
        future.result(timeout=WAIT_BOUND_S)
    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="smalldlq",
        extra=["--exit-when-idle", "1"],
        log_dir=tmp_path,
    )
    assert wait_exit(worker) == 1
    log = worker_log(tmp_path)
    assert f"dead-letter topic {names.dead_letters} accepts records up to" in log
    assert "max.message.bytes" in log and "Traceback" not in log


def test_a_stop_request_ends_a_restore() -> None:
    """Issue 16 item 5: the restore loop waited for an end of partition and ignored SIGTERM.

    The end never comes because no broker answers (a partition the changelog does not have no
    longer waits: it stops the worker, test_partition_growth.py)."""
    names = TopicNames.with_prefix(unique_name("wt"))
    nothing_listens = f"127.0.0.1:{free_port_pair()}"
    asked: list[bool] = []

    def stop_requested() -> bool:
        asked.append(True)
        return len(asked) > 1  # the stop arrives while the restore is under way

    with pytest.raises(RestoreInterrupted):
        read_latest(
            KafkaConnection(nothing_listens),
            unique_name("g"),
            names.changelog,
            [0],
            stop_requested,
        )
