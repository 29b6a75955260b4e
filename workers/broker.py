"""A real single-node Apache Kafka broker (KRaft) for tests, CI and the demo, with no Docker.

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
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.kafka_clients import KafkaConnection, make_admin

REPO_ROOT = Path(__file__).resolve().parents[1]
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


class BrokerError(Exception):
    """The local broker could not be fetched, started, or stopped as asked."""


class PortInUse(BrokerError):
    """Another process (not this data directory's broker) holds the client or controller port."""


class BrokerStartFailed(BrokerError):
    """The broker process exited or did not answer a metadata request in time."""


@dataclass(frozen=True)
class BrokerSecurity:
    """What a secured broker adds to the plain one; `workers.secure_broker` makes it.

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


def start_broker(
    port: int = DEFAULT_PORT,
    data_dir: Path = DEFAULT_DATA_DIR,
    security: BrokerSecurity | None = None,
) -> RunningBroker:
    """Start the broker of `data_dir` on `port` and return once it answers metadata requests.

    Idempotent: if this data directory's broker already runs, it is waited for and returned, so
    `detok broker start` twice is harmless. Raises PortInUse if something else holds the ports,
    BrokerStartFailed (with the log tail) if the broker dies or stays silent for READY_TIMEOUT_S.
    """
    data_dir = data_dir.resolve()
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
    properties = _render_server_properties(port, data_dir, security)
    if not (data_dir / "kafka-logs" / "meta.properties").exists():
        _format_storage(properties, security.format_arguments if security else ())

    log_path = data_dir / "broker.log"
    with log_path.open("ab") as log:
        log.write(f"--- detok broker start on {LOOPBACK}:{port} at {time.ctime()} ---\n".encode())
        log.flush()
        # start_new_session: the broker outlives `detok broker start` and is not hit by the
        # Ctrl-C of the terminal that started it; `detok broker stop` ends it explicitly.
        process = subprocess.Popen(
            [_java(), *JVM_OPTIONS, "-cp", str(JAR_DIR / "*"), "kafka.Kafka", str(properties)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=data_dir,
        )
    broker = RunningBroker(pid=process.pid, port=port, data_dir=data_dir)
    _pid_file(data_dir).write_text(json.dumps({"pid": broker.pid, "port": port}) + "\n")
    try:
        _wait_until_ready(broker, process=process, security=security)
    except BrokerStartFailed:
        _terminate(broker.pid)
        _pid_file(data_dir).unlink(missing_ok=True)
        raise
    return broker


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
    data_dir = data_dir.resolve()
    try:
        recorded = json.loads(_pid_file(data_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    pid, port = int(recorded["pid"]), int(recorded["port"])
    if not _is_broker_process(pid, data_dir):
        return None
    return RunningBroker(pid=pid, port=port, data_dir=data_dir)


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


def _render_server_properties(
    port: int, data_dir: Path, security: BrokerSecurity | None = None
) -> Path:
    """Write the template with this broker's ports and log.dirs filled in (and `security`'s
    properties over them; keys the template lacks are appended).

    The formatted storage and the running broker must read the same values, so both use this one
    rendered file rather than `--override` flags that StorageTool would not see.
    """
    controller_port = port + 1
    overrides = {
        "listeners": f"PLAINTEXT://{LOOPBACK}:{port},CONTROLLER://{LOOPBACK}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{LOOPBACK}:{port}",
        "controller.quorum.voters": f"1@{LOOPBACK}:{controller_port}",
        "log.dirs": str(data_dir / "kafka-logs"),
        **(security.server_properties if security else {}),
    }
    lines = []
    for line in (KAFKA_LOCAL_DIR / "server.properties").read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        lines.append(f"{key}={overrides.pop(key)}" if key in overrides else line)
    lines += [f"{key}={value}" for key, value in overrides.items()]
    rendered = data_dir / "server.properties"
    rendered.write_text("\n".join(lines) + "\n")
    return rendered


def _format_storage(properties: Path, extra_arguments: tuple[str, ...] = ()) -> None:
    """Format a fresh KRaft log directory (static quorum, so no --standalone)."""
    command = [
        _java(),
        *FORMAT_JVM_OPTIONS,
        "-cp",
        str(JAR_DIR / "*"),
        "kafka.tools.StorageTool",
        "format",
        "-t",
        new_cluster_id(),
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
    security: BrokerSecurity | None = None,
) -> None:
    """Block until a metadata request succeeds; fail fast if the broker process exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        exited = process.poll() is not None if process else not _is_alive(broker.pid)
        if exited:
            raise BrokerStartFailed(
                f"the Kafka broker exited during start-up; last lines of {_log(broker)}:\n"
                f"{_log_tail(broker)}"
            )
        if answers_metadata(
            broker.bootstrap_servers, security.probe_properties if security else {}
        ):
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
    host, _, port = bootstrap_servers.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=METADATA_TIMEOUT_S):
            pass
    except OSError:
        return False
    try:
        metadata = make_admin(KafkaConnection(bootstrap_servers, properties or {})).list_topics(
            timeout=METADATA_TIMEOUT_S
        )
    except Exception:  # KafkaException while the broker is still coming up
        return False
    return bool(metadata.brokers)


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
    """Whether `pid` is alive and is this data directory's broker, not a recycled pid."""
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
