"""Broker faults under load on a real three-node KRaft cluster (issue 12).

One cluster (`detok broker start --brokers 3`'s code) is started for the module and brought back
to all nodes up before each test. Each test replays a few thousand logged generations through two
exactly-once workers, causes its fault mid-stream (kill -9, SIGSTOP, a rolling restart, every
broker down), and checks what a reader sees: completions equal `detok run`'s, the committed
deltas tile every request's seq range exactly once, no good request was dead-lettered, and both
workers end with exit 0 without being restarted (only the killed one of the worker-kill test is):
a producer the Kafka client made unusable is replaced inside the worker.

Each test prints one line, from its own reading of the committed deltas: the longest gap between
two committed deltas, and the throughput dip (input events whose text was committed, per second:
the rate before the fault against the slowest window after it), and how many producers the
workers replaced. These are figures for the report; nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from pipeline.generations import DEFAULT_CHUNK_SIZE
from tests.conftest import REPO_ROOT, missing_resource
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    assert_deltas_cover_exactly_once,
    completions_on,
    make_generations,
    models,
    offline_completions,
    pipeline_topics,
    read_messages,
    start_worker,
    stop,
    write_jsonl,
)
from workers.formats.jsonl import jsonl_records
from workers.io.replay import replay_events
from workers.kafka.clients import DeliveryTracker, KafkaConnection, make_admin, make_producer
from workers.kafka.topics import topic_configs
from workers.local import broker
from workers.runtime.output_limits import OutputLimits, TopicsUnavailable, read_output_limits

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Under pytest-xdist the tests run in two halves of about equal length, each in one process with
# its own cluster (the module's fixture): one cluster for all of them made this module alone
# longer than the rest of the suite spread over the other processes. Run serially, one cluster
# serves both halves.
CLUSTER_A = pytest.mark.xdist_group("cluster-a")
CLUSTER_B = pytest.mark.xdist_group("cluster-b")

BROKERS = 3
# A few thousand requests: ~7,000 events, long enough at REPLAY_RATE for the fault to land
# mid-stream and for the stream to go on past it.
REQUESTS = 2000
REPLAY_RATE = 220.0  # events/s: the stream lasts ~35 s
# The fault is caused once this share of the requests has completed (the workers are
# committing steadily by then).
FAULT_AFTER_SHARE = 0.2
# Longer than the workers' 10 s session timeout and the brokers' 9 s broker session timeout:
# the group and the controller both give up on the paused member.
SIGSTOP_S = 15.0
ALL_DOWN_S = 20.0
# A broker killed mid-stream stays down this long before it is restarted (so the workers run
# on two brokers for a while, not only through the election).
DOWN_S = 10.0
# Completions of a whole run must all arrive within this bound once the replay ended: the
# workers may still be riding out the end of a fault.
COMPLETION_BOUND_S = 150.0
# The test's input producer waits this long for an acknowledgement: longer than every broker
# down for ALL_DOWN_S plus a slow restart of all three.
PRODUCER_TIMEOUT_MS = 300_000
# Throughput after a fault is counted in windows of this length: shorter ones are mostly empty or
# full, as commits come in bursts on a loaded machine.
WINDOW_S = 5.0
# What a worker logs when it replaces a producer its client made unusable
# (workers/runtime/checkpointing.py).
REPLACED_MARK = "replacing the producer ("


@pytest.fixture(scope="module")
def cluster() -> Iterator[broker.ClusterLayout]:
    state_root = REPO_ROOT / ".kafka-local"
    state_root.mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="cluster-", dir=state_root))
    try:
        layout = broker.start_cluster(
            BROKERS, port=broker.free_port_block(2 * BROKERS), data_dir=data_dir
        )
    except broker.BrokerError as error:
        shutil.rmtree(data_dir, ignore_errors=True)
        missing_resource(f"no Kafka cluster: the local cluster did not start: {error}")
    try:
        yield layout
    finally:
        for node in broker.cluster_status(data_dir, layout):
            if node.pid is not None:
                os.kill(node.pid, signal.SIGCONT)  # a SIGSTOPped node cannot shut down
        broker.stop_cluster(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def all_up(cluster: broker.ClusterLayout) -> broker.ClusterLayout:
    """The cluster with every node running and continued, whatever the last test left."""
    for node in broker.cluster_status(cluster.data_dir, cluster):
        if node.pid is not None:
            os.kill(node.pid, signal.SIGCONT)
    broker.start_cluster(BROKERS, port=cluster.port, data_dir=cluster.data_dir)
    return cluster


# -- finding the broker a fault should hit -----------------------------------------------------


def partition_leader(bootstrap: str, topic: str, partition: int) -> int:
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=30)
    return metadata.topics[topic].partitions[partition].leader


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (UTF-16 code units), as a signed 32-bit int."""
    value = 0
    encoded = text.encode("utf-16-be")
    for index in range(0, len(encoded), 2):
        value = (31 * value + int.from_bytes(encoded[index : index + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def transaction_coordinator(bootstrap: str, transactional_id: str) -> int:
    """The broker coordinating `transactional_id`: the leader of its `__transaction_state`
    partition, Utils.abs(id.hashCode()) % partitions (Kafka's TransactionStateManager)."""
    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    partitions = metadata.topics["__transaction_state"].partitions
    # Kafka's Utils.abs maps Integer.MIN_VALUE to 0 rather than overflowing.
    hashed = java_string_hash(transactional_id)
    index = (0 if hashed == -(1 << 31) else abs(hashed)) % len(partitions)
    return partitions[index].leader


def node_pid(cluster: broker.ClusterLayout, node_id: int) -> int:
    pid = broker.cluster_status(cluster.data_dir, cluster)[node_id - 1].pid
    assert pid is not None, f"node {node_id} is not running"
    return pid


# -- one run: replay, workers, a fault, checks, figures ----------------------------------------


@dataclass
class Run:
    cluster: broker.ClusterLayout
    tmp_path: Path
    group: str
    names: object
    workers: dict[str, subprocess.Popen]

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers

    def transactional_id(self, instance_id: str) -> str:
        return f"detok-{self.group}-{instance_id}"

    def start(self, instance_id: str) -> None:
        self.workers[instance_id] = start_worker(
            self.bootstrap, self.names, self.group, instance_id=instance_id, log_dir=self.tmp_path
        )


class Replayer(threading.Thread):
    """`detok replay`'s records at a pace, in the background; keeps its error for the test.

    Its own producer rather than `workers.io.replay.replay`, whose records time out after 60 s: on
    a loaded machine every broker stopped for 20 s and restarted takes longer than that, and the
    stream must survive the outage as a real producer configured for it would.
    """

    def __init__(self, bootstrap: str, source: Path, topic: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.args = (bootstrap, source, topic, rate)
        self.error: BaseException | None = None

    def run(self) -> None:
        bootstrap, source, topic, rate = self.args
        try:
            producer = make_producer(
                KafkaConnection(bootstrap),
                {"linger.ms": 20, "message.timeout.ms": PRODUCER_TIMEOUT_MS},
            )
            tracker = DeliveryTracker()
            records = jsonl_records(source.read_bytes().splitlines())
            started = time.monotonic()
            for sent, (key, value) in enumerate(replay_events(records, DEFAULT_CHUNK_SIZE)):
                tracker.produce(producer, topic, value, key=key)
                ahead = started + sent / rate - time.monotonic()
                producer.poll(max(ahead, 0.0))
            tracker.settle(producer, PRODUCER_TIMEOUT_MS / 1000)
        except BaseException as error:  # reported by the test, not lost in the thread
            self.error = error


def run_with_fault(
    cluster: broker.ClusterLayout,
    tmp_path: Path,
    fault: Callable[[Run], None],
    label: str,
    seed: int,
) -> None:
    source = write_jsonl(tmp_path / "generations.jsonl", make_generations(REQUESTS, seed=seed))
    expected = offline_completions(source, models().registry())
    names = pipeline_topics(cluster.bootstrap_servers)
    run = Run(cluster, tmp_path, unique_name("g"), names, {})
    for instance_id in ("w0", "w1"):
        run.start(instance_id)
    # The stream starts once both workers hold partitions: a worker takes seconds to load its
    # tokenizers, and a stream replayed meanwhile would be a backlog drained before the fault.
    wait_until_both_restored(run)
    replayer = Replayer(cluster.bootstrap_servers, source, names.input, REPLAY_RATE)
    replayer.start()
    try:
        wait_for_completions(run, int(len(expected) * FAULT_AFTER_SHARE), WAIT_BOUND_S * 2)
        fault_at = time.time()
        fault(run)
        fault_s = time.time() - fault_at  # until the fault's brokers were back
        replayer.join(COMPLETION_BOUND_S)
        assert not replayer.is_alive(), "the replay did not finish"
        assert replayer.error is None, f"replay failed: {replayer.error!r}"
        wait_for_completions(run, len(expected), COMPLETION_BOUND_S)
        codes = {instance_id: stop(worker) for instance_id, worker in run.workers.items()}
    finally:
        for worker in run.workers.values():
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("worker-*.log")))
    assert codes == {"w0": 0, "w1": 0}, failed_worker_logs(tmp_path, codes)
    assert "Traceback" not in logs
    assert completions_on(run.bootstrap, names) == expected
    assert_deltas_cover_exactly_once(run.bootstrap, names, expected)
    assert list(read_messages(run.bootstrap, names.dead_letters)) == []
    report_figures(label, run, fault_at, fault_s, logs.count(REPLACED_MARK))


def failed_worker_logs(tmp_path: Path, codes: dict[str, int]) -> str:
    """The end of the last log of each worker that exited non-zero (a restarted worker has one
    log per start; the last start is the one whose exit code failed)."""
    tails = []
    for instance_id, code in codes.items():
        if code != 0:
            last_log = sorted(tmp_path.glob(f"worker-{instance_id}-*.log"))[-1]
            tails.append(f"--- {last_log.name} (exit {code}) ---\n{last_log.read_text()[-6000:]}")
    return "\n".join(tails)


def wait_until_both_restored(run: Run) -> None:
    """Until each worker has logged a restore of the partitions the group gave it."""
    deadline = time.monotonic() + WAIT_BOUND_S * 2
    while True:
        logs = [
            "".join(path.read_text() for path in run.tmp_path.glob(f"worker-{instance_id}-*"))
            for instance_id in run.workers
        ]
        if all("restored " in log for log in logs):
            return
        exited = {i: w.returncode for i, w in run.workers.items() if w.poll() is not None}
        assert not exited, f"workers exited early: {exited}"
        if time.monotonic() > deadline:
            pytest.fail("the workers were not both assigned partitions within the wait bound")
        time.sleep(0.5)


def wait_for_completions(run: Run, count: int, bound_s: float) -> None:
    """Until `count` completions are visible; a worker that exits meanwhile fails the test (it
    rides out every fault in process, replacing a producer its client made unusable)."""
    deadline = time.monotonic() + bound_s
    while len(completions_on(run.bootstrap, run.names)) < count:
        exited = {i: w.returncode for i, w in run.workers.items() if w.poll() is not None}
        assert not exited, f"workers exited early: {exited}"
        if time.monotonic() > deadline:
            pytest.fail(f"fewer than {count} completions within {bound_s:.0f} s")
        time.sleep(1.0)


def report_figures(
    label: str, run: Run, fault_at: float, fault_s: float, replacements: int
) -> None:
    """Print the longest gap between committed deltas, the throughput dip after the fault, and
    how many producers the workers replaced in process.

    Delta timestamps are set when the worker produces them, at the start of their commit; only
    committed ones are read (read_committed), so an aborted batch shows up as a gap.
    """
    deltas = sorted(
        (
            (message.timestamp()[1] / 1000, json.loads(message.value()))
            for message in read_messages(run.bootstrap, run.names.deltas)
        ),
        key=lambda stamped: stamped[0],
    )
    stamps = [stamp for stamp, _ in deltas]
    gaps = [(b - a, a) for a, b in zip(stamps, stamps[1:], strict=False)]
    longest, gap_start = max(gaps)
    # Input events (seq numbers: each tokens event carries up to 16 ids) whose text committed:
    # before the fault, as a rate over the stream so far (the paced replay's steady rate); after
    # it, in windows from the fault on, the slowest of which is the dip.
    start = stamps[0]
    before = sum(events(delta) for stamp, delta in deltas if stamp < fault_at)
    baseline = before / (fault_at - start) if fault_at > start else float("nan")
    windows: Counter[int] = Counter()
    for stamp, delta in deltas:
        if stamp >= fault_at:
            windows[int((stamp - fault_at) // WINDOW_S)] += events(delta)
    # The last window is cut short by the end of the stream.
    after = [windows.get(w, 0) / WINDOW_S for w in range(max(windows, default=0))]
    lowest = min(after) if after else float("nan")
    print(
        f"\n[cluster fault] {label} (brokers back after {fault_s:.0f} s): "
        f"longest gap between committed deltas {longest:.1f} s "
        f"(starting {gap_start - fault_at:+.1f} s from the fault); throughput before the fault "
        f"{baseline:.0f} events/s, slowest {WINDOW_S:.0f}-s window after it {lowest:.0f} "
        f"events/s ({throughput_dip(baseline, lowest)}), last delta {stamps[-1] - fault_at:.0f} s "
        "after the fault; "
        f"{replacements} producer(s) replaced in process"
    )


def events(delta: dict) -> int:
    return delta["seq_end"] - delta["seq_start"] + 1


def throughput_dip(baseline: float, lowest: float) -> str:
    if not baseline or lowest != lowest:
        return "no figure"
    return f"dip {100 * (1 - lowest / baseline):.0f}%"


# -- the faults --------------------------------------------------------------------------------


@CLUSTER_A
def test_kill_9_the_leader_of_input_partition_0(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        leader = partition_leader(run.bootstrap, run.names.input, 0)
        os.kill(node_pid(run.cluster, leader), signal.SIGKILL)
        time.sleep(DOWN_S)
        broker.start_node(run.cluster.data_dir, leader)

    run_with_fault(all_up, tmp_path, fault, "kill -9 leader of input partition 0", seed=101)


@CLUSTER_B
def test_kill_9_the_transaction_coordinator_of_a_worker(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        coordinator = transaction_coordinator(run.bootstrap, run.transactional_id("w0"))
        os.kill(node_pid(run.cluster, coordinator), signal.SIGKILL)
        time.sleep(DOWN_S)
        broker.start_node(run.cluster.data_dir, coordinator)

    run_with_fault(all_up, tmp_path, fault, "kill -9 transaction coordinator of w0", seed=102)


@CLUSTER_A
def test_rolling_restart_of_all_three_brokers(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        for node_id in run.cluster.node_ids:
            broker.stop_node(run.cluster.data_dir, node_id)  # controlled shutdown (SIGTERM)
            broker.start_node(run.cluster.data_dir, node_id)

    run_with_fault(all_up, tmp_path, fault, "rolling restart of all three", seed=103)


@CLUSTER_B
def test_all_three_brokers_down_for_20_s(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        broker.stop_cluster(run.cluster.data_dir)
        time.sleep(ALL_DOWN_S)
        broker.start_cluster(BROKERS, port=run.cluster.port, data_dir=run.cluster.data_dir)

    run_with_fault(all_up, tmp_path, fault, "all three down 20 s", seed=104)


@CLUSTER_A
def test_sigstop_one_broker_past_the_session_timeout(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        leader = partition_leader(run.bootstrap, run.names.input, 0)
        pid = node_pid(run.cluster, leader)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(SIGSTOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    run_with_fault(all_up, tmp_path, fault, "SIGSTOP leader 15 s", seed=105)


@CLUSTER_B
def test_kill_9_a_worker_while_a_broker_is_down(all_up, tmp_path: Path) -> None:
    def fault(run: Run) -> None:
        leader = partition_leader(run.bootstrap, run.names.input, 0)
        os.kill(node_pid(run.cluster, leader), signal.SIGKILL)
        time.sleep(2)
        run.workers["w0"].kill()
        run.workers["w0"].wait()
        run.start("w0")  # same instance id: fences its predecessor's transaction at once
        time.sleep(DOWN_S)
        broker.start_node(run.cluster.data_dir, leader)

    run_with_fault(all_up, tmp_path, fault, "kill -9 worker while a broker is down", seed=106)


@CLUSTER_B
def test_topic_configs_are_read_while_a_broker_is_down(all_up: broker.ClusterLayout) -> None:
    """The worker's start-up read of its topics' limits (eight fresh clients) and `detok topics
    ensure`'s read of their configurations (eight), all at once, right after one broker of three
    was killed: until the cluster fences it (~9 s), live brokers may name the dead one as the
    controller, where librdkafka sends DescribeConfigs. A worker that asked it waited for its
    whole start-up bound and exited (CI); now each ask ends after CONFIG_ASK_TIMEOUT_S and is
    made again on fresh metadata."""
    names = pipeline_topics(all_up.bootstrap_servers)
    bootstrap = {"bootstrap.servers": all_up.bootstrap_servers}
    configs = topic_configs(AdminClient(bootstrap), names.all)
    limits = {topic: int(config["max.message.bytes"]) for topic, config in configs.items()}
    os.kill(node_pid(all_up, BROKERS), signal.SIGKILL)
    outcomes: dict[str, object] = {}

    def worker_start(client: str) -> None:
        connection = KafkaConnection(all_up.bootstrap_servers)
        try:
            outcomes[client] = read_output_limits(connection, names, 30.0, lambda: False)
        except TopicsUnavailable as error:
            outcomes[client] = error

    def ensure(client: str) -> None:
        try:
            found = topic_configs(make_admin(KafkaConnection(all_up.bootstrap_servers)), names.all)
            outcomes[client] = {t: int(c["max.message.bytes"]) for t, c in found.items()}
        except KafkaException as error:
            outcomes[client] = error

    readers = [threading.Thread(target=worker_start, args=(f"worker {i}",)) for i in range(8)]
    readers += [threading.Thread(target=ensure, args=(f"ensure {i}",)) for i in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(60)
    # The worker's read also counts the input's and the changelog's partitions (4 each).
    partitions = {names.input: 4, names.changelog: 4}
    assert outcomes == {
        **{f"worker {i}": OutputLimits(limits, partitions) for i in range(8)},
        **{f"ensure {i}": limits for i in range(8)},
    }


# -- the command line, on the same cluster -----------------------------------------------------


def run_detok(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        check=False,
    )


@CLUSTER_A
def test_broker_commands_drive_the_cluster_node_by_node(all_up) -> None:
    data_dir = str(all_up.data_dir)
    again = run_detok(
        "broker", "start", "--brokers", "3", "--port", str(all_up.port), "--data-dir", data_dir
    )
    assert again.returncode == 0, again.stderr
    expected_bootstrap = ",".join(f"127.0.0.1:{all_up.port + i}" for i in range(3))
    assert again.stdout.splitlines()[-1] == f"KAFKA_BOOTSTRAP_SERVERS={expected_bootstrap}"

    status = run_detok("broker", "status", "--json", "--data-dir", data_dir)
    nodes = json.loads(status.stdout)
    assert [(n["node_id"], n["port"], n["controller_port"], n["running"]) for n in nodes] == [
        (i + 1, all_up.port + i, all_up.port + 3 + i, True) for i in range(3)
    ]
    assert all(n["roles"] == ["broker", "controller"] for n in nodes)

    stopped = run_detok("broker", "stop", "--node", "3", "--data-dir", data_dir)
    assert stopped.returncode == 0, stopped.stderr
    nodes = json.loads(run_detok("broker", "status", "--json", "--data-dir", data_dir).stdout)
    assert [n["running"] for n in nodes] == [True, True, False]
    assert broker.metadata_brokers(all_up.bootstrap_servers) == {1, 2}

    started = run_detok("broker", "start", "--node", "3", "--data-dir", data_dir)
    assert started.returncode == 0, started.stderr
    assert broker.metadata_brokers(all_up.bootstrap_servers) == {1, 2, 3}


@CLUSTER_A
def test_topics_on_the_cluster_are_replicated_three_times_with_two_in_sync(all_up) -> None:
    names = pipeline_topics(all_up.bootstrap_servers)
    admin = AdminClient({"bootstrap.servers": all_up.bootstrap_servers})
    metadata = admin.list_topics(names.input, timeout=30)
    assert all(len(p.replicas) == 3 for p in metadata.topics[names.input].partitions.values())
    # Any broker may answer, and one restarted by the test before may learn of the topic a
    # moment after `ensure` returned: topic_configs asks again, as `ensure` itself does.
    config = topic_configs(admin, [names.deltas])[names.deltas]
    assert config["min.insync.replicas"] == "2"
