"""Liveness and readiness of one worker, served as `/healthz` and `/readyz` beside `/metrics`.

Why beside the metrics, on one port: an orchestrator's probes and Prometheus then need one
container port and one flag (`--metrics-port`), and a worker that serves no metrics serves no
probes either (it runs outside an orchestrator).

- `/healthz` (liveness) answers 200 while the loop keeps stepping. The loop only blocks inside
  bounded waits (a commit riding out a broker outage gives up after its budget,
  workers/runtime/checkpointing.py COMMIT_TIMEOUT_S), so a loop silent for longer than
  LIVENESS_STALL_S is wedged, and restarting the process is the cure. A broker outage is not:
  restarting a worker does not bring a broker back, so the bound sits above every such wait.
- `/readyz` (readiness) answers 200 once the worker has joined its group and restored every
  partition it was assigned (the changelog read back, input resumed), and 503 while it restores
  again after a rebalance or an abort. A member the group gave nothing (more workers than
  partitions) is ready: it is a hot spare, and a rolling update must not wait on it.

Updating the state costs one assignment per loop step, nothing when no endpoint is served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

# Longer than the longest bounded wait of the loop (a commit's 120 s retry budget, then the
# abort's) with room for a slow restore step, so only a truly wedged loop fails the probe.
LIVENESS_STALL_S = 300.0

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class Health:
    """What the probes report; set by the worker loop, read by the HTTP server's threads."""

    def __init__(self, stall_s: float = LIVENESS_STALL_S) -> None:
        self.stall_s = stall_s
        self._last_step = time.monotonic()
        self._ready = False
        self._detail = "not yet assigned partitions by the group"

    def step(self) -> None:
        """The loop made a step (called once per step: a float store)."""
        self._last_step = time.monotonic()

    def set_ready(self, ready: bool, detail: str) -> None:
        self._ready = ready
        self._detail = detail

    def live(self) -> tuple[bool, str]:
        silent = time.monotonic() - self._last_step
        if silent > self.stall_s:
            return False, f"the worker loop has not stepped for {silent:.0f} s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        return self._ready, self._detail


def app(registry: CollectorRegistry, health: Health) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: /healthz, /readyz from `health`, everything else /metrics of `registry`."""
    metrics = make_wsgi_app(registry)
    probes = {"/healthz": health.live, "/readyz": health.ready}

    def serve(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics(environ, start_response)
        ok, detail = probe()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{detail}\n".encode()]

    return serve


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Probes every few seconds would flood the worker's log."""


def serve(port: int, host: str, registry: CollectorRegistry, health: Health) -> None:
    """Serve /metrics, /healthz and /readyz on `host:port` from a daemon thread."""
    server = make_server(
        host, port, app(registry, health), _ThreadingServer, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, daemon=True, name="detok-http").start()
