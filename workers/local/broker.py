"""A real Apache Kafka broker (KRaft) for tests, CI and the demo, with no Docker: one node, or a
three-node cluster for fault drills.

Why this exists: the project's machines and CI have no Docker engine and Debian packages no Kafka
broker, but they reach Maven Central. So `deploy/kafka-local/pom.xml` copies the broker's runtime
classpath into `deploy/kafka-local/lib/`, and this module formats a data directory and runs
`kafka.Kafka` from those jars as one combined broker+controller on 127.0.0.1.

A data directory holds exactly one broker:

    <data-dir>/server.properties   the rendered config (ports and log.dirs filled in)
    <data-dir>/kafka-logs/         Kafka's storage (formatted once, reused on later starts)
    <data-dir>/broker.log          the broker's stdout/stderr (quiet: warnings, errors, "started")
    <data-dir>/broker.json         the pid file: {"pid": ..., "port": ...} of the running broker

The client port defaults to 19092 (controller port = client port + 1), away from the 9092/9093 a
developer's own Kafka would use.

A cluster (`start_cluster`, `detok broker start --brokers 3`) is N combined broker+controller
nodes, all N of them voters of a static quorum (a majority must be up for anything to work, so
three nodes survive one failure). Its data directory holds `cluster.json` (size, base port,
cluster id) and one node directory per node, each laid out like a single broker's data directory:

    <data-dir>/cluster.json        {"brokers": N, "port": P, "cluster_id": ...}
    <data-dir>/node-<id>/          server.properties, kafka-logs/, broker.log, broker.json

Port layout, one contiguous block of 2N ports from P: node i (1-based) takes client port
P + i - 1 and controller port P + N + i - 1. With the default P=19092 and N=3: clients on
19092-19094, controllers on 19095-19097. Replication is set for a real cluster (see
CLUSTER_PROPERTIES), so a topic keeps accepting acks=all writes with one node down.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.kafka.clients import KafkaConnection, make_admin

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_LOCAL_DIR = REPO_ROOT / "deploy" / "kafka-local"
JAR_DIR = KAFKA_LOCAL_DIR / "lib"
DEFAULT_DATA_DIR = REPO_ROOT / ".kafka-local" / "broker"
DEFAULT_PORT = 19092
LOOPBACK = "127.0.0.1"

# A broker for tests and demos: a fixed, small heap (the scripts' default of 1 GiB is sized for
# real traffic, and a test machine also runs the workers and the test session), G1 with the pause
# target the Kafka scripts use, and the quiet log4j2 config.
JVM_OPTIONS = (
    "-Xms512m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
    f"-Dlog4j2.configurationFile={KAFKA_LOCAL_DIR / 'log4j2.properties'}",
)
# StorageTool only writes a few files; it needs neither the broker's heap nor its GC tuning.
FORMAT_JVM_OPTIONS = (
    "-Xmx256m",
    f"-Dlog4j2.configurationFile={KAFKA_LOCAL_DIR / 'log4j2.properties'}",
)

# A cluster runs three JVMs beside the workers and the tests: a smaller heap each (the drills move
# kilobytes, and 384 MiB leaves the page cache, not the heap, to hold the logs) and one GC and
# two JIT compiler threads each, so three idle JVMs do not take turns starving the workers' cores
# with background compilation and concurrent marking.
CLUSTER_JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx384m",
    "-XX:ParallelGCThreads=1",
    "-XX:ConcGCThreads=1",
    "-XX:CICompilerCount=2",
    *JVM_OPTIONS[2:],
)
DEFAULT_CLUSTER_BROKERS = 3
# What makes a multi-node cluster survive a node: every topic and both internal topics (consumer
# offsets, transaction state) on three replicas, and a write acknowledged (acks=all) only once two
# of them have it, so losing any one node loses no acknowledged record and blocks no writer.
# Written for a cluster of at least 3 nodes; `_replication_properties` caps them by the size.
CLUSTER_PROPERTIES: Mapping[str, str] = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
}
ROLES = ("broker", "controller")

# Measured: the broker answers metadata about 3 s after launch on an idle machine. 120 s leaves
# room for a loaded CI machine (JIT and class loading of ~45 jars compete with the test run) while
# still failing a broken start well within a CI job's patience.
READY_TIMEOUT_S = 120.0
# The first `mvn package` downloads ~43 MB; ten minutes tolerates a slow mirror but not a hang.
FETCH_TIMEOUT_S = 600.0
# A single-node controlled shutdown takes ~2 s; past 30 s the broker is stuck and SIGKILL is safe
# for throwaway test data (Kafka recovers its logs on the next start).
STOP_TIMEOUT_S = 30.0
# How often start-up and shutdown are re-checked: short against a ~3 s start, and the probes are
# cheap (a TCP connect, then one metadata request).
POLL_INTERVAL_S = 0.25
# One metadata request: a live broker on loopback answers in milliseconds; 2 s keeps a probe of a
# broker that is still starting from eating into the overall start bound.
METADATA_TIMEOUT_S = 2.0
LOG_TAIL_LINES = 40
# Where `free_port_block` starts looking: above the well-known and most registered service ports.
PORT_BLOCK_FLOOR = 20000


class BrokerError(Exception):
    """The local broker could not be fetched, started, or stopped as asked."""


class PortInUse(BrokerError):
    """Another process (not this data directory's broker) holds the client or controller port."""


class BrokerStartFailed(BrokerError):
    """The broker process exited or did not answer a metadata request in time."""


class NotACluster(BrokerError):
    """A data directory asked for as a cluster holds a single broker (or nothing), or the other
    way round."""


@dataclass(frozen=True)
class BrokerSecurity:
    """What a secured broker adds to the plain one; `workers.local.secure_broker` makes it.

    Kept to three plain values so this module knows nothing of TLS or SASL: server properties
    over the template's (listeners, authorizer, ...), arguments for the storage format (the
    bootstrap SCRAM users), and the client settings the readiness probe connects with.
    """

    server_properties: Mapping[str, str]
    format_arguments: tuple[str, ...] = ()
    probe_properties: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunningBroker:
    """A broker process that answers on `bootstrap_servers`."""

    pid: int
    port: int
    data_dir: Path

    @property
    def bootstrap_servers(self) -> str:
        return f"{LOOPBACK}:{self.port}"


@dataclass(frozen=True)
class ClusterLayout:
    """Where each node of a local cluster lives: ports (see the module docstring) and dirs."""

    brokers: int
    port: int
    data_dir: Path
    cluster_id: str

    @property
    def node_ids(self) -> range:
        return range(1, self.brokers + 1)

    def client_port(self, node_id: int) -> int:
        return self.port + node_id - 1

    def controller_port(self, node_id: int) -> int:
        return self.port + self.brokers + node_id - 1

    def node_dir(self, node_id: int) -> Path:
        return self.data_dir / f"node-{node_id}"

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{LOOPBACK}:{self.client_port(n)}" for n in self.node_ids)

    @property
    def quorum_voters(self) -> str:
        return ",".join(f"{n}@{LOOPBACK}:{self.controller_port(n)}" for n in self.node_ids)


@dataclass(frozen=True)
class NodeStatus:
    """One node as `detok broker status --json` reports it."""

    node_id: int
    roles: tuple[str, ...]
    port: int
    controller_port: int
    pid: int | None  # None when not running
    data_dir: Path

    @property
    def running(self) -> bool:
        return self.pid is not None

    def to_json(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "roles": list(self.roles),
            "port": self.port,
            "controller_port": self.controller_port,
            "pid": self.pid,
            "running": self.running,
            "data_dir": str(self.data_dir),
        }


def start_broker(
    port: int = DEFAULT_PORT,
    data_dir: Path = DEFAULT_DATA_DIR,
    security: BrokerSecurity | None = None,
    server_properties: Mapping[str, str] | None = None,
) -> RunningBroker:
    """Start the broker of `data_dir` on `port` and return once it answers metadata requests.

    `security`'s server properties, then `server_properties` (for drills and tests), override
    or extend the template; they apply to the formatting and to every start.

    Idempotent: if this data directory's broker already runs, it is waited for and returned, so
    `detok broker start` twice is harmless. Raises PortInUse if something else holds the ports,
    BrokerStartFailed (with the log tail) if the broker dies or stays silent for READY_TIMEOUT_S.
    """
    data_dir = data_dir.resolve()
    if _cluster_file(data_dir).exists():
        raise NotACluster(f"{data_dir} holds a cluster; start it with --brokers (or --node)")
    running = broker_status(data_dir)
    if running is not None:
        if running.port != port:
            raise BrokerError(
                f"the broker of {data_dir} already runs on port {running.port}, not {port}; "
                "stop it first or use another --data-dir"
            )
        _wait_until_ready(running, process=None, security=security)
        return running

    controller_port = port + 1
    for needed in (port, controller_port):
        if not port_is_free(needed):
            raise PortInUse(
                f"port {needed} on {LOOPBACK} is already in use by another process; the broker "
                f"needs {port} (clients) and {controller_port} (controller). Pick another --port."
            )

    fetch_jars()
    data_dir.mkdir(parents=True, exist_ok=True)
    controller = f"{LOOPBACK}:{controller_port}"
    properties = _render_server_properties(
        data_dir,
        {
            "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{controller}",
            "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
            "controller.quorum.voters": f"1@{controller}",
            "log.dirs": str(data_dir / "kafka-logs"),
            **(security.server_properties if security else {}),
            **(server_properties or {}),
        },
    )
    if not (data_dir / "kafka-logs" / "meta.properties").exists():
        _format_storage(properties, new_cluster_id(), security.format_arguments if security else ())
    process = _launch(data_dir, properties, port, JVM_OPTIONS)
    broker = RunningBroker(pid=process.pid, port=port, data_dir=data_dir)
    try:
        _wait_until_ready(broker, process=process, security=security)
    except BrokerStartFailed:
        _terminate(broker.pid)
        _pid_file(data_dir).unlink(missing_ok=True)
        raise
    return broker


def _launch(
    node_dir: Path, properties: Path, port: int, jvm_options: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    """Start one node's JVM in the background and record its pid file."""
    with (node_dir / "broker.log").open("ab") as log:
        log.write(f"--- detok broker start on {LOOPBACK}:{port} at {time.ctime()} ---\n".encode())
        log.flush()
        # start_new_session: the broker outlives `detok broker start` and is not hit by the
        # Ctrl-C of the terminal that started it; `detok broker stop` ends it explicitly.
        process = subprocess.Popen(
            [_java(), *jvm_options, "-cp", str(JAR_DIR / "*"), "kafka.Kafka", str(properties)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=node_dir,
        )
    _pid_file(node_dir).write_text(json.dumps({"pid": process.pid, "port": port}) + "\n")
    return process


def start_cluster(
    brokers: int = DEFAULT_CLUSTER_BROKERS,
    port: int = DEFAULT_PORT,
    data_dir: Path = DEFAULT_DATA_DIR,
    server_properties: Mapping[str, str] | None = None,
) -> ClusterLayout:
    """Start every node of a `brokers`-node cluster and return once each answers and sees them all.

    The first start formats every node with one cluster id and writes `cluster.json`; later
    starts reuse both (the size and base port must match). Nodes already running are left alone,
    so a second `start` is harmless. All nodes are launched before any is waited for: a node
    serves nothing until a majority of the controller quorum is up.
    """
    if brokers < 2:
        raise BrokerError("a cluster has at least 2 nodes; one broker is `start_broker`")
    data_dir = data_dir.resolve()
    if _pid_file(data_dir).exists() or (data_dir / "kafka-logs").exists():
        raise NotACluster(f"{data_dir} holds a single broker; use another --data-dir")
    layout = _read_layout(data_dir)
    if layout is None:
        layout = ClusterLayout(brokers, port, data_dir, new_cluster_id())
    elif (layout.brokers, layout.port) != (brokers, port):
        raise BrokerError(
            f"{data_dir} holds a {layout.brokers}-node cluster on port {layout.port}; "
            "stop it and use another --data-dir for a different shape"
        )
    statuses = {node.node_id: node for node in cluster_status(data_dir, layout)}
    to_start = [n for n in layout.node_ids if not statuses[n].running]
    for node_id in to_start:
        for needed in (layout.client_port(node_id), layout.controller_port(node_id)):
            if not port_is_free(needed):
                raise PortInUse(
                    f"port {needed} on {LOOPBACK} is already in use by another process; the "
                    f"cluster needs {layout.port}-{layout.port + 2 * brokers - 1}. "
                    "Pick another --port."
                )
    fetch_jars()
    data_dir.mkdir(parents=True, exist_ok=True)
    _cluster_file(data_dir).write_text(
        json.dumps({"brokers": brokers, "port": port, "cluster_id": layout.cluster_id}) + "\n"
    )
    launched = {n: _launch_node(layout, n, server_properties) for n in to_start}
    try:
        for node_id in layout.node_ids:
            _wait_until_node_ready(layout, node_id, launched.get(node_id), layout.brokers)
    except BrokerStartFailed:
        for node_id in launched:
            _terminate(launched[node_id].pid)
            _pid_file(layout.node_dir(node_id)).unlink(missing_ok=True)
        raise
    return layout


def start_node(
    data_dir: Path, node_id: int, server_properties: Mapping[str, str] | None = None
) -> NodeStatus:
    """(Re)start one node of the cluster in `data_dir` and return once it has rejoined.

    "Rejoined" is the node answering on its own port with itself in the broker list, which the
    controller grants once it has caught up with the metadata log. For drills and tests.
    """
    layout = cluster_layout(data_dir)
    _check_node(layout, node_id)
    status = _node_status(layout, node_id)
    if status.running:
        _wait_until_node_ready(layout, node_id, None, 1)
        return status
    process = _launch_node(layout, node_id, server_properties)
    try:
        _wait_until_node_ready(layout, node_id, process, 1)
    except BrokerStartFailed:
        _terminate(process.pid)
        _pid_file(layout.node_dir(node_id)).unlink(missing_ok=True)
        raise
    return _node_status(layout, node_id)


def stop_node(data_dir: Path, node_id: int) -> NodeStatus:
    """Stop one node (controlled shutdown: SIGTERM, SIGKILL after STOP_TIMEOUT_S); its status
    before the stop."""
    layout = cluster_layout(data_dir)
    _check_node(layout, node_id)
    status = _node_status(layout, node_id)
    if status.pid is not None:
        _terminate(status.pid)
    _pid_file(layout.node_dir(node_id)).unlink(missing_ok=True)
    return status


def stop_cluster(data_dir: Path) -> list[NodeStatus]:
    """Stop every running node, all at once (each shuts down in parallel); their prior status."""
    layout = cluster_layout(data_dir)
    statuses = cluster_status(data_dir, layout)
    running = [node for node in statuses if node.pid is not None]
    for node in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGTERM)  # all first: each one's shutdown overlaps
    for node in running:
        _terminate(node.pid)
    for node_id in layout.node_ids:
        _pid_file(layout.node_dir(node_id)).unlink(missing_ok=True)
    return statuses


def cluster_layout(data_dir: Path) -> ClusterLayout:
    """The layout recorded in `data_dir`; NotACluster if it holds none."""
    layout = _read_layout(data_dir.resolve())
    if layout is None:
        raise NotACluster(f"no cluster in {data_dir.resolve()} (no cluster.json)")
    return layout


def is_cluster(data_dir: Path) -> bool:
    return _cluster_file(data_dir.resolve()).exists()


def cluster_status(data_dir: Path, layout: ClusterLayout | None = None) -> list[NodeStatus]:
    """Every node of the cluster in `data_dir`, running or not."""
    layout = layout or cluster_layout(data_dir)
    return [_node_status(layout, node_id) for node_id in layout.node_ids]


def single_node_status(data_dir: Path = DEFAULT_DATA_DIR, port: int = DEFAULT_PORT) -> NodeStatus:
    """The single broker of `data_dir` in the cluster's status form (node 1, both roles)."""
    running = broker_status(data_dir)
    port = running.port if running else port
    return NodeStatus(
        1, ROLES, port, port + 1, running.pid if running else None, data_dir.resolve()
    )


def _replication_properties(brokers: int) -> dict[str, str]:
    """CLUSTER_PROPERTIES capped by the cluster's size (RF <= nodes, min ISR < RF)."""
    capped = {}
    for key, value in CLUSTER_PROPERTIES.items():
        limit = brokers if "replication.factor" in key else max(brokers - 1, 1)
        capped[key] = str(min(int(value), limit))
    return capped


def _launch_node(
    layout: ClusterLayout, node_id: int, server_properties: Mapping[str, str] | None
) -> subprocess.Popen[bytes]:
    node_dir = layout.node_dir(node_id)
    node_dir.mkdir(parents=True, exist_ok=True)
    port, controller = layout.client_port(node_id), layout.controller_port(node_id)
    properties = _render_server_properties(
        node_dir,
        {
            "node.id": str(node_id),
            "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller}",
            "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
            "controller.quorum.voters": layout.quorum_voters,
            "log.dirs": str(node_dir / "kafka-logs"),
            **_replication_properties(layout.brokers),
            **(server_properties or {}),
        },
    )
    if not (node_dir / "kafka-logs" / "meta.properties").exists():
        _format_storage(properties, layout.cluster_id)
    return _launch(node_dir, properties, port, CLUSTER_JVM_OPTIONS)


def _wait_until_node_ready(
    layout: ClusterLayout,
    node_id: int,
    process: subprocess.Popen[bytes] | None,
    brokers_seen: int,
) -> None:
    """Block until node `node_id` answers metadata listing itself and `brokers_seen` brokers."""
    node = RunningBroker(
        pid=process.pid if process else _node_status(layout, node_id).pid or 0,
        port=layout.client_port(node_id),
        data_dir=layout.node_dir(node_id),
    )

    def ready() -> bool:
        brokers = metadata_brokers(node.bootstrap_servers)
        return node_id in brokers and len(brokers) >= brokers_seen

    _wait_until_ready(node, process, ready)


def _node_status(layout: ClusterLayout, node_id: int) -> NodeStatus:
    node_dir = layout.node_dir(node_id)
    running = _recorded_broker(node_dir)
    return NodeStatus(
        node_id,
        ROLES,
        layout.client_port(node_id),
        layout.controller_port(node_id),
        running.pid if running else None,
        node_dir,
    )


def _check_node(layout: ClusterLayout, node_id: int) -> None:
    if node_id not in layout.node_ids:
        raise BrokerError(f"no node {node_id}: the cluster has nodes 1-{layout.brokers}")


def _read_layout(data_dir: Path) -> ClusterLayout | None:
    try:
        recorded = json.loads(_cluster_file(data_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return ClusterLayout(
        int(recorded["brokers"]), int(recorded["port"]), data_dir, str(recorded["cluster_id"])
    )


def _cluster_file(data_dir: Path) -> Path:
    return data_dir / "cluster.json"


def stop_broker(data_dir: Path = DEFAULT_DATA_DIR) -> RunningBroker | None:
    """Stop the broker of `data_dir` (SIGTERM, SIGKILL after STOP_TIMEOUT_S); None if none ran."""
    data_dir = data_dir.resolve()
    running = broker_status(data_dir)
    if running is not None:
        _terminate(running.pid)
    _pid_file(data_dir).unlink(missing_ok=True)
    return running


def broker_status(data_dir: Path = DEFAULT_DATA_DIR) -> RunningBroker | None:
    """The broker process of `data_dir` if it is alive (it may still be starting), else None."""
    return _recorded_broker(data_dir.resolve())


def _recorded_broker(node_dir: Path) -> RunningBroker | None:
    """The process in `node_dir`'s pid file if it is alive and still that node's broker."""
    try:
        recorded = json.loads(_pid_file(node_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    pid, port = int(recorded["pid"]), int(recorded["port"])
    if not _is_broker_process(pid, node_dir):
        return None
    return RunningBroker(pid=pid, port=port, data_dir=node_dir)


def fetch_jars() -> None:
    """Copy the broker's runtime classpath into JAR_DIR unless the pom's Kafka jar is already there.

    A lib/ left from another Kafka version is cleared first, so two versions never share the
    classpath. Maven caches downloads in ~/.m2, so only the very first fetch needs the network.
    """
    kafka_version = _pom_kafka_version()
    if (JAR_DIR / f"kafka_2.13-{kafka_version}.jar").is_file():
        return
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven (`mvn`) is not on PATH; it fetches the Kafka jars (apt: maven)")
    shutil.rmtree(JAR_DIR, ignore_errors=True)
    print(f"fetching Apache Kafka {kafka_version} jars into {JAR_DIR} ...", file=sys.stderr)
    command = [mvn, "-B", "-q", "-f", str(KAFKA_LOCAL_DIR / "pom.xml"), "package"]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise BrokerError(
            f"`{' '.join(command)}` did not finish in {FETCH_TIMEOUT_S:.0f} s"
        ) from error
    if result.returncode != 0:
        raise BrokerError(
            f"`{' '.join(command)}` failed (exit {result.returncode}):\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )


def new_cluster_id() -> str:
    """Kafka's own cluster id form (Uuid.toString: 16 random bytes, unpadded base64url, 22 chars).

    Generated in Python so formatting does not pay an extra JVM start for `random-uuid`. Like
    Kafka's `Uuid.randomUuid`, it never starts with "-": StorageTool's argument parser would take
    such an id for an option (one id in 64 does, and then `format` fails).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _render_server_properties(node_dir: Path, overrides: Mapping[str, str]) -> Path:
    """Write the template into `node_dir` with `overrides` (ports, log.dirs, ...) filled in.

    A key the template sets is replaced in place; a key it lacks is appended. The formatted
    storage and the running broker must read the same values, so both use this one rendered file
    rather than `--override` flags that StorageTool would not see.
    """
    lines, replaced = [], set()
    for line in (KAFKA_LOCAL_DIR / "server.properties").read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if key in overrides:
            lines.append(f"{key}={overrides[key]}")
            replaced.add(key)
        else:
            lines.append(line)
    lines += [f"{key}={value}" for key, value in overrides.items() if key not in replaced]
    rendered = node_dir / "server.properties"
    rendered.write_text("\n".join(lines) + "\n")
    return rendered


def _format_storage(
    properties: Path, cluster_id: str, extra_arguments: tuple[str, ...] = ()
) -> None:
    """Format a fresh KRaft log directory (static quorum, so no --standalone); every node of one
    cluster is formatted with the same `cluster_id`."""
    command = [
        _java(),
        *FORMAT_JVM_OPTIONS,
        "-cp",
        str(JAR_DIR / "*"),
        "kafka.tools.StorageTool",
        "format",
        "-t",
        cluster_id,
        "-c",
        str(properties),
        *extra_arguments,
    ]
    # Format takes ~1 s; 120 s only guards against a wedged JVM on a loaded machine.
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise BrokerStartFailed(
            f"formatting Kafka storage failed (exit {result.returncode}):\n"
            f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
        )


def _wait_until_ready(
    broker: RunningBroker,
    process: subprocess.Popen[bytes] | None,
    ready: Callable[[], bool] | None = None,
    security: BrokerSecurity | None = None,
) -> None:
    """Block until `ready()` (default: a metadata request succeeds, with `security`'s probe
    settings); fail fast if the broker process exits."""
    probe = security.probe_properties if security else {}
    ready = ready or (lambda: answers_metadata(broker.bootstrap_servers, probe))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        exited = process.poll() is not None if process else not _is_alive(broker.pid)
        if exited:
            raise BrokerStartFailed(
                f"the Kafka broker exited during start-up; last lines of {_log(broker)}:\n"
                f"{_log_tail(broker)}"
            )
        if ready():
            return
        time.sleep(POLL_INTERVAL_S)
    raise BrokerStartFailed(
        f"the Kafka broker did not answer on {broker.bootstrap_servers} within "
        f"{READY_TIMEOUT_S:.0f} s; last lines of {_log(broker)}:\n{_log_tail(broker)}"
    )


def answers_metadata(bootstrap_servers: str, properties: Mapping[str, str] | None = None) -> bool:
    """True if a broker at `bootstrap_servers` answers a metadata request listing itself.

    A plain TCP connect comes first so a closed port costs nothing and librdkafka does not log
    connection-refused errors while the broker is still starting.
    """
    return bool(metadata_brokers(bootstrap_servers, properties))


def metadata_brokers(
    bootstrap_servers: str, properties: Mapping[str, str] | None = None
) -> set[int]:
    """The node ids of the live brokers a metadata request to `bootstrap_servers` lists; empty if
    none answers. A TCP connect to the first address comes first (see `answers_metadata`)."""
    host, _, port = bootstrap_servers.split(",")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=METADATA_TIMEOUT_S):
            pass
    except OSError:
        return set()
    try:
        metadata = make_admin(KafkaConnection(bootstrap_servers, properties or {})).list_topics(
            timeout=METADATA_TIMEOUT_S
        )
    except Exception:  # KafkaException while the broker is still coming up
        return set()
    return set(metadata.brokers)


def _terminate(pid: int) -> None:
    """SIGTERM (Kafka's shutdown hook does a controlled shutdown), SIGKILL after STOP_TIMEOUT_S."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _is_alive(pid):
            return
        time.sleep(POLL_INTERVAL_S)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while _is_alive(pid):
        time.sleep(POLL_INTERVAL_S)


def _is_alive(pid: int) -> bool:
    """Whether `pid` still runs; reaps it if it is our own exited child (else it stays a zombie)."""
    try:
        reaped_pid, _ = os.waitpid(pid, os.WNOHANG)
        if reaped_pid == pid:
            return False
    except ChildProcessError:
        pass  # not our child (started by an earlier `detok broker start`): init reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        state = stat.read_text().rsplit(")", 1)[-1].split()[0]
        return state != "Z"
    return True


def _is_broker_process(pid: int, data_dir: Path) -> bool:
    """Whether `pid` is alive and is this (node) directory's broker, not a recycled pid."""
    if not _is_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():  # no procfs (macOS): trust the pid file
        return True
    arguments = cmdline.read_bytes().split(b"\0")
    return b"kafka.Kafka" in arguments and str(data_dir / "server.properties").encode() in arguments


def port_is_free(port: int) -> bool:
    """Whether nothing listens on `port` of the loopback address.

    Public because the tests pick free port pairs with it.
    """
    # SO_REUSEADDR as the JVM sets it: a port left in TIME_WAIT by a just-stopped broker counts as
    # free, a port someone listens on does not.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port_block(size: int) -> int:
    """A loopback port P with P..P+size-1 all free: a cluster's client and controller ports.

    Drawn below the kernel's ephemeral range: a node stopped for a drill must get its ports back
    when it restarts, and a port in the ephemeral range may meanwhile become the local end of
    any outgoing connection on the machine (seen: a node that could not restart, "Address
    already in use"). Public because the cluster tests and the benchmark start clusters.
    """
    low, high = PORT_BLOCK_FLOOR, _ephemeral_floor()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(low, 1024), high - size)
        if all(port_is_free(p) for p in range(port, port + size)):
            return port
    raise BrokerError(f"no block of {size} free loopback ports found below {high}")


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux; else 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _pom_kafka_version() -> str:
    namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
    root = ElementTree.parse(KAFKA_LOCAL_DIR / "pom.xml").getroot()
    version = root.findtext("m:properties/m:kafka.version", namespaces=namespace)
    if not version:
        raise BrokerError(f"no <kafka.version> property in {KAFKA_LOCAL_DIR / 'pom.xml'}")
    return version.strip()


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise BrokerError(
            "no `java` found (Kafka 4.x needs Java 17+; apt: openjdk-17-jre-headless)"
        )
    return java


def _pid_file(data_dir: Path) -> Path:
    return data_dir / "broker.json"


def _log(broker: RunningBroker) -> Path:
    return broker.data_dir / "broker.log"


def _log_tail(broker: RunningBroker) -> str:
    try:
        return "\n".join(_log(broker).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except FileNotFoundError:
        return "(no log written)"
