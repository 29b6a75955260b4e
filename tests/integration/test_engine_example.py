"""examples/ end to end (issue 31 items 1, 2 and 4): the scripted engine streams its requests
through `AsyncPublisher` at a steady rate, stop strings firing mid-generation, and a real worker's
completions equal `detok run` on the engine's own log, with no dead letters; run together with a
worker and examples/follow_requests.py, the engine aborts each stopped request on its stop
signal and the reader shows every request's text. Every process is stopped by pid."""

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
    stop,
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
         "--topic", names.input, "--control-topic", names.control,
         "--tokenizer", str(real_tokenizer_path("gpt2")), "--model", "gpt2",
         "--requests", "12", "--rate", "400", "--log", str(log)],
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


def test_the_engine_aborts_on_stop_signals_while_a_reader_follows(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The three processes of examples/ at once, as in production: a worker, the reader
    following every request, the engine publishing and listening for stop signals. Each
    request with a stop string is aborted by the engine on its signal (its script runs to
    --max-tokens, far past the stop: without the signal it would have finished instead), the
    completions equal `detok run` on the engine's script, and the reader saw each request's
    whole text."""
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    log, summary, followed = tmp_path / "engine.jsonl", tmp_path / "s.json", tmp_path / "f.jsonl"
    processes = []
    try:
        worker = start_worker(kafka_bootstrap, names, unique_name("g"), instance_id="live",
                              extra=["--commit-interval-ms", "100"], log_dir=tmp_path)  # fmt: skip
        processes.append(worker)
        reader = subprocess.Popen(
            [sys.executable, "examples/follow_requests.py", "--bootstrap-servers",
             kafka_bootstrap, "--deltas-topic", names.deltas, "--completions-topic",
             names.completions, "--count", "12", "--json", str(followed)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        processes.append(reader)
        engine = subprocess.run(
            [sys.executable, "examples/engine_publish.py", "--bootstrap-servers",
             kafka_bootstrap, "--topic", names.input, "--control-topic", names.control,
             "--tokenizer", str(real_tokenizer_path("gpt2")), "--model", "gpt2",
             "--requests", "12", "--rate", "100", "--max-tokens", "3000", "--log", str(log),
             "--summary", str(summary)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=WAIT_BOUND_S * 2, check=False,
        )  # fmt: skip
        assert engine.returncode == 0, engine.stderr
        out, err = reader.communicate(timeout=WAIT_BOUND_S)
        assert reader.returncode == 0, err
        assert stop(worker) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    expected = offline_completions(log, oracle_registry())
    stopped = {r for r, c in expected.items() if c["stop_reason"] is not None}
    assert len(stopped) >= 3, "the example must stop requests mid-generation"
    aborted = json.loads(summary.read_text())["aborted"]
    assert set(aborted) == stopped
    assert all(aborted[r] == expected[r]["generated_tokens"] for r in stopped)
    assert completions_on(kafka_bootstrap, names) == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
    assert list(read_topic(kafka_bootstrap, names.dead_letters)) == []
    signals = [key.decode() for key, _, _ in read_topic(kafka_bootstrap, names.control)]
    assert sorted(signals) == sorted(stopped)
    texts = {line["request_id"]: line["text"] for line in map(json.loads, followed.open())}
    assert texts == {r: c["text"] for r, c in expected.items()}
    assert all(f"{r} = ok (stop string" in out for r in stopped)
