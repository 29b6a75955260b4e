"""examples/engine_publish.py end to end (issue 31 items 1 and 4): the scripted engine streams its
requests through `AsyncPublisher` at a steady rate, stop strings firing mid-generation, and a
real worker's completions equal `detok run` on the engine's own log, with no dead letters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, real_tokenizer_path
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    assert_deltas_cover_exactly_once,
    completions_on,
    offline_completions,
    oracle_registry,
    pipeline_topics,
    read_topic,
    start_worker,
    wait_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_engine_example_publishes_what_detok_run_decodes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    log = tmp_path / "engine.jsonl"
    engine = subprocess.run(
        [sys.executable, "examples/engine_publish.py", "--bootstrap-servers", kafka_bootstrap,
         "--topic", names.input, "--tokenizer", str(real_tokenizer_path("gpt2")),
         "--model", "gpt2", "--requests", "12", "--rate", "400", "--log", str(log)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=WAIT_BOUND_S * 2, check=False,
    )  # fmt: skip
    assert engine.returncode == 0, engine.stderr
    assert "published 12 requests" in engine.stderr

    expected = offline_completions(log, oracle_registry())
    stopped = [c for c in expected.values() if c["stop_reason"] is not None]
    assert stopped, "no stop string fired: the example no longer shows one"
    worker = start_worker(kafka_bootstrap, names, unique_name("g"), instance_id="engine",
                          extra=["--exit-when-idle", "3"], log_dir=tmp_path)  # fmt: skip
    assert wait_exit(worker) == 0
    completions = completions_on(kafka_bootstrap, names)
    assert completions == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
    assert list(read_topic(kafka_bootstrap, names.dead_letters)) == []
    tokens_events = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, names.input)]
    assert {e["type"] for e in tokens_events} == {"prompt", "tokens", "finish"}
