"""`detok collect` over what a compacted completions topic can hold besides completions (issue 32
items 9 and 10): a tombstone (a compacted delete), a value that is not a completion, and a
completion written before counts were bounded that Parquet's columns cannot hold. Each ended
every collect of the topic with a traceback; now each is skipped, counted, and the rest collected.
Budget: one topic, a dozen records, three in-process collects (~5 s)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from tests.integration.conftest import WAIT_BOUND_S
from workers.cli import main
from workers.formats.parquet import read_completions

pytestmark = pytest.mark.integration


def completion(request_id: str, text: str, prompt_tokens: int = 3) -> bytes:
    return json.dumps(
        {"type": "completion", "request_id": request_id, "model": "m", "text": text,
         "status": "ok", "prompt_tokens": prompt_tokens, "generated_tokens": 2}
    ).encode()  # fmt: skip


def collect(bootstrap: str, topic: str, output: Path, *extra: str) -> int:
    return main(["collect", "--bootstrap-servers", bootstrap, "--topic", topic,
                 "--output", str(output), "--timeout", "2", *extra])  # fmt: skip


def test_collect_skips_tombstones_and_records_it_cannot_use(
    kafka_bootstrap: str,
    create_topic: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = create_topic("completions", partitions=2, config={"cleanup.policy": "compact"})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    records: list[tuple[bytes, bytes | None]] = [
        (b"a", completion("a", "first")),
        (b"deleted", completion("deleted", "gone")),
        (b"deleted", None),  # the operator's delete of one request's completion
        (b"never-seen", None),  # a delete of a key with nothing before it
        (b"b", completion("b", "second")),
        (b"junk", b'{"not": "a completion"}'),
        (b"big", completion("big", "old", prompt_tokens=2**63)),
    ]
    for key, value in records:
        producer.produce(topic, value, key=key)
    assert producer.flush(WAIT_BOUND_S) == 0

    jsonl = tmp_path / "out.jsonl"
    assert collect(kafka_bootstrap, topic, jsonl) == 0
    out = capsys.readouterr().out
    assert "skipped 2 tombstones, 1 records that are not completions" in out
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    # JSON holds any count: the old completion is collected as it is.
    assert [(c["request_id"], c["text"]) for c in lines] == [
        ("a", "first"),
        ("b", "second"),
        ("big", "old"),
    ]

    parquet = tmp_path / "out.parquet"
    assert collect(kafka_bootstrap, topic, parquet) == 0
    captured = capsys.readouterr()
    assert "collected 2 completions" in captured.out
    assert "1 completions parquet cannot hold" in captured.out
    assert "request big: not writable as Parquet: OverflowError" in captured.err
    assert [(c.request_id, c.text) for c in read_completions(parquet)] == [
        ("a", "first"),
        ("b", "second"),
    ]
    # Three completions asked for, two written: the shortfall is the exit code's to tell.
    assert collect(kafka_bootstrap, topic, parquet, "--expect", "3") == 1
