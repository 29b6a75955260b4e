"""Issue 32 item 4: an input topic grown past its changelog is refused, never waited on.

The state of input partition p lives in changelog partition p. With the input grown from 2 to 4
partitions (`kafka-topics --alter`) and the changelog left at 2, the restore of partitions 2 and
3 waited for changelog partitions that do not exist, forever: the worker handled nothing and
ignored `--exit-when-idle` and its start-up timeout. A worker now exits 1 naming both counts and
the fix, at start and when a running worker is assigned the new partitions; `detok topics
ensure` grows the changelog (and the outputs) to the input's count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions

from tests.conftest import REPO_ROOT
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import pipeline_topics, start_worker, topic_args
from workers.kafka.topic_names import TopicNames

pytestmark = pytest.mark.integration

# How long a worker may take to refuse: loading two tokenizers and a restore on a loaded host take
# seconds; the hang this replaces never ended.
REFUSAL_BOUND_S = 60.0


def grow(bootstrap: str, topic: str, partitions: int) -> None:
    """What `kafka-topics --alter --partitions N` does, waited for until the topic lists them."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(timeout=WAIT_BOUND_S)
    deadline = time.monotonic() + WAIT_BOUND_S
    while partition_count(bootstrap, topic) != partitions:
        if time.monotonic() > deadline:
            pytest.fail(f"{topic} did not list {partitions} partitions within the wait bound")
        time.sleep(0.1)


def partition_count(bootstrap: str, topic: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return len(admin.list_topics(topic, timeout=WAIT_BOUND_S).topics[topic].partitions)


def exit_code_within(worker: subprocess.Popen, bound_s: float, log_dir: Path) -> int:
    try:
        return worker.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
        pytest.fail(f"worker still running after {bound_s:.0f} s:\n{logs(log_dir)[-3000:]}")


def logs(log_dir: Path) -> str:
    return "\n".join(path.read_text() for path in sorted(log_dir.glob("worker-*.log")))


def wait_for_log(log_dir: Path, text: str, worker: subprocess.Popen) -> None:
    deadline = time.monotonic() + REFUSAL_BOUND_S
    while text not in logs(log_dir):
        if worker.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            worker.wait()
            pytest.fail(f"no {text!r} in the worker's log:\n{logs(log_dir)[-3000:]}")
        time.sleep(0.2)


def assert_refusal_named(log: str, names: TopicNames) -> None:
    assert f"input topic {names.input} has 4 partitions" in log, log[-3000:]
    assert f"changelog topic {names.changelog} has 2" in log, log[-3000:]
    assert "detok topics ensure --partitions 4" in log, log[-3000:]
    assert "Traceback" not in log


def test_a_changelog_with_fewer_partitions_than_the_input_is_refused_at_start(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    grow(kafka_bootstrap, names.input, 4)
    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="grown",
        extra=["--exit-when-idle", "1"],
        log_dir=tmp_path,
    )
    assert exit_code_within(worker, REFUSAL_BOUND_S, tmp_path) == 1
    assert_refusal_named(logs(tmp_path), names)


def test_an_input_grown_while_the_worker_runs_ends_it_with_the_fix_named(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The group notices the new partitions at its next metadata refresh (librdkafka's
    topic.metadata.refresh.interval.ms, 5 min by default; 1 s here, the behaviour is the point)
    and assigns them; their restore finds no changelog partition and ends the worker."""
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="growing",
        extra=["-X", "topic.metadata.refresh.interval.ms=1000"],
        log_dir=tmp_path,
    )
    wait_for_log(tmp_path, "restored 0 requests of partitions [0, 1]", worker)
    grow(kafka_bootstrap, names.input, 4)
    assert exit_code_within(worker, REFUSAL_BOUND_S, tmp_path) == 1
    assert_refusal_named(logs(tmp_path), names)


def ensure(bootstrap: str, names: TopicNames, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "topics", "ensure", *topic_args(names), *flags],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap},
        timeout=120,  # the command bounds each admin call at 30 s
        check=False,
    )


def test_topics_ensure_grows_the_input_only_to_a_count_asked_for(kafka_bootstrap: str) -> None:
    """Growing the input moves request ids to other partitions, so a plain `ensure` keeps the
    input's count (it used to refuse a pipeline of any count but 4); `--partitions` grows it, the
    changelog with it, and says what that does to requests in flight."""
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    kept = ensure(kafka_bootstrap, names)
    assert kept.returncode == 0, kept.stderr
    assert "grew" not in kept.stdout
    assert {partition_count(kafka_bootstrap, name) for _, name in names} == {2}

    grown = ensure(kafka_bootstrap, names, "--partitions", "4")
    assert grown.returncode == 0, grown.stderr
    assert grown.stdout.count("to 4 partitions") == len(names.all) == 7
    assert "request in flight may lose its later events" in grown.stderr
    assert {partition_count(kafka_bootstrap, name) for _, name in names} == {4}


def test_topics_ensure_grows_the_changelog_and_outputs_with_the_input(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    grow(kafka_bootstrap, names.input, 4)
    ensured = ensure(kafka_bootstrap, names)
    assert ensured.returncode == 0, ensured.stderr
    assert f"grew      {names.changelog} to 4 partitions" in ensured.stdout
    assert {role: partition_count(kafka_bootstrap, name) for role, name in names} == dict.fromkeys(
        names.model_dump(), 4
    )
    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="regrown",
        extra=["--exit-when-idle", "1"],
        log_dir=tmp_path,
    )
    assert exit_code_within(worker, REFUSAL_BOUND_S, tmp_path) == 0, logs(tmp_path)[-3000:]
    assert "restored 0 requests of partitions [0, 1, 2, 3]" in logs(tmp_path)
