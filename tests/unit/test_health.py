"""/healthz and /readyz (workers/runtime/health.py), served beside /metrics on one port."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from workers.runtime.health import Health, serve


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_probes_follow_the_worker_and_metrics_stay_beside_them() -> None:
    registry = CollectorRegistry()
    Counter("detok_example", "an example", registry=registry).inc()
    health = Health(stall_s=3600)
    port = free_port()
    serve(port, "127.0.0.1", registry, health)

    assert get(port, "/healthz")[0] == 200
    status, body = get(port, "/readyz")
    assert status == 503 and "not yet assigned" in body

    health.set_ready(False, "restoring partitions [0, 1]")
    assert get(port, "/readyz") == (503, "restoring partitions [0, 1]\n")
    health.set_ready(True, "partitions [0, 1] restored")
    assert get(port, "/readyz") == (200, "partitions [0, 1] restored\n")

    status, body = get(port, "/metrics")
    assert status == 200 and "detok_example_total 1.0" in body


def test_a_loop_that_stopped_stepping_fails_liveness() -> None:
    health = Health(stall_s=0.0)
    live, detail = health.live()
    assert not live and "has not stepped" in detail
    health = Health(stall_s=3600)
    health.step()
    assert health.live() == (True, "ok")
