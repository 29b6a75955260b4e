"""`detok demo` end to end, on the session's broker with a small sample: it passes its own checks
(completions equal `detok run`'s, Prometheus counters equal the oracle's) and cleans up its topics.
CI also runs the full-size demo (`.ci/run`); this keeps the command covered by `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.conftest import REPO_ROOT, SHARED_DIR, real_tokenizer_path
from tests.integration.conftest import WAIT_BOUND_S

pytestmark = pytest.mark.integration


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "demo", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        # The demo's own waits are bounded; this only turns a hang of the whole command into a
        # failure: tokenizer loading, the oracle and two of its bounded waits.
        timeout=4 * WAIT_BOUND_S,
        check=False,
    )


def test_demo_passes_its_checks_and_deletes_its_topics(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    real_tokenizer_path("gpt2")
    real_tokenizer_path("qwen2-from-tiktoken")
    finished = run_demo(
        "--bootstrap-servers", kafka_bootstrap,
        "--shared-dir", str(SHARED_DIR),
        "--requests", "150",
        "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert finished.returncode == 0, finished.stdout + finished.stderr
    summary = finished.stdout
    assert "result            PASS" in summary
    assert "FAIL" not in summary
    assert "filtered ids      gpt2=0 in 0 requests, qwen2=" in summary
    assert "strict_decode_failure=1" in summary
    assert "malformed_json=1" in summary
    (run_dir,) = tmp_path.iterdir()
    # Offline output is in input order, collected output in request-id order; same lines.
    offline = (run_dir / "completions.offline.jsonl").read_text().splitlines()
    assert sorted(offline) == sorted((run_dir / "completions.kafka.jsonl").read_text().splitlines())
    topics = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30).topics
    assert not [name for name in topics if run_dir.name in name]


def test_demo_without_tokenizers_says_where_they_should_be(tmp_path: Path) -> None:
    finished = run_demo("--shared-dir", str(tmp_path / "nowhere"))
    assert finished.returncode == 2
    assert "tokenizer for gpt2 not found" in finished.stderr
    assert "--shared-dir" in finished.stderr and "--tokenizer gpt2=PATH" in finished.stderr
