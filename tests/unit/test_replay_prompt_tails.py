"""`detok replay`'s prompt records (issue 15 item 1): whole prompts by default, tails with the
full count under `--prompt-tail N`, and the documented 64-id tail, logged, for a prompt whose
record would pass the producer's `message.max.bytes`."""

from __future__ import annotations

import json
import logging

import pytest

from pipeline.decode_stream import PROMPT_CONTEXT_IDS
from schemas.validation import parse_event
from workers.formats.jsonl import jsonl_records
from workers.io.replay import replay_events


def line(request_id: str, prompt_ids: int, **extra: object) -> bytes:
    return json.dumps(
        {"request_id": request_id, "model": "m", "prompt_token_ids": list(range(prompt_ids)),
         "output_token_ids": [1, 2, 3], **extra}
    ).encode()  # fmt: skip


def prompts(records: list[tuple[bytes | None, bytes]]) -> dict[str, dict]:
    events = [json.loads(value) for _, value in records]
    return {e["request_id"]: e for e in events if e["type"] == "prompt"}


def test_prompts_go_whole_by_default() -> None:
    records = list(replay_events(jsonl_records([line("a", 1000), line("b", 3)]), 2))
    sent = prompts(records)
    assert sent["a"]["prompt_token_ids"] == list(range(1000))
    assert sent["a"]["prompt_tokens"] is None
    assert all(not isinstance(parse_event(v), Exception) for _, v in records)


def test_prompt_tail_sends_the_last_n_ids_with_the_count() -> None:
    records = list(replay_events(jsonl_records([line("a", 1000), line("b", 3)]), 2, prompt_tail=64))
    sent = prompts(records)
    assert sent["a"]["prompt_token_ids"] == list(range(936, 1000))
    assert sent["a"]["prompt_tokens"] == 1000
    assert sent["b"]["prompt_token_ids"] == [0, 1, 2] and sent["b"]["prompt_tokens"] is None


def test_a_logged_tail_keeps_its_count() -> None:
    logged = line("a", 100, prompt_tokens=90_000)
    sent = prompts(list(replay_events(jsonl_records([logged]), 2, prompt_tail=64)))
    assert sent["a"]["prompt_tokens"] == 90_000 and len(sent["a"]["prompt_token_ids"]) == 64


def test_a_prompt_over_the_record_limit_goes_as_the_documented_tail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = [line("huge", 500_000), line("small", 100)]
    with caplog.at_level(logging.INFO, logger="detok.replay"):
        records = list(replay_events(jsonl_records(lines), 2, max_record_bytes=1_048_588))
    sent = prompts(records)
    assert sent["huge"]["prompt_token_ids"] == list(range(500_000 - PROMPT_CONTEXT_IDS, 500_000))
    assert sent["huge"]["prompt_tokens"] == 500_000
    assert sent["small"]["prompt_token_ids"] == list(range(100))
    assert all(len(value) < 1_048_588 for _, value in records)
    assert "request huge: prompt of 500000 ids" in caplog.text
    assert "sending its last 64 ids with prompt_tokens=500000" in caplog.text
