"""A real Prometheus server scraping a real worker: what it stores is what the worker did.

Prometheus (Debian's package, installed by `deploy/install-prometheus.sh`) runs on 127.0.0.1 with
a temporary data directory and a 1 s scrape interval, scraping one `detok worker` subprocess that
decodes replayed generations. Asserted through the Prometheus HTTP API: the decoded-token and
filtered-prompt-id counters equal what `detok run` decoded and filtered; and every expression of
the Grafana dashboards is valid PromQL that the server evaluates to data.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, missing_resource
from tests.integration.conftest import WAIT_BOUND_S
from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    stop,
)
from workers.io.replay import replay

pytestmark = pytest.mark.integration

DASHBOARDS = sorted((REPO_ROOT / "deploy" / "grafana" / "dashboards").rglob("*.json"))
# Grafana's variables, as Grafana would expand them for a 5-minute view of all workers.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$instance": ".*"}
HTTP_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def api(base: str, path: str, **params: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:  # a 400 for bad PromQL carries its error as JSON
        body = json.load(error)
    return body


def query(base: str, promql: str) -> list[dict]:
    body = api(base, "/api/v1/query", query=promql)
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def wait_for(description: str, condition) -> None:
    """Poll until `condition()` is true; fail (never skip) past the wait bound."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{description}: not reached within {WAIT_BOUND_S:.0f} s")
        time.sleep(POLL_INTERVAL_S)


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        missing_resource("no prometheus binary on PATH (deploy/install-prometheus.sh installs it)")
    return binary


def start_prometheus(binary: str, metrics_port: int, tmp_path: Path) -> tuple:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"  # short: the test waits on scrapes, and 1 s is the minimum
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: detok-workers\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture
def prometheus_and_worker(
    prometheus_binary: str, pipeline_run: NewPipelineRun, tmp_path: Path
) -> Iterator[tuple[str, dict[str, dict], int]]:
    """A worker decoding replayed generations, and a Prometheus scraping it.
    Yields (Prometheus URL, the oracle's completions, records replayed)."""
    run = pipeline_run(make_generations(200, seed=41))
    metrics_port = free_port()
    worker = run.start_worker(
        "prom-1", extra=["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    )
    prometheus, base = start_prometheus(prometheus_binary, metrics_port, tmp_path)
    try:
        wait_for("Prometheus ready", lambda: _ready(base, prometheus))
        records = replay(run.bootstrap, run.source, run.names.input, progress=False).events
        yield base, run.expected, records
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=WAIT_BOUND_S)
        assert stop(worker) == 0


def _ready(base: str, process: subprocess.Popen) -> bool:
    if process.poll() is not None:
        pytest.fail(f"prometheus exited with {process.returncode}")
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=HTTP_TIMEOUT_S) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_all_consumed(base: str, records: int) -> None:
    """Until Prometheus has scraped the worker with every replayed record consumed.

    The worker counts decoded tokens and filtered ids before it counts the records they came
    from, and one scrape is one consistent read: once a scrape shows every record consumed, the
    same scrape holds the final counts.
    """

    def scraped_everything() -> bool:
        result = query(base, "sum(detok_records_consumed_total)")
        return bool(result) and float(result[0]["value"][1]) >= records

    wait_for("Prometheus scraped every record consumed", scraped_everything)


def test_prometheus_stores_the_decoded_and_filtered_counts_that_were_sent(
    prometheus_and_worker: tuple[str, dict[str, dict], int],
) -> None:
    base, expected, records = prometheus_and_worker
    wait_until_all_consumed(base, records)
    assert query(base, 'up{job="detok-workers"}')[0]["value"][1] == "1"
    assert query(base, 'sum(detok_transactions_total{outcome="aborted"})')[0]["value"][1] == "0"

    decoded = query(base, "sum(detok_generated_tokens_decoded_total)")
    assert int(float(decoded[0]["value"][1])) == sum(
        c["generated_tokens"] for c in expected.values()
    )

    want_filtered = Counter({"gpt2": 0, "qwen2": 0})
    for completion in expected.values():
        want_filtered[completion["model"]] += len(completion["filtered_prompt_ids"])
    assert want_filtered["qwen2"] > 0  # the generations carry out-of-vocab qwen2 prompt ids
    filtered = {
        series["metric"]["model"]: int(float(series["value"][1]))
        for series in query(base, "sum by (model) (detok_prompt_ids_filtered_total)")
    }
    assert filtered == dict(want_filtered)

    events = {
        series["metric"]["type"]: int(float(series["value"][1]))
        for series in query(base, "sum by (type) (detok_events_consumed_total)")
    }
    assert events["prompt"] == events["finish"] == len(expected)
    assert sum(events.values()) == records


def test_every_dashboard_expression_evaluates_on_a_real_prometheus(
    prometheus_and_worker: tuple[str, dict[str, dict], int],
) -> None:
    base, _, records = prometheus_and_worker
    wait_until_all_consumed(base, records)
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expression = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expression = expression.replace(variable, value)
                body = api(base, "/api/v1/query", query=expression)
                assert body["status"] == "success", (path.name, panel["title"], body)
