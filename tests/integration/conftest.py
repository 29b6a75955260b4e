"""The Kafka broker under test, shared by the whole integration session.

Where it comes from, in order:
1. `KAFKA_BOOTSTRAP_SERVERS` if set: someone already runs a broker (CI job, developer's cluster).
2. A testcontainers Kafka container (KRaft) if a Docker engine answers.
3. The local broker of `workers.local.broker` (Apache Kafka from Maven Central jars), started on a
   free port pair with a fresh data directory under `.kafka-local/`, and stopped at session end.

One broker per session: starting one costs seconds, and tests isolate themselves with unique topic
and group names instead. Under pytest-xdist (`make test`) each xdist worker process is a session
of its own, so each starts its own broker on its own ports and data directory. With no broker,
tests are skipped locally and fail in CI (`CI=true`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from confluent_kafka import Consumer, Message
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import REPO_ROOT, missing_resource
from workers.local import broker

if TYPE_CHECKING:
    from tests.integration.worker_harness import PipelineRun

# Every wait in these tests polls until the awaited event happens; this bound only turns a hang
# into a failure. A healthy single-node broker delivers within a second or two, and a consumer
# group's first assignment within a few; 60 s leaves room for a
# CI machine whose cores the broker, the workers and the test share.
WAIT_BOUND_S = 60.0
# Docker's ping answers in milliseconds when an engine runs; when none does the socket is absent
# and the call fails at once. 3 s only guards against a wedged engine.
DOCKER_PING_TIMEOUT_S = 3


@dataclass(frozen=True)
class KafkaUnderTest:
    bootstrap_servers: str
    local_broker: (
        broker.RunningBroker | None
    )  # set when this session started workers.local.broker's


@pytest.fixture(scope="session")
def kafka_under_test() -> Iterator[KafkaUnderTest]:
    from_env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if from_env:
        yield KafkaUnderTest(bootstrap_servers=from_env, local_broker=None)
    elif _docker_engine_answers():
        yield from _testcontainers_kafka()
    else:
        yield from _local_broker()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_under_test: KafkaUnderTest) -> str:
    """The bootstrap address of the session's real Kafka broker."""
    return kafka_under_test.bootstrap_servers


@pytest.fixture(scope="session")
def local_broker(kafka_under_test: KafkaUnderTest) -> broker.RunningBroker:
    """The session's broker when it is `workers.local.broker`'s; tests of `detok broker` need it."""
    if kafka_under_test.local_broker is None:
        pytest.skip("the session's broker is not the local workers.local.broker one")
    return kafka_under_test.local_broker


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=DOCKER_PING_TIMEOUT_S).ping()
    except Exception:  # no client library, no socket, no engine: all mean "no Docker"
        return False
    return True


def _testcontainers_kafka() -> Iterator[KafkaUnderTest]:
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # testcontainers before the community split
        from testcontainers.kafka import KafkaContainer

    container = (
        KafkaContainer()
        .with_kraft()
        # Single node: the transaction log defaults to RF 3 / min ISR 2, which one broker lacks.
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", "1000")
    )
    with container:
        yield KafkaUnderTest(bootstrap_servers=container.get_bootstrap_server(), local_broker=None)


def _local_broker() -> Iterator[KafkaUnderTest]:
    state_root = REPO_ROOT / ".kafka-local"
    state_root.mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="pytest-", dir=state_root))
    try:
        running = broker.start_broker(port=free_port_pair(), data_dir=data_dir)
    except broker.BrokerError as error:
        shutil.rmtree(data_dir, ignore_errors=True)
        missing_resource(f"no Kafka broker: the local broker did not start: {error}")
    try:
        yield KafkaUnderTest(bootstrap_servers=running.bootstrap_servers, local_broker=running)
    finally:
        broker.stop_broker(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def free_port_pair() -> int:
    """A loopback port P with P+1 also free (the broker's client and controller ports).

    Drawn at random below the kernel's ephemeral range (`broker.free_port_block`), not from a
    bind to port 0: under pytest-xdist several sessions pick ports at once, and a port just
    handed out by the kernel (P+1 especially) may meanwhile become the local end of any
    outgoing connection, or the next session's pick.
    """
    return broker.free_port_block(2)


def unique_name(prefix: str) -> str:
    """Topic and group names unique to one test, so tests sharing the broker never interfere."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def create_topic(kafka_bootstrap: str) -> Callable[..., str]:
    """Create a uniquely named topic with `partitions` partitions and return its name."""

    def create(prefix: str, partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = unique_name(prefix)
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        future = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])[name]
        future.result(timeout=WAIT_BOUND_S)
        return name

    return create


@pytest.fixture
def pipeline_run(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Callable[..., PipelineRun]]:
    """`pipeline_run(generations, partitions=4)`: the setup every worker test shares (the
    generations file, `detok run`'s answer, topics, a group); workers started through the run
    are killed by pid at teardown if the test left them running."""
    # Imported here: the harness imports this module's WAIT_BOUND_S and unique_name.
    from tests.integration.worker_harness import new_pipeline_run

    runs: list[PipelineRun] = []

    def make(generations: list[dict], partitions: int = 4) -> PipelineRun:
        runs.append(new_pipeline_run(kafka_bootstrap, tmp_path, generations, partitions))
        return runs[-1]

    yield make
    for run in runs:
        run.stop_leftovers()


def consumer_config(bootstrap_servers: str, group_id: str, **overrides: str | int) -> dict:
    """A test consumer: reads from the start, commits only when told, notices changes fast.

    session.timeout.ms 6000 and heartbeat.interval.ms 500 make a second member's join rebalance
    the group within about a second instead of librdkafka's default 3 s heartbeat cadence.
    """
    return {
        "bootstrap.servers": bootstrap_servers,
        "group.id": group_id,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        **overrides,
    }


def poll_until(
    consumers: list[Consumer],
    done: Callable[[], bool],
    on_message: Callable[[Consumer, Message], None],
) -> None:
    """Poll every consumer in turn, handing each record (and its reader) on, until `done()`.

    Fails (it never asserts on time) if WAIT_BOUND_S passes first.
    """
    deadline = time.monotonic() + WAIT_BOUND_S
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within the {WAIT_BOUND_S:.0f} s wait bound")
        for consumer in consumers:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error():
                pytest.fail(f"consumer error: {message.error()}")
            on_message(consumer, message)
