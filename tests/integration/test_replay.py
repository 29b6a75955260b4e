"""`detok replay` checks delivery (issue 16 #7): a missing topic or an event over the topic's
`max.message.bytes` ends in exit 1 with a count, never in a false success or a traceback, and the
events that fit are delivered. A prompt over the limit is no such event: it goes as its tail
(issue 15 item 1; end to end in test_prompt_tails.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import REPO_ROOT
from tests.integration.conftest import unique_name
from tests.integration.worker_harness import read_topic
from workers.io.replay import replay

pytestmark = pytest.mark.integration


def detok(*arguments: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *arguments, "--bootstrap-servers", bootstrap],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap},
        timeout=180,  # the command bounds its own waits (metadata 15 s, delivery 60 s)
        check=False,
    )


def write_generations(
    path: Path, prompts: dict[str, int], outputs: dict[str, int] | None = None
) -> Path:
    """One logged generation per request id, with a prompt of the given number of ids and four
    generated ids unless `outputs` says otherwise (chunk size 2: prompt, tokens, tokens, finish)."""
    outputs = outputs or {}
    lines = [
        json.dumps(
            {"request_id": request_id, "model": "m", "prompt_token_ids": [15496] * length,
             "output_token_ids": [1, 2, 3, 4] * (outputs.get(request_id, 4) // 4)}
        )
        for request_id, length in prompts.items()
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def request_ids_on(bootstrap: str, topic: str) -> list[str]:
    return [key.decode() for key, _, _ in read_topic(bootstrap, topic)]


def test_replay_to_a_missing_topic_says_so(kafka_bootstrap: str, tmp_path: Path) -> None:
    source = write_generations(tmp_path / "in.jsonl", {"a": 3})
    result = detok("replay", "--input", str(source), "--topic", unique_name("absent"),
                   bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert "replayed" not in result.stdout


def test_a_topic_created_a_moment_after_replay_asks_is_used_not_called_missing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """`detok topics ensure` returns once one broker of a cluster shows the new topic; the broker
    `replay` asks next may learn of it a moment later. Here the topic appears 1 s after `replay`
    first asks: it asks again, then delivers, instead of saying the topic does not exist."""
    source = write_generations(tmp_path / "in.jsonl", {"a": 3, "b": 5})
    topic = unique_name("late")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def create() -> None:
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)

    creator = threading.Timer(1.0, create)
    creator.start()
    try:
        totals = replay(kafka_bootstrap, source, topic, chunk_size=2, progress=False)
    finally:
        creator.join()
    assert (totals.requests, totals.events) == (2, 8)  # prompt, two chunks of 2, finish
    assert sorted(request_ids_on(kafka_bootstrap, topic)) == ["a"] * 4 + ["b"] * 4


def test_an_event_over_the_topic_limit_is_counted_and_its_batch_mates_arrive(
    kafka_bootstrap: str, create_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = create_topic("small-limit", partitions=1, config={"max.message.bytes": "20000"})
    prompts = {f"r{i:02d}": 10 for i in range(20)}
    # r10's one tokens event is ~50 KB of JSON: over the topic's limit (a prompt would be sent
    # as its tail instead).
    source = write_generations(tmp_path / "in.jsonl", prompts, outputs={"r10": 10_000})
    result = detok("replay", "--input", str(source), "--chunk-size", "10000", "--topic", topic,
                   bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 of 60 records not delivered (MSG_SIZE_TOO_LARGE=1)" in result.stderr
    assert "Traceback" not in result.stderr
    delivered = request_ids_on(kafka_bootstrap, topic)
    assert len(delivered) == 59
    assert {rid: delivered.count(rid) for rid in prompts} == {
        rid: 2 if rid == "r10" else 3 for rid in prompts
    }


def test_a_500k_id_prompt_goes_as_its_tail_with_the_count(
    kafka_bootstrap: str, create_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = create_topic("default-limit", partitions=1)
    source = write_generations(tmp_path / "in.jsonl", {"huge": 500_000, "small": 5})
    result = detok("replay", "--input", str(source), "--chunk-size", "2", "--topic", topic,
                   bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "request huge: prompt of 500000 ids" in result.stderr
    assert "sending its last 64 ids with prompt_tokens=500000" in result.stderr
    records = {json.loads(v)["request_id"]: json.loads(v) for _, v, _ in read_topic(
        kafka_bootstrap, topic) if json.loads(v)["type"] == "prompt"}  # fmt: skip
    assert records["huge"]["prompt_token_ids"] == [15496] * 64
    assert records["huge"]["prompt_tokens"] == 500_000
    assert records["small"]["prompt_tokens"] is None


def test_prompt_tail_flag_sends_tails(
    kafka_bootstrap: str, create_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = create_topic("tails", partitions=1)
    source = write_generations(tmp_path / "in.jsonl", {"long": 1000, "short": 5})
    result = detok("replay", "--input", str(source), "--prompt-tail", "64", "--topic", topic,
                   bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, topic)]
    sent = {r["request_id"]: r for r in records if r["type"] == "prompt"}
    assert len(sent["long"]["prompt_token_ids"]) == 64 and sent["long"]["prompt_tokens"] == 1000
    assert len(sent["short"]["prompt_token_ids"]) == 5 and sent["short"]["prompt_tokens"] is None


def test_collect_from_a_missing_topic_says_so(kafka_bootstrap: str, tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    result = detok("collect", "--topic", unique_name("absent"), "--output", str(output),
                   bootstrap=kafka_bootstrap)  # fmt: skip
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not output.exists()
