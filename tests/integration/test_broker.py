"""`detok broker` on the real local broker: start is idempotent, status reports it, a port held by
someone else is refused clearly, and stop really ends the process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import free_port_pair
from workers.local import broker

# A broker start is measured at ~3-5 s; the command bounds itself at 120 s, plus jar fetching.
COMMAND_BOUND_S = 300


def run_detok(*arguments: str) -> subprocess.CompletedProcess[str]:
    environment = {
        key: value for key, value in os.environ.items() if key != "KAFKA_BOOTSTRAP_SERVERS"
    }
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environment,
        timeout=COMMAND_BOUND_S,
        check=False,
    )


@pytest.mark.integration
def test_second_start_finds_the_running_broker(local_broker: broker.RunningBroker) -> None:
    port, data_dir = str(local_broker.port), str(local_broker.data_dir)
    result = run_detok("broker", "start", "--port", port, "--data-dir", data_dir)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.splitlines()[-1]
        == f"KAFKA_BOOTSTRAP_SERVERS={local_broker.bootstrap_servers}"
    )
    pid_file = json.loads((local_broker.data_dir / "broker.json").read_text())
    assert pid_file == {"pid": local_broker.pid, "port": local_broker.port}


@pytest.mark.integration
def test_status_reports_the_running_broker(local_broker: broker.RunningBroker) -> None:
    result = run_detok("broker", "status", "--data-dir", str(local_broker.data_dir))
    assert result.returncode == 0, result.stderr
    assert "running (ready)" in result.stdout
    assert f"pid {local_broker.pid}" in result.stdout
    assert (
        result.stdout.splitlines()[-1]
        == f"KAFKA_BOOTSTRAP_SERVERS={local_broker.bootstrap_servers}"
    )


@pytest.mark.integration
def test_stop_ends_a_broker_that_start_began(
    local_broker: broker.RunningBroker, tmp_path: Path
) -> None:
    # A second, short-lived broker: the session's one must keep serving the other tests.
    port, data_dir = free_port_pair(), tmp_path / "second-broker"
    started = run_detok("broker", "start", "--port", str(port), "--data-dir", str(data_dir))
    assert started.returncode == 0, started.stderr
    assert started.stdout.splitlines()[-1] == f"KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{port}"
    pid = json.loads((data_dir / "broker.json").read_text())["pid"]

    stopped = run_detok("broker", "stop", "--data-dir", str(data_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped Kafka broker pid {pid}" in stopped.stdout
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert broker.port_is_free(port)
    assert not (data_dir / "broker.json").exists()

    status = run_detok("broker", "status", "--data-dir", str(data_dir))
    assert status.returncode == 1
    assert "not running" in status.stdout


def test_start_refuses_a_port_held_by_another_process(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind((broker.LOOPBACK, 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = run_detok("broker", "start", "--port", str(port), "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert not (tmp_path / "broker.json").exists()


def test_stop_and_status_without_a_broker(tmp_path: Path) -> None:
    stopped = run_detok("broker", "stop", "--data-dir", str(tmp_path))
    assert stopped.returncode == 0
    assert "no Kafka broker was running" in stopped.stdout
    status = run_detok("broker", "status", "--data-dir", str(tmp_path))
    assert status.returncode == 1
    assert "not running" in status.stdout


def test_cluster_ids_are_kafka_form_and_never_look_like_options() -> None:
    ids = [broker.new_cluster_id() for _ in range(5000)]  # ~78 would start with "-" unchecked
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
    assert len(set(ids)) == len(ids)
