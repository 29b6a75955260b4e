"""The pipeline on a broker secured as production ones are: SASL_SSL (SCRAM over TLS), ACLs
enforced by StandardAuthorizer, each step run as its own principal holding only what
`detok acls grant` gave it; and the ways a client is kept out, each named, none hanging.

One secured broker (`detok broker start --security sasl-ssl`'s) serves the module: starting one
costs ~10-25 s, and the tests isolate themselves by topic and group names. Every command's
output and every worker log is kept, and no password may appear in any of them.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

from schemas.events import StopSignal
from tests.conftest import REPO_ROOT, missing_resource
from tests.integration.conftest import free_port_pair, unique_name
from tests.integration.worker_harness import (
    assert_deltas_cover_exactly_once,
    input_all_committed,
    make_generations,
    offline_completions,
    oracle_registry,
    start_worker,
    wait_exit,
    wait_for_first_commit,
    wait_for_log,
    with_early_ends,
    worker_log,
    write_jsonl,
)
from workers.io.publish import Publisher, StopSignals
from workers.kafka.acls import role_grants
from workers.kafka.clients import KafkaConnection, make_admin, make_consumer
from workers.kafka.config import read_properties_file
from workers.kafka.topic_names import TopicNames
from workers.local import broker
from workers.local.secure_broker import SecureBroker, client_properties, start_secure_broker

# One process under pytest-xdist: the module's tests share its secured broker.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("secured-broker")]

# What the acceptance asks of a refused client: gone, non-zero, within 30 s (a worker loads its
# tokenizers first, then is refused within a second or two). A bound on a hang, not a speed test.
REFUSED_EXIT_BOUND_S = 30.0
WRONG_PASSWORD = "wrong-Password-4711"
INVALID_LINES = ["this is not json", '{"request_id": "broken", "model": "gpt2"}']


@dataclass
class Secured:
    """The module's secured broker, its users' client configs, and every output collected."""

    broker: SecureBroker
    passwords: dict[str, str]
    configs: dict[str, Path]
    outputs: list[str] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def connection(self, user: str) -> KafkaConnection:
        properties = read_properties_file(self.configs[user])
        return KafkaConnection(self.bootstrap, properties)

    def detok(self, user: str, *arguments: str) -> subprocess.CompletedProcess[str]:
        """`detok ARGUMENTS` as `user`; its output is kept for the password check."""
        command = [
            sys.executable, "-m", "workers.cli", *arguments,
            "--bootstrap-servers", self.bootstrap, "--kafka-config", str(self.configs[user]),
        ]  # fmt: skip
        result = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
        )
        self.outputs.append(result.stdout + result.stderr)
        return result

    def grant(self, principal: str, role: str, names: TopicNames, group: str | None = None):
        flags = ["--group", group] if group else []
        result = self.detok(
            "admin", "acls", "grant", "--principal", principal, "--role", role, *flags,
            *topic_flags(names),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr

    def assert_no_password_in(self, log_dir: Path) -> None:
        texts = [*self.outputs, *(p.read_text(errors="replace") for p in log_dir.glob("*.log"))]
        assert texts
        for secret in [*self.passwords.values(), WRONG_PASSWORD]:
            assert not any(secret in text for text in texts), "a password reached a log"


def topic_flags(names: TopicNames) -> list[str]:
    flags = []
    for role, name in names.model_dump().items():
        flags += [f"--{role.replace('_', '-')}-topic", name]
    return flags


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    state_root = REPO_ROOT / ".kafka-local"
    state_root.mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="pytest-secured-", dir=state_root))
    try:
        running = start_secure_broker(port=free_port_pair(), data_dir=data_dir)
    except broker.BrokerError as error:
        shutil.rmtree(data_dir, ignore_errors=True)
        missing_resource(f"no secured Kafka broker: {error}")
    try:
        passwords = json.loads((data_dir / "security" / "credentials.json").read_text())
        configs = dict(running.client_configs)
        # A principal that exists but holds no ACL at all.
        passwords["nobody"] = "nobody-" + passwords["reader"][::-1]
        _add_scram_user(running, passwords, "nobody")
        configs["nobody"] = data_dir / "nobody.properties"
        configs["nobody"].write_text(
            "\n".join(
                f"{key}={value}"
                for key, value in client_properties(
                    "nobody", passwords["nobody"], data_dir / "security" / "ca.pem"
                ).items()
            )
        )
        yield Secured(running, passwords, configs)
    finally:
        broker.stop_broker(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def _add_scram_user(running: SecureBroker, passwords: dict[str, str], user: str) -> None:
    properties = read_properties_file(running.client_configs["admin"])
    admin = make_admin(KafkaConnection(running.bootstrap_servers, properties))
    upsert = UserScramCredentialUpsertion(
        user,
        ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
        passwords[user].encode(),
    )
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(timeout=30)


def records_in(connection: KafkaConnection, topic: str) -> int:
    """How many records (offsets) a topic holds, summed over its partitions."""
    consumer = make_consumer(connection, {"group.id": unique_name("count")})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
            for p in partitions
        )
    finally:
        consumer.close()


def completions_of(secured: Secured, names: TopicNames, tmp_path: Path) -> dict[str, dict]:
    """`detok collect` as the reader: the completions by request id."""
    output = tmp_path / "completions.kafka.jsonl"
    result = secured.detok(
        "reader", "collect", "--completions-topic", names.completions,
        "--output", str(output), "--timeout", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    completions = {}
    for line in output.read_text().splitlines():
        record = json.loads(line)
        completions[record["request_id"]] = record
    return completions


def test_broker_start_prints_each_users_config_and_the_address_last(secured: Secured) -> None:
    running = secured.broker.running
    location = ["--port", str(running.port), "--data-dir", str(running.data_dir)]
    started = subprocess.run(
        [sys.executable, "-m", "workers.cli", "broker", "start", "--security", "sasl-ssl",
         *location],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    secured.outputs.append(started.stdout + started.stderr)
    assert started.returncode == 0, started.stderr  # already running: found, not restarted
    lines = started.stdout.splitlines()
    assert lines[-1] == f"KAFKA_BOOTSTRAP_SERVERS={secured.bootstrap}"
    printed = dict(line.split("=", 1) for line in lines if line.startswith("KAFKA_CONFIG_"))
    assert set(printed) == {f"KAFKA_CONFIG_{user}" for user in ("ADMIN", "WORKER", "READER",
                                                                 "PRODUCER")}  # fmt: skip
    for name, path in printed.items():
        properties = read_properties_file(Path(path))
        assert properties["security.protocol"] == "SASL_SSL"
        assert properties["sasl.mechanism"] == "SCRAM-SHA-512"
        assert properties["sasl.username"] == name.removeprefix("KAFKA_CONFIG_").lower()
        assert Path(properties["ssl.ca.location"]).is_file()
    status = subprocess.run(
        [sys.executable, "-m", "workers.cli", "broker", "status", "--data-dir", location[-1]],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert status.returncode == 0 and "running (ready)" in status.stdout


UNFINISHED = "sec-unfinished"


@pytest.mark.slow
def test_the_pipeline_over_sasl_ssl_each_step_as_its_own_least_privileged_principal(
    secured: Secured, tmp_path: Path
) -> None:
    generations = with_early_ends(make_generations(120, seed=41), seed=41, failures=False)
    source = write_jsonl(tmp_path / "generations.jsonl", [*generations, *INVALID_LINES])
    expected = offline_completions(source, oracle_registry())
    names = TopicNames.with_prefix(unique_name("sec"))
    group = unique_name("g")

    ensured = secured.detok("admin", "topics", "ensure", "--partitions", "4", *topic_flags(names))
    assert ensured.returncode == 0, ensured.stderr
    secured.grant("User:worker", "worker", names, group)
    secured.grant("User:reader", "reader", names)
    secured.grant("User:producer", "producer", names)
    # The engine's side of the producer role: its stop signals, read under its own ACLs.
    received: list[StopSignal] = []
    engine = StopSignals(secured.connection("producer"), names.control, on_stop=received.append)
    # A request the engine leaves open after its stop string: whatever the batching, the worker
    # ends it before its finish, so one signal is certain (the workload's others depend on
    # whether a stop and its finish were consumed in one batch).
    with Publisher(secured.connection("producer"), names.input, linger_s=0) as publisher:
        publisher.open(UNFINISHED, "gpt2", [15496], stop=[" world"])
        publisher.append(UNFINISHED, [995, 11, 995])  # " world, world"

    # The producer replays at a pace, so the stream still flows when a worker is killed.
    replay = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "replay", "--input", str(source),
         "--input-topic", names.input, "--rate", "40",
         "--bootstrap-servers", secured.bootstrap,
         "--kafka-config", str(secured.configs["producer"])],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    as_worker = ["--kafka-config", str(secured.configs["worker"])]
    idle_exit = ["--exit-when-idle", "6"]
    doomed_log, survivor_log = worker_log(tmp_path, "a"), worker_log(tmp_path, "b")
    doomed = start_worker(
        secured.bootstrap, names, group, instance_id="a", extra=as_worker, log_dir=tmp_path,
        log_path=doomed_log,
    )  # fmt: skip
    survivor = start_worker(
        secured.bootstrap, names, group, instance_id="b", extra=[*as_worker, *idle_exit],
        log_dir=tmp_path, log_path=survivor_log,
    )  # fmt: skip
    # Both join and restore, and the doomed one commits part of the stream.
    wait_for_log(survivor_log, "restored")
    wait_for_first_commit(
        doomed_log,
        lambda: (
            replay.poll() is not None
            and input_all_committed(secured.connection("admin"), group, names.input)
        ),
    )
    doomed.send_signal(signal.SIGKILL)  # no commit, no goodbye
    doomed.wait()
    # The same instance id: its transactional id fences whatever the killed one left open.
    restarted = start_worker(
        secured.bootstrap, names, group, instance_id="a", extra=[*as_worker, *idle_exit],
        log_dir=tmp_path,
    )  # fmt: skip
    replay_output, _ = replay.communicate(timeout=120)
    secured.outputs.append(replay_output)
    assert replay.returncode == 0, replay_output
    assert wait_exit(survivor) == 0
    assert wait_exit(restarted) == 0

    completions = completions_of(secured, names, tmp_path)
    unfinished = completions.pop(UNFINISHED)
    assert (unfinished["status"], unfinished["stop_reason"]) == ("ok", " world")
    assert completions == expected
    assert_deltas_cover_exactly_once(secured.connection("admin"), names, expected)
    # Requests ended early whose finish came in a later batch (under a live stream, most of
    # them) have their signal, once; which ones depends on the batching, so only that much.
    ended_early = {r for r, c in expected.items() if c["stop_reason"] is not None}
    engine.close()
    ids = [signal.request_id for signal in received]
    assert UNFINISHED in ids and set(ids) <= {*ended_early, UNFINISHED}
    assert len(ids) == len(set(ids))

    redriven = secured.detok(
        "producer", "dlq", "redrive", "--input-topic", names.input,
        "--dead-letters-topic", names.dead_letters,
    )  # fmt: skip
    assert redriven.returncode == 0, redriven.stderr
    assert f"redriven {len(INVALID_LINES)} dead letters" in redriven.stdout
    secured.assert_no_password_in(tmp_path)


@pytest.mark.slow
def test_refused_clients_exit_at_once_naming_the_cause_and_leave_everything_untouched(
    secured: Secured, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "generations.jsonl", make_generations(40, seed=43))
    expected = offline_completions(source, oracle_registry())
    names = TopicNames.with_prefix(unique_name("secneg"))
    group = unique_name("g")
    assert secured.detok("admin", "topics", "ensure", *topic_flags(names)).returncode == 0
    secured.grant("User:producer", "producer", names)
    secured.grant("User:reader", "reader", names)
    replayed = secured.detok("producer", "replay", "--input", str(source), "--topic", names.input)
    assert replayed.returncode == 0, replayed.stderr
    # The worker's ACLs, all but its transactional id: created directly, as `acls grant` would.
    grants = [
        one
        for one in role_grants("worker", names, group)
        if one.resource.name != "TRANSACTIONAL_ID"
    ]
    admin = make_admin(secured.connection("admin"))
    for future in admin.create_acls([one.binding("User:worker") for one in grants]).values():
        future.result(timeout=30)

    worker_config = str(secured.configs["worker"])
    cases = {
        "a principal without ACLs": (
            ["--kafka-config", str(secured.configs["nobody"])],
            "not authorized to describe the configuration of topic",
        ),
        "a wrong password": (
            ["--kafka-config", worker_config, "-X", f"sasl.password={WRONG_PASSWORD}"],
            "SASL authentication error",
        ),
        "a plaintext client on the TLS listener": (
            ["--kafka-config", worker_config, "-X", "security.protocol=PLAINTEXT"],
            "expects another security.protocol (this client uses PLAINTEXT",
        ),
        "a worker without its transactional-id ACL": (
            ["--kafka-config", worker_config],
            "Transactional Id authorization failed",
        ),
    }
    for case, (extra, cause) in cases.items():
        worker = start_worker(
            secured.bootstrap, names, group, instance_id="refused", extra=extra, log_dir=tmp_path
        )
        try:
            code = worker.wait(timeout=REFUSED_EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
            pytest.fail(f"{case}: the worker was still running after {REFUSED_EXIT_BOUND_S} s")
        log = _newest_log(tmp_path).read_text(errors="replace")
        assert code != 0, f"{case}: exit {code}\n{log}"
        assert cause in log, f"{case}: the cause is not named\n{log}"

    admin_connection = secured.connection("admin")
    for topic in (names.deltas, names.completions, names.metrics, names.dead_letters,
                  names.changelog):  # fmt: skip
        assert records_in(admin_connection, topic) == 0, f"{topic} was written to"

    # With every ACL of its role, the next worker finds the input untouched and does it all.
    secured.grant("User:worker", "worker", names, group)
    worker = start_worker(
        secured.bootstrap, names, group, instance_id="correct",
        extra=["--kafka-config", worker_config, "--exit-when-idle", "4"], log_dir=tmp_path,
    )  # fmt: skip
    assert wait_exit(worker) == 0
    assert completions_of(secured, names, tmp_path) == expected
    secured.assert_no_password_in(tmp_path)


def _newest_log(log_dir: Path) -> Path:
    return max(log_dir.glob("worker-*.log"), key=lambda path: path.stat().st_mtime_ns)
