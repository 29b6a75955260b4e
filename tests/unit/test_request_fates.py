"""Property (issue 32): under mixed hostile input, every request that opened gets exactly one
completion, and every record has one fate.

Requests with and without decode options (stop strings, logprobs), unknown models, orphans,
reordered, duplicated and lost events, empty tokens events without logprobs in logprob
requests, events with large headers, commits with restores from the compacted changelog, and
TTL sweeps with a producer clock that lags; a finite input's end (`flush_incomplete`) last.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.results import BatchResult, EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt, ParsedTokens, encode_event
from tests.unit.fake_records import FakeMessage
from tests.unit.request_events import bytes_registry, ids
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest

TTL = 50.0
# A changelog that takes 64 KB records, and the held-bytes bound a worker derives from it.
CHANGELOG_LIMIT = 64_000
MAX_HELD_BYTES = CHANGELOG_LIMIT // 4
BIG_HEADER = (("trace", b"h" * 12_000),)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


@st.composite
def request_events(draw: st.DrawFn, request_id: str) -> tuple[list[ParsedEvent], int | None]:
    """One request's events as its producer sends them, and the seq it lost (if any)."""
    kind = draw(st.sampled_from(["plain", "stop", "logprobs", "unknown"]))
    events: list[ParsedEvent] = [
        ParsedPrompt(
            request_id=request_id,
            model="nope" if kind == "unknown" else "bytes",
            prompt_token_ids=ids("Hi"),
            stop=["ab"] if kind == "stop" else None,
        )
    ]
    for text in draw(st.lists(st.text(alphabet="abc\u20ac", max_size=4), max_size=5)):
        token_ids = ids(text)
        with_logprobs = kind == "logprobs" and (token_ids or draw(st.booleans()))
        events.append(
            ParsedTokens(
                request_id=request_id,
                seq=len(events),
                token_ids=token_ids,
                logprobs=[-1.0] * len(token_ids) if with_logprobs else None,
                top_logprobs=[[(i, -2.0)] for i in token_ids] if with_logprobs else None,
            )
        )
    if draw(st.booleans()):
        events.append(ParsedFinish(request_id=request_id, seq=len(events)))
    lost = None
    if len(events) > 2 and draw(st.integers(0, 3)) == 0:
        lost = draw(st.integers(1, len(events) - 1))
        events = [e for e in events if getattr(e, "seq", 0) != lost]
    return events, lost


@st.composite
def scenarios(draw: st.DrawFn):
    streams, losses = {}, {}
    for index in range(draw(st.integers(1, 4))):
        request_id = f"r{index}"
        streams[request_id], losses[request_id] = draw(request_events(request_id))
    # Orphans: events of a request whose prompt never comes.
    orphans = [ParsedTokens(request_id="orphan", seq=1, token_ids=[97])] * draw(st.integers(0, 1))
    pending = {r: list(e) for r, e in streams.items()}
    records: list[tuple[ParsedEvent, bool]] = [(e, False) for e in orphans]
    while any(pending.values()):
        request_id = draw(st.sampled_from(sorted(r for r, e in pending.items() if e)))
        stream = pending[request_id]
        if len(stream) > 2 and draw(st.integers(0, 3)) == 0:
            stream[1], stream[2] = stream[2], stream[1]  # reordered: one is held
        event = stream.pop(0)
        records.append((event, draw(st.integers(0, 4)) == 0))  # some with large headers
        if draw(st.integers(0, 5)) == 0:
            records.append((event, False))  # a duplicate
    cuts = sorted(draw(st.lists(st.integers(0, len(records)), max_size=5)))
    bounds = list(zip([0, *cuts], [*cuts, len(records)], strict=True))
    actions = draw(
        st.lists(
            st.sampled_from(["on", "restore", "sweep"]), min_size=len(bounds), max_size=len(bounds)
        )
    )
    return streams, losses, records, bounds, actions


def commit(processor: RequestProcessor, log: dict) -> None:
    """What a commit writes to the changelog; every record fits the changelog's limit."""
    for request_id in list(processor.requests) + list(processor.retired_segments):
        for key, value in processor.changelog_records(request_id):
            assert len(value or b"") <= CHANGELOG_LIMIT, f"{key!r}: {len(value)} bytes"
            log[key] = value


def restored(registry: TokenizerRegistry, processor: RequestProcessor, log: dict) -> tuple:
    commit(processor, log)
    latest = {k: FakeMessage(v, k, [(PROCESSED_OFFSET_HEADER, b"0")], 0) for k, v in log.items()}
    fresh = RequestProcessor(registry, request_ttl_s=TTL, max_held_bytes=MAX_HELD_BYTES)
    outcome = apply_latest(latest, fresh, None)
    assert not outcome.failed
    return fresh, outcome.failed_requests


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_every_opened_request_completes_once_and_every_record_has_one_fate(
    registry, scenario
) -> None:
    streams, losses, records, bounds, actions = scenario
    processor = RequestProcessor(registry, request_ttl_s=TTL, max_held_bytes=MAX_HELD_BYTES)
    log: dict[bytes, bytes | None] = {}
    results: list[BatchResult] = []
    origins = [
        EventOrigin(
            "t",
            0,
            offset,
            encode_event(event),
            headers=BIG_HEADER if big else (),
            timestamp_ms=0,  # a producer whose clock is far behind: record times say nothing
        )
        for offset, (event, big) in enumerate(records)
    ]
    now = 1_000_000.0
    for (start, end), action in zip(bounds, actions, strict=True):
        now += 1.0  # batches a second apart: no request is idle for the TTL before the end
        batch = [(records[i][0], origins[i]) for i in range(start, end)]
        results.append(processor.process(batch, now))
        commit(processor, log)
        if action == "restore":
            processor, failed = restored(registry, processor, log)
            results.append(failed)
        elif action == "sweep":
            swept = processor.expire(now + 1.0, latest=now + 1.0)
            assert swept.completions == [], "a live request expired by its records' clock"
            results.append(swept)
    results.append(processor.flush_incomplete())

    completions = Counter(c.request_id for r in results for c in r.completions)
    letters = [d for r in results for d in r.dead_letters]
    expired_at_prompt = {
        d.request_id for d in letters if d.reason is DeadLetterReason.TTL_EXPIRED and d.seq == 1
    }
    for request_id, events in streams.items():
        opened = events[0].model == "bytes"
        if not opened:
            assert completions[request_id] == 0
        elif request_id in expired_at_prompt:
            # Ended after its prompt alone: a ttl_expired dead letter, no completion (a late
            # duplicate prompt must not replace an earlier `ok`; `expiry.expire_active`).
            assert completions[request_id] == 0
        else:
            assert completions[request_id] == 1, f"{request_id}: {completions[request_id]}"

    # One fate per record: never dead-lettered twice; and a record that can never be decoded
    # (after a seq its request lost) is dead-lettered, unless it is a second copy (a duplicate)
    # or came after a stop string ended the request.
    lettered = Counter(d.origin.offset for d in letters if d.origin is not None)
    assert all(count == 1 for count in lettered.values()), lettered
    seen: set[tuple[str, int]] = set()
    for offset, (event, _) in enumerate(records):
        key = (event.request_id, getattr(event, "seq", 0))
        first = key not in seen
        seen.add(key)
        lost = losses.get(event.request_id)
        stopped = any(
            c.request_id == event.request_id and c.stop_reason
            for r in results
            for c in r.completions
        )
        if event.request_id == "orphan" or (lost is not None and key[1] > lost and first):
            assert offset in lettered or stopped, f"record {offset} {key} has no fate"
