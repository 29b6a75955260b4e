"""Issue 16 items 5 and 16: missing topics and a missing broker end in a clear stop, not a hang.

Every wait of the worker must be bounded and interruptible: a worker that cannot do its job
either exits non-zero saying why (naming the topic or the broker), or keeps waiting while still
obeying SIGTERM within a container's grace period. The bounds below are hang detectors (how long
the test waits before calling it a hang), not speed measurements.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.conftest import WAIT_BOUND_S, free_port_pair, unique_name
from tests.integration.poison_harness import (
    Pipeline,
    Record,
    WorkerProcess,
    generation_records,
    new_pipeline,
    produce,
    prompt,
    started_worker,
    tokens,
    wait_for_keys,
)
from tests.integration.worker_harness import make_generations
from workers.kafka.topics import TopicNames
from workers.local import broker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A worker that cannot reach a topic or a broker must have said so and stopped by then.
GIVE_UP_BOUND_S = 60.0
# A container's grace period after SIGTERM is typically 30 s before SIGKILL.
SIGTERM_BOUND_S = 30.0
# The worker's give-up bound for a broker it cannot reach at start (`--startup-timeout`, 30 s by
# default): the no-broker tests are about what it does then, not about the default's length.
STARTUP_TIMEOUT = ["--startup-timeout", "5"]
OUTAGE_TTL_S = 8  # past the ~1 s to see the snapshots and the broker's ~2 s controlled shutdown


def _delete_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(timeout=WAIT_BOUND_S)
    deadline = time.monotonic() + WAIT_BOUND_S
    while topic in admin.list_topics(timeout=WAIT_BOUND_S).topics:
        if time.monotonic() > deadline:
            pytest.fail(f"{topic} still listed after deletion")
        time.sleep(0.5)


def _stops_or_obeys_sigterm(worker: WorkerProcess, topic: str) -> None:
    """Either exit non-zero within GIVE_UP_BOUND_S naming `topic`, or (still waiting) say what
    it waits for and exit within SIGTERM_BOUND_S of a SIGTERM."""
    code = worker.wait(GIVE_UP_BOUND_S)
    if code is not None:
        assert code != 0, f"exit 0 without its {topic}:\n{worker.tail()}"
    else:
        worker.terminate()
        code = worker.wait(SIGTERM_BOUND_S)
        assert code is not None, (
            f"waiting for {topic}, the worker ignored SIGTERM for {SIGTERM_BOUND_S:.0f} s:\n"
            f"{worker.tail()}"
        )
    assert topic in worker.output(), f"nothing in the worker's output names {topic}"


def test_item5_missing_changelog_topic_is_reported_and_sigterm_still_works(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    produce(kafka_bootstrap, pipeline.names.input, generation_records(make_generations(5)))
    _delete_topic(kafka_bootstrap, pipeline.names.changelog)
    with started_worker(pipeline, "--exit-when-idle", "2") as worker:
        _stops_or_obeys_sigterm(worker, pipeline.names.changelog)


def test_item5_missing_input_topic_with_exit_when_idle_exits_non_zero(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    _delete_topic(kafka_bootstrap, pipeline.names.input)
    with started_worker(pipeline, "--exit-when-idle", "2") as worker:
        code = worker.wait(GIVE_UP_BOUND_S)
        assert code is not None, (
            f"no input topic, --exit-when-idle 2: still running after {GIVE_UP_BOUND_S:.0f} s"
        )
        assert code != 0, worker.tail()
        assert pipeline.names.input in worker.output(), worker.tail()


def _unreachable_pipeline(tmp_path: Path) -> tuple[Pipeline, str]:
    """Topic names, and a bootstrap address on which nothing listens."""
    address = f"{broker.LOOPBACK}:{free_port_pair()}"
    names = TopicNames.with_prefix(unique_name("nobroker"))
    return Pipeline(address, names, unique_name("g"), tmp_path), address


@pytest.mark.parametrize(
    "guarantee_args",
    [[], ["--guarantee", "at-least-once", "--exit-when-idle", "2"]],
    ids=["exactly-once", "at-least-once-exit-when-idle"],
)
def test_item16_no_broker_at_start_exits_non_zero_with_a_message_not_a_traceback(
    tmp_path: Path, guarantee_args: list[str]
) -> None:
    pipeline, address = _unreachable_pipeline(tmp_path)
    with started_worker(pipeline, *guarantee_args, *STARTUP_TIMEOUT) as worker:
        code = worker.wait(GIVE_UP_BOUND_S)
        assert code is not None, (
            f"no broker at {address}: still running after {GIVE_UP_BOUND_S:.0f} s:\n"
            f"{worker.tail(10)}"
        )
        assert code != 0
        assert "Traceback" not in worker.stderr(), worker.tail()
        assert address in worker.output(), "the message does not say which broker it tried"


def test_item16_sigterm_during_a_broker_outage_exits_within_the_grace_period(
    tmp_path: Path,
) -> None:
    """A worker of our own broker holds open requests; the broker goes away and the requests'
    TTL ends, so the worker has outputs it cannot commit; SIGTERM must still end it within a
    container's grace period (non-zero is fine: its last commit failed)."""
    data_dir = tmp_path / "kafka"
    running = broker.start_broker(port=free_port_pair(), data_dir=data_dir)
    try:
        pipeline = new_pipeline(running.bootstrap_servers, tmp_path)
        generations = make_generations(40, seed=1616)
        produce(running.bootstrap_servers, pipeline.names.input, generation_records(generations))
        with started_worker(pipeline, "--request-ttl", str(OUTAGE_TTL_S)) as worker:
            keys = {g["request_id"].encode() for g in generations}
            wait_for_keys(running.bootstrap_servers, pipeline.names.completions, keys)
            # Open requests: the worker holds their state, and their TTL ends during the
            # outage, so it has outputs to commit when the SIGTERM comes.
            open_keys = {f"open-{i}".encode() for i in range(40)}
            produce(
                running.bootstrap_servers,
                pipeline.names.input,
                [
                    Record(key, value)
                    for key in open_keys
                    for value in (
                        prompt(key.decode(), "gpt2", [15496, 995]),
                        tokens(key.decode(), 1, [11, 995]),
                    )
                ],
            )
            wait_for_keys(running.bootstrap_servers, pipeline.names.changelog, open_keys)
            broker.stop_broker(data_dir)
            time.sleep(OUTAGE_TTL_S + 3)  # the open requests expire: a commit is now pending
            worker.terminate()
            code = worker.wait(SIGTERM_BOUND_S)
            assert code is not None, (
                f"SIGTERM with the broker gone: still running after {SIGTERM_BOUND_S:.0f} s:\n"
                f"{worker.tail(10)}"
            )
    finally:
        broker.stop_broker(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def test_item16_deleted_output_topic_is_named_not_reported_as_fencing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The completions topic disappears under a running worker: whatever it then does, what it
    says must name that topic, and never blame a newer instance (nobody fenced it)."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    first, second = make_generations(40, seed=1618)[:20], make_generations(40, seed=1618)[20:]
    produce(kafka_bootstrap, pipeline.names.input, generation_records(first))
    with started_worker(pipeline) as worker:
        keys = {g["request_id"].encode() for g in first}
        wait_for_keys(kafka_bootstrap, pipeline.names.completions, keys)
        _delete_topic(kafka_bootstrap, pipeline.names.completions)
        produce(kafka_bootstrap, pipeline.names.input, generation_records(second))
        _stops_or_obeys_sigterm(worker, pipeline.names.completions)
        assert "fenced" not in worker.output().lower(), worker.tail(10)
