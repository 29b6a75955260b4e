"""Lazy restore (issue 15: a million open requests restored after kill -9 within 20 s).

A restore keeps an active request as its checked head (`RestoredRequest`) and rebuilds it only
when something needs it. Nothing may tell the two apart: over random event sequences with
commits and restores in between, a lazily restored processor publishes exactly what an eagerly
restored one does (every head decoded at once, as before), TTL expiries included; and a
head refused or accepted by the lazy check is refused or accepted by `decode_snapshot` alike,
with the same message.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import SnapshotError
from pipeline.processor import RequestProcessor
from pipeline.request_state import (
    ActiveRequest,
    RestoredRequest,
    decode_snapshot,
    encode_snapshot,
    rebuild,
    restore_state,
)
from pipeline.results import BatchResult
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import ParsedEvent
from tests.unit.fake_records import FakeMessage
from tests.unit.request_events import bytes_registry, finish, origin, prompt, tokens
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest

WORDS = ["Hello", " world", " 你好", " 👋🏽", " é", "\n", "\xe4", "\xbd"]
REQUESTS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def events_of(request_id: str, chunks: list[str], finished: bool) -> list[ParsedEvent]:
    out: list[ParsedEvent] = [prompt(request_id, "Hi \xe4")]
    out += [tokens(seq, text, request_id) for seq, text in enumerate(chunks, start=1)]
    if finished:
        out.append(finish(len(chunks) + 1, request_id))
    return out


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[list[ParsedEvent]], list[str]]:
    """Events of a few requests, interleaved, some swapped (held) or repeated, in batches; and
    after each batch an action: go on, commit, commit and restore, or sweep the TTL."""
    streams = [
        events_of(
            request_id,
            draw(st.lists(st.text(alphabet="".join(WORDS), max_size=4), max_size=5)),
            draw(st.booleans()),
        )
        for request_id in REQUESTS[: draw(st.integers(1, len(REQUESTS)))]
    ]
    events: list[ParsedEvent] = []
    while any(streams):
        stream = draw(st.sampled_from([s for s in streams if s]))
        # Now and then the next two events of a request arrive swapped: one is held.
        if len(stream) > 2 and draw(st.integers(0, 4)) == 0:
            stream[1], stream[2] = stream[2], stream[1]
        event = stream.pop(0)
        events.append(event)
        if draw(st.integers(0, 6)) == 0:
            events.append(event)  # a duplicate
    cuts = sorted(draw(st.lists(st.integers(0, len(events)), max_size=6)))
    batches = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]
    actions = draw(
        st.lists(
            st.sampled_from(["on", "commit", "restore", "sweep"]),
            min_size=len(batches),
            max_size=len(batches),
        )
    )
    return batches, actions


def published(result: BatchResult) -> tuple:
    """Everything a batch result makes the worker publish or count."""
    return (
        result.deltas,
        result.completions,
        result.filtered_ids,
        result.dead_letters,
        result.duplicates,
        result.decoded_tokens,
        sorted(result.touched),
    )


def commit(processor: RequestProcessor, log: dict[bytes, bytes | None]) -> None:
    for request_id in list(processor.requests) + list(processor.retired_segments):
        for key, value in processor.changelog_records(request_id):
            log[key] = value


class EagerProcessor(RequestProcessor):
    """A processor that restores as before restores were lazy: every head decoded at once."""

    def restore(self, request_id, snapshot, segments=None) -> None:
        if snapshot is None:
            self.requests.pop(request_id, None)
            return
        self.requests[request_id] = decode_snapshot(
            request_id, snapshot, self._tokenizer_of, segments
        )


def restored(
    registry: TokenizerRegistry, log: dict[bytes, bytes | None], kind: type = RequestProcessor
) -> RequestProcessor:
    latest = {
        key: FakeMessage(value, key, [(PROCESSED_OFFSET_HEADER, b"0")], 0)
        for key, value in log.items()
    }
    processor = kind(registry, request_ttl_s=50.0)
    assert not apply_latest(latest, processor, None).failed
    return processor


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_a_lazy_restore_publishes_exactly_what_an_eager_one_does(registry, scenario) -> None:
    batches, actions = scenario
    lazy = RequestProcessor(registry, request_ttl_s=50.0)
    full = RequestProcessor(registry, request_ttl_s=50.0)
    log: dict[bytes, bytes | None] = {}
    now = 1000.0
    offset = 0
    for batch, action in zip(batches, actions, strict=True):
        now += 30.0
        records = []
        for event in batch:
            records.append((event, origin(offset, event, timestamp_ms=int(now * 1000))))
            offset += 1
        assert published(lazy.process(records, now)) == published(full.process(records, now))
        if action == "sweep":
            assert published(lazy.expire(now + 40.0, latest=now + 40.0)) == published(
                full.expire(now + 40.0, latest=now + 40.0)
            )
        if action in ("commit", "restore"):
            commit(full, log)
            lazy_log: dict[bytes, bytes | None] = {}
            commit(lazy, lazy_log)
            assert {k: v for k, v in lazy_log.items() if k in log} == {k: log[k] for k in lazy_log}
        if action == "restore":
            lazy, full = restored(registry, log), restored(registry, log, EagerProcessor)
            assert not any(type(s) is RestoredRequest for s in full.requests.values())
            assert lazy.active_requests == full.active_requests
    assert published(lazy.flush_incomplete()) == published(full.flush_incomplete())


def open_head(registry: TokenizerRegistry, text: str = "Hi \xe4 there") -> bytes:
    """A prompt-only request's changelog head: the shape a million open requests have."""
    processor = RequestProcessor(registry)
    processor.process([(prompt("r", text), origin(0))], 5.0)
    ((key, head),) = processor.changelog_records("r")
    assert key == b"r" and head is not None
    return head


def test_an_open_request_is_kept_as_its_head_and_rebuilt_on_its_next_event(registry) -> None:
    head = open_head(registry)
    processor = RequestProcessor(registry)
    processor.restore("r", head)
    kept = processor.requests["r"]
    assert kept == RestoredRequest(head, "", 5.0)
    assert processor.active_requests == 1
    result = processor.process([(tokens(1, "ok"), origin(1))], 6.0)
    assert [d.text for d in result.deltas] == ["ok"]
    assert type(processor.requests["r"]) is ActiveRequest


def _outcome(call) -> tuple[str, object]:
    try:
        state = call()
    except SnapshotError as error:
        return "error", str(error)
    return "state", state


STREAM_FIELDS = [
    "version",
    "skip_special_tokens",
    "unknown_generated_ids",
    "ids",
    "prefix",
    "prefix_index",
    "started",
    "held",
    "filtered_prompt_ids",
]
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 2**33)
    | st.floats(allow_nan=False)
    | st.sampled_from(["", "x", "error", "skip"]),
    lambda children: st.lists(children, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(STREAM_FIELDS + ["model", "text_segments", "last_event_at", "kind"]),
    value=JSON_VALUES,
    drop=st.booleans(),
    segments=st.dictionaries(st.integers(0, 2), st.sampled_from([b"ab", b"\xff"]), max_size=3),
)
def test_the_lazy_check_refuses_and_accepts_what_decode_snapshot_does(
    registry, field, value, drop, segments
) -> None:
    data = json.loads(open_head(registry))
    target = data["state"]["stream"] if field in STREAM_FIELDS else data["state"]
    if drop:
        target.pop(field, None)
    else:
        target[field] = value
    head = msgspec.json.encode(data)
    tokenizer_of = lambda model: registry.get(model).tokenizer  # noqa: E731
    kind, eager_outcome = _outcome(lambda: decode_snapshot("r", head, tokenizer_of, segments))
    lazy_kind, lazy_outcome = _outcome(lambda: restore_state("r", head, tokenizer_of, segments))
    assert lazy_kind == kind
    if kind == "error":
        assert lazy_outcome == eager_outcome
        return
    if type(lazy_outcome) is RestoredRequest:
        lazy_outcome = rebuild("r", lazy_outcome, tokenizer_of)
    assert encode_snapshot(lazy_outcome) == encode_snapshot(eager_outcome)
