"""The publisher's event core (issue 31 item 1): seq numbering, keys, coalescing, prompt tails,
record-size splitting, logprob layout and the request life checks, without a broker."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decode_state import PROMPT_CONTEXT_IDS
from schemas.validation import parse_event
from workers.io.publish.events import RequestEvents, RequestStateError
from workers.kafka.topics import RECORD_OVERHEAD_BYTES


class Records:
    """A sink that keeps every record, checking each against the worker's own parser."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, dict, int]] = []

    def __call__(self, key: bytes, value: bytes, seq: int) -> None:
        assert not isinstance(parse_event(value), Exception), value
        self.sent.append((key, json.loads(value), seq))

    def events(self, request_id: str) -> list[dict]:
        return [event for _, event, _ in self.sent if event["request_id"] == request_id]


def test_events_are_numbered_and_keyed_per_request() -> None:
    sink = Records()
    events = RequestEvents(sink, coalesce=False)
    events.open("a", "m", [1, 2])
    events.open("b", "m", [3])
    events.append("a", [10])
    events.append("b", [20, 21])
    events.append("a", [11, 12])
    events.finish("b", "length")
    events.finish("a", "stop")
    assert [(e["type"], e["seq"]) for e in sink.events("a")] == [
        ("prompt", 0), ("tokens", 1), ("tokens", 2), ("finish", 3)
    ]  # fmt: skip
    assert [(e["type"], e["seq"]) for e in sink.events("b")] == [
        ("prompt", 0), ("tokens", 1), ("finish", 2)
    ]  # fmt: skip
    assert all(key == event["request_id"].encode() for key, event, _ in sink.sent)
    assert all(seq == event["seq"] for _, event, seq in sink.sent)
    assert sink.events("a")[-1]["finish_reason"] == "stop"


def test_coalescing_buffers_appends_until_flush_or_finish() -> None:
    sink = Records()
    events = RequestEvents(sink)
    events.open("a", "m", [1])
    events.open("b", "m", [1])
    for token in range(5):
        events.append("a", [token])
        events.append("b", [100 + token])
    assert len(sink.sent) == 2  # the prompts only
    assert events.flush() == 10
    events.append("a", [5, 6])
    events.finish("a")
    events.finish("b")
    assert [e.get("token_ids") for e in sink.events("a")] == [None, [0, 1, 2, 3, 4], [5, 6], None]
    assert [e["seq"] for e in sink.events("a")] == [0, 1, 2, 3]
    assert [e.get("token_ids") for e in sink.events("b")] == [None, [100, 101, 102, 103, 104], None]
    assert events.flush() == 0 and len(events) == 0


def test_append_many_is_append_for_each_pair() -> None:
    one, many = Records(), Records()
    for sink, batched in ((one, False), (many, True)):
        events = RequestEvents(sink)
        for request_id in "abc":
            events.open(request_id, "m", [1])
        steps = [[("a", [1]), ("b", [2, 3]), ("c", [])], [("a", [4]), ("c", [5])]]
        for step in steps:
            if batched:
                events.append_many(step)
            else:
                for request_id, ids in step:
                    events.append(request_id, ids)
        events.flush()
    assert many.sent == one.sent


def test_a_change_of_logprob_layout_starts_a_new_event() -> None:
    sink = Records()
    events = RequestEvents(sink)
    events.open("a", "m", [1])
    events.append("a", [1, 2], logprobs=[-0.1, -0.2])
    events.append("a", [3], logprobs=[-0.3])
    events.append("a", [4])
    events.append("a", [5], logprobs=[-0.5], top_logprobs=[[(5, -0.5), (6, -1.0)]])
    events.finish("a")
    tokens = [e for e in sink.events("a") if e["type"] == "tokens"]
    assert [(t["token_ids"], t.get("logprobs"), t.get("top_logprobs")) for t in tokens] == [
        ([1, 2, 3], [-0.1, -0.2, -0.3], None),
        ([4], None, None),
        ([5], [-0.5], [[[5, -0.5], [6, -1.0]]]),
    ]


def test_a_coalesced_event_over_the_record_limit_is_split_until_it_fits() -> None:
    sink = Records()
    limit = 2_000
    events = RequestEvents(sink, max_record_bytes=limit)
    events.open("a", "m", [1])
    ids = list(range(100_000, 100_500))  # ~3.5 KB of JSON
    for token in ids:
        events.append("a", [token])
    events.finish("a")
    tokens = [e for e in sink.events("a") if e["type"] == "tokens"]
    assert len(tokens) > 1
    assert [t for e in tokens for t in e["token_ids"]] == ids
    assert [e["seq"] for e in sink.events("a")] == list(range(len(tokens) + 2))
    sizes = [len(json.dumps(e, separators=(",", ":"))) + 1 + RECORD_OVERHEAD_BYTES for e in tokens]
    assert max(sizes) <= limit


def test_without_coalescing_an_append_is_one_event_whatever_its_size() -> None:
    """Replay's cut is the caller's: an oversized chunk is sent whole for the broker to refuse
    (and the publisher to report), as `detok replay` always did."""
    sink = Records()
    events = RequestEvents(sink, coalesce=False, max_record_bytes=2_000)
    events.open("a", "m", [1])
    events.append("a", list(range(100_000, 100_500)))
    assert len(sink.events("a")) == 2


def test_a_prompt_over_the_limit_goes_as_its_tail(caplog: pytest.LogCaptureFixture) -> None:
    sink = Records()
    events = RequestEvents(sink, max_record_bytes=100_000)
    with caplog.at_level(logging.INFO, logger="detok.publish"):
        events.open("huge", "m", list(range(50_000)), stop=["\n"])
        events.open("small", "m", list(range(100)))
    huge, small = sink.events("huge")[0], sink.events("small")[0]
    assert huge["prompt_token_ids"] == list(range(50_000 - PROMPT_CONTEXT_IDS, 50_000))
    assert huge["prompt_tokens"] == 50_000 and huge["stop"] == ["\n"]
    assert small["prompt_token_ids"] == list(range(100)) and small["prompt_tokens"] is None
    assert "request huge: prompt of 50000 ids" in caplog.text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_the_tools_a_request_offers_go_in_its_prompt_event_whole_or_tail() -> None:
    sink = Records()
    events = RequestEvents(sink, max_record_bytes=100_000)
    events.open("chat", "m", [1, 2], tools=[WEATHER])
    events.open("huge", "m", list(range(50_000)), tools=[WEATHER])
    events.open("plain", "m", [3])
    # The event writes every field of a function, the ones not given as null.
    offered = [{"type": "function", "function": {**WEATHER["function"], "strict": None}}]
    assert sink.events("chat")[0]["tools"] == offered
    assert sink.events("huge")[0]["tools"] == sink.events("chat")[0]["tools"]
    assert sink.events("huge")[0]["prompt_tokens"] == 50_000
    assert sink.events("plain")[0]["tools"] is None


def test_prompt_tail_sends_every_longer_prompt_as_its_tail() -> None:
    sink = Records()
    events = RequestEvents(sink, prompt_tail=8)
    events.open("a", "m", list(range(20)))
    events.open("b", "m", list(range(5)), prompt_tokens=900)
    assert sink.events("a")[0]["prompt_token_ids"] == list(range(12, 20))
    assert sink.events("a")[0]["prompt_tokens"] == 20
    assert sink.events("b")[0]["prompt_token_ids"] == list(range(5))
    assert sink.events("b")[0]["prompt_tokens"] == 900


def test_abandon_closes_a_request_without_sending_its_buffer() -> None:
    """A request the worker ended (a stop signal): nothing more goes out for it, its buffered
    ids included, and its id may not be appended to; other requests go on."""
    sink = Records()
    events = RequestEvents(sink)
    events.open("a", "m", [1])
    events.open("b", "m", [1])
    events.append("a", [5, 6])
    events.append("b", [7])
    assert events.abandon("a") is True
    assert "a" not in events and "b" in events
    assert events.abandon("a") is False  # not open any more: costs nothing
    events.flush()
    assert [e["type"] for e in sink.events("a")] == ["prompt"]
    assert [e.get("token_ids") for e in sink.events("b")] == [None, [7]]
    with pytest.raises(RequestStateError):
        events.append("a", [8])


def test_calls_outside_a_request_life_are_refused_before_sending() -> None:
    sink = Records()
    events = RequestEvents(sink)
    with pytest.raises(RequestStateError):
        events.append("a", [1])
    events.open("a", "m", [1])
    with pytest.raises(RequestStateError):
        events.open("a", "m", [1])
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 ids"):
        events.append("a", [1, 2], logprobs=[-1.0])
    events.finish("a")
    with pytest.raises(RequestStateError):
        events.finish("a")
    assert len(sink.sent) == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt_token_ids": [-1]},
        {"prompt_token_ids": [2**32]},
        {"stop": []},
        {"stop": ["x" * 1025]},
        {"prompt_tokens": 0},
        {"model": ""},
        {"tools": []},
        {"tools": [{"type": "function", "function": {"name": ""}}]},
        {"tools": [{"type": "tool", "function": {"name": "f"}}]},
        {"tools": [{"type": "function", "function": {"name": "f"}}] * 129},
    ],
)
def test_a_prompt_outside_the_schema_is_refused(bad: dict) -> None:
    sink = Records()
    fields = {"request_id": "a", "model": "m", "prompt_token_ids": [1, 2], **bad}
    with pytest.raises(msgspec.ValidationError):
        RequestEvents(sink).open(
            fields.pop("request_id"), fields.pop("model"), fields.pop("prompt_token_ids"), **fields
        )
    assert sink.sent == []


@settings(max_examples=60, deadline=None)
@given(
    appends=st.lists(st.lists(st.integers(0, 50_000), max_size=6), max_size=30),
    flush_after=st.sets(st.integers(0, 30)),
)
def test_any_appends_and_flushes_send_the_ids_in_order_with_contiguous_seqs(
    appends: list[list[int]], flush_after: set[int]
) -> None:
    sink = Records()
    events = RequestEvents(sink)
    events.open("a", "m", [1])
    for index, ids in enumerate(appends):
        events.append("a", ids)
        if index in flush_after:
            events.flush()
    events.finish("a")
    sent = sink.events("a")
    assert [e["seq"] for e in sent] == list(range(len(sent)))
    assert [t for e in sent if e["type"] == "tokens" for t in e["token_ids"]] == [
        t for ids in appends for t in ids
    ]
    assert all(e["token_ids"] for e in sent if e["type"] == "tokens")
