"""Faults and bounds of the request lifecycle (issue 16, processor side).

Each test names the issue-16 item it covers. The byte-level test tokenizer makes every text plain
bytes arithmetic (see `tests.unit.request_events`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decode_byte_level import ByteLevelStream
from pipeline.decode_reference import ReferenceStream
from pipeline.decode_spm import SpmByteFallbackStream
from pipeline.decode_stream import DecodeStream
from pipeline.processor import RequestProcessor
from pipeline.request_state import json_size
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import ParsedEvent, ParsedPrompt
from tests.unit.request_events import (
    bytes_registry,
    finish,
    origin,
    prompt,
    reasons,
    run,
    run_records,
    tokens,
)
from tests.unit.small_tokenizers import UNKNOWN_ID


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def broken_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """Streams whose id is in the yielded set raise from `push` (a decoder bug)."""
    broken: set[int] = set()

    def breaking(method):
        def wrapper(self: DecodeStream, token_ids):
            if id(self) in broken:
                raise RuntimeError("decoder bug")
            return method(self, token_ids)

        return wrapper

    # Each decode strategy is a DecodeStream subclass with its own `push` (and the reference
    # one's `push_steps`): break them where they are defined.
    for cls in (ReferenceStream, ByteLevelStream, SpmByteFallbackStream):
        for name in ("push", "push_steps"):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, breaking(vars(cls)[name]))
    yield broken


def test_a_decoder_exception_fails_only_its_request(registry, broken_stream) -> None:
    # Item 1: any exception while decoding one request is isolated to that request.
    processor = RequestProcessor(registry)
    run(processor, prompt("a"), prompt("bad"), prompt("c"), tokens(1, "so far", "bad"))
    broken_stream.add(id(processor.requests["bad"].stream))
    result = run(
        processor,
        tokens(1, "A", "a"),
        tokens(2, "x", "bad"),
        tokens(4, "held", "bad"),
        finish(3, "bad"),
        tokens(1, "C", "c"),
        finish(2, "a"),
        finish(2, "c"),
    )
    assert sorted((c.request_id, c.status, c.text) for c in result.completions) == [
        ("a", "ok", "A"),
        ("bad", "failed", "so far"),
        ("c", "ok", "C"),
    ]
    failed = next(c for c in result.completions if c.request_id == "bad")
    assert failed.error == "RuntimeError: decoder bug"
    letters = [(d.reason.value, d.seq, d.error_class) for d in result.dead_letters]
    assert letters == [
        ("unexpected_error", 2, "RuntimeError"),
        ("unexpected_error", 3, "RuntimeError"),
        ("request_already_failed", 4, "SequenceError"),
    ]
    assert reasons(run(processor, tokens(5, "late", "bad"))) == ["request_already_failed"]


class PanicException(BaseException):
    """What pyo3 raises for a panic in a Rust extension (the real one is not importable)."""


@pytest.mark.parametrize(
    ("raised", "isolated"),
    [(PanicException("rust panic"), True), (KeyboardInterrupt(), False)],
)
def test_a_rust_panic_is_isolated_but_an_interrupt_is_not(
    registry, monkeypatch, raised: BaseException, isolated: bool
) -> None:
    processor = RequestProcessor(registry)
    real_init = DecodeStream.__init__

    def init(self, tokenizer, prompt_ids, **options):
        if list(prompt_ids) == list(b"boom"):
            raise raised
        real_init(self, tokenizer, prompt_ids, **options)

    monkeypatch.setattr(DecodeStream, "__init__", init)
    batch = [prompt("a"), prompt("bad", text="boom"), tokens(1, "A", "a"), finish(2, "a")]
    if not isolated:
        with pytest.raises(type(raised)):
            run(processor, *batch)
        return
    result = run(processor, *batch)
    assert [(c.request_id, c.status) for c in result.completions] == [("a", "ok")]
    assert [(d.reason.value, d.error_class) for d in result.dead_letters] == [
        ("unexpected_error", "PanicException")
    ]


def test_an_exception_while_sequencing_fails_only_its_request(registry, monkeypatch) -> None:
    # Item 1: a fault outside the decode (here: opening the stream) is isolated the same way.
    processor = RequestProcessor(registry)
    real_init = DecodeStream.__init__

    def init(self, tokenizer, prompt_ids, **options):
        if list(prompt_ids) == list(b"boom"):
            raise ValueError("cannot open")
        real_init(self, tokenizer, prompt_ids, **options)

    monkeypatch.setattr(DecodeStream, "__init__", init)
    result = run(
        processor,
        prompt("ok"),
        prompt("bad", text="boom"),
        tokens(1, "fine", "ok"),
        tokens(1, "x", "bad"),
        finish(2, "ok"),
    )
    assert [(c.request_id, c.text) for c in result.completions] == [("ok", "fine")]
    assert [(d.reason.value, d.error_class, d.message) for d in result.dead_letters] == [
        ("unexpected_error", "ValueError", "cannot open"),
        ("request_already_failed", "SequenceError", "request already failed (unexpected_error)"),
    ]


def test_text_past_max_text_bytes_fails_the_request_with_the_text_up_to_it(registry) -> None:
    # Item 2: a completion (and snapshot) carries the whole text; it must fit the topic.
    processor = RequestProcessor(registry, max_text_bytes=10)
    first = run(processor, prompt(), tokens(1, "1234567"), prompt("other"))
    over = run(processor, tokens(2, "é€x"), tokens(3, "more"), tokens(1, "fine", "other"))
    (completion,) = over.completions
    assert (completion.status, completion.text) == ("failed", "1234567é")
    assert "10 bytes" in completion.error
    assert reasons(over) == ["output_too_large"]
    letter = over.dead_letters[0]
    assert (letter.seq, letter.error_class) == (3, "OutputTooLargeError")
    deltas = [(d.request_id, d.text_offset, d.text, d.final) for d in first.deltas + over.deltas]
    assert deltas == [("r", 0, "1234567", False), ("r", 7, "é", True), ("other", 0, "fine", False)]
    assert reasons(run(processor, finish(4))) == ["request_already_failed"]


def test_held_events_past_max_held_bytes_fail_the_request_like_a_gap(registry) -> None:
    # Item 2: held events live in the snapshot until the gap closes; they must fit it too.
    processor = RequestProcessor(registry, max_held_bytes=500)
    first = run_records(processor, prompt(), tokens(2, "x" * 40))
    assert first.dead_letters == [] and processor.requests["r"].held_bytes > 200
    second = run_records(processor, tokens(3, "y" * 40), tokens(4, "z" * 40))
    assert reasons(second) == ["sequence_gap"] * 3
    (completion,) = second.completions
    assert completion.status == "failed" and "bytes" in completion.error


def test_a_prompt_that_failed_at_open_is_reopened_by_a_redrive(tmp_path: Path) -> None:
    # Item 8b: an unknown-model prompt redriven after the model is added must be decoded, not
    # counted as a duplicate of the failed request.
    registry = bytes_registry(tmp_path)
    processor = RequestProcessor(registry)
    first = run(processor, prompt("r", model="later"), tokens(1, "hi"), finish(2))
    assert reasons(first) == ["unknown_model", "request_already_failed", "request_already_failed"]
    registry.register("later", tmp_path / "tokenizer.json")
    redriven = run(processor, prompt("r", model="later"), tokens(1, "hi"), finish(2))
    assert redriven.dead_letters == [] and redriven.duplicates == 0
    assert [(c.status, c.text) for c in redriven.completions] == [("ok", "hi")]
    # A request that failed later, or finished, still counts its prompt as a duplicate.
    assert run(processor, prompt("r")).duplicates == 1
    out_of_range = ParsedPrompt(request_id="big", model="bytes", prompt_token_ids=[20_000])
    assert reasons(run(processor, out_of_range)) == ["token_id_out_of_range"]
    assert reasons(run(processor, prompt("big"), finish(1, "big"))) == []


def test_ttl_runs_on_event_time_so_a_backlog_does_not_expire_requests(registry) -> None:
    # Item 9: events stamped at t=1,000 s consumed at t=5,000 s (a lag past the TTL) are not
    # idle; a request idle for the TTL in event time still expires.
    processor = RequestProcessor(registry, request_ttl_s=60)
    stamped = {"timestamp_ms": 1_000_000}
    events = [prompt("lagging"), tokens(1, "a", "lagging"), prompt("idle"), tokens(1, "b", "idle")]
    run_records(processor, *events, now=5_000.0, **stamped)
    # The worker's reference for a partition that is not caught up: its newest record time.
    newest = {"lagging": 1_030.0, "idle": 1_030.0}
    assert processor.expire(lambda request_id: newest[request_id]).touched == set()
    later = [tokens(2, "c", "lagging"), finish(3, "lagging")]
    done = run_records(processor, *later, now=5_001.0, timestamp_ms=1_050_000)
    assert [(c.request_id, c.status, c.text) for c in done.completions] == [("lagging", "ok", "ac")]
    # Caught up: the reference is the wall clock, and "idle" was consumed at 5,000 s: idle
    # for the TTL from then (issue 32 item 3: its records' own times are not its clock).
    assert processor.expire(5_002.0).touched == set()
    expired = processor.expire(5_060.0)
    assert [(c.request_id, c.status) for c in expired.completions] == [("idle", "failed")]
    assert "ttl_expired" in reasons(expired)


def test_an_event_without_a_timestamp_or_from_the_future_counts_at_processing_time(
    registry,
) -> None:
    processor = RequestProcessor(registry, request_ttl_s=60)
    processor.process([(prompt(), origin(0, timestamp_ms=None))], now=500.0)
    assert processor.requests["r"].last_event_at == 500.0
    processor.process([(tokens(1, "x"), origin(1, timestamp_ms=10**15))], now=600.0)
    assert processor.requests["r"].last_event_at == 600.0


def test_a_late_prompt_after_retention_cannot_replace_the_completion(registry) -> None:
    # Item 10: the reopened request expires with a dead letter only, never a `failed` empty
    # completion that would replace the `ok` one in the compacted completions topic.
    processor = RequestProcessor(registry, request_ttl_s=60, finished_retention_s=10)
    done = run(processor, prompt(), tokens(1, "hi"), finish(2), now=100.0)
    assert [c.status for c in done.completions] == ["ok"]
    assert processor.expire(200.0).touched == {"r"}  # the finished marker is forgotten
    assert "r" not in processor.requests
    late = run(processor, prompt(), now=300.0)
    assert late.dead_letters == [] and "r" in processor.requests
    expired = processor.expire(400.0)
    assert expired.completions == []
    assert reasons(expired) == ["ttl_expired"]
    # A request that did get past its prompt still gets its failed completion.
    run(processor, prompt("partial"), tokens(1, "so", "partial"), now=500.0)
    (completion,) = processor.expire(600.0).completions
    assert (completion.request_id, completion.status, completion.text) == (
        "partial",
        "failed",
        "so",
    )


def test_expire_ends_at_most_limit_requests_per_call(registry) -> None:
    # Item 14: 200k requests expiring at once went out as one transaction.
    processor = RequestProcessor(registry, request_ttl_s=10, finished_retention_s=10)
    for n in range(5):
        run(processor, prompt(f"r{n}"), tokens(1, "x", f"r{n}"), now=0.0)
    run(processor, prompt("done"), finish(1, "done"), now=0.0)

    def sweep(at: float) -> list[int]:
        counts = []
        while touched := processor.expire(at, limit=2).touched:
            counts.append(len(touched))
        return counts

    # Five expiries and the finished marker forgotten; then the five failed markers.
    assert sweep(100.0) == [2, 2, 2]
    assert sum(type(s).__name__ == "FailedRequest" for s in processor.requests.values()) == 5
    assert sweep(200.0) == [2, 2, 1]
    assert processor.requests == {}


def test_forget_drops_state(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, prompt("a"), prompt("b"), prompt("c"), finish(1, "c"))
    processor.forget(["a", "c", "never-seen"])
    assert set(processor.requests) == {"b"}


def test_text_offsets_count_the_characters_before_each_delta(registry) -> None:
    # Contract 4: a reader dedups replayed deltas by (request_id, text_offset).
    processor = RequestProcessor(registry)
    deltas = [
        delta
        for batch in (
            [prompt(), tokens(1, "a€")],
            [tokens(2, list("😀".encode())[:2])],
            [tokens(3, list("😀".encode())[2:] + [98])],
            [finish(4)],
        )
        for delta in run(processor, *batch).deltas
    ]
    assert [(d.text_offset, d.text) for d in deltas] == [(0, "a€"), (2, "😀b"), (4, "")]


event_streams = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.one_of(
            st.tuples(st.just("prompt"), st.sampled_from(["bytes", "nope"])),
            st.tuples(
                st.just("tokens"),
                st.integers(1, 6),
                st.lists(
                    st.sampled_from([65, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, UNKNOWN_ID]), max_size=4
                ),
            ),
            st.tuples(st.just("finish"), st.integers(1, 6)),
        ),
    ),
    max_size=30,
)


def _event(request_id: str, spec: tuple) -> ParsedEvent:
    if spec[0] == "prompt":
        return prompt(request_id, model=spec[1])
    if spec[0] == "tokens":
        return tokens(spec[1], spec[2], request_id)
    return finish(spec[1], request_id)


@settings(max_examples=150, deadline=None)
@given(stream=event_streams, cuts=st.lists(st.integers(0, 30), max_size=5), short=st.booleans())
def test_any_event_stream_keeps_the_invariants(registry, stream, cuts, short) -> None:
    """Whatever the order and the batching: nothing raises, every snapshot restores to itself,
    each request's deltas are contiguous in text offsets up to its completion, and without
    expiries a request completes at most once."""
    ttl = {"request_ttl_s": 4, "finished_retention_s": 6} if short else {}
    processor = RequestProcessor(registry, max_text_bytes=12, max_held_bytes=400, **ttl)
    events = [_event(request_id, spec) for request_id, spec in stream]
    bounds = [0, *sorted(cuts), len(events)]
    offsets: dict[str, int] = {}
    completions: dict[str, int] = {}
    for start, end in zip(bounds, bounds[1:], strict=False):
        result = run_records(processor, *events[start:end], now=float(start))
        expired = processor.expire(float(start), limit=1)
        for delta in result.deltas + expired.deltas:
            assert delta.text_offset == offsets.get(delta.request_id, 0)
            offsets[delta.request_id] = delta.text_offset + len(delta.text)
        for completion in result.completions + expired.completions:
            completions[completion.request_id] = completions.get(completion.request_id, 0) + 1
            assert len(completion.text) == offsets.pop(completion.request_id, 0)
            assert json_size(completion.text) <= 12
        for request_id in result.touched | expired.touched:
            value = processor.snapshot(request_id)
            restored = RequestProcessor(registry)
            restored.restore(request_id, value)
            assert restored.snapshot(request_id) == value
    if not short:
        assert all(count == 1 for count in completions.values())


def test_replayed_deltas_rebuild_the_text_by_offset(registry) -> None:
    # Item 11 (processor side): after a crash, deltas for seqs 1..4 and then 1..14 overlap; a
    # reader that keeps, of each delta, the characters past those it has gets the text once.
    chunks = [list("a€b😀c".encode())[i : i + 2] for i in range(0, 12, 2)] + [[65]] * 8
    events = [tokens(seq, chunk) for seq, chunk in enumerate(chunks, start=1)]
    first = RequestProcessor(registry)
    run(first, prompt())
    checkpoint = first.snapshot("r")
    before_crash = [d for e in events[:4] for d in run(first, e).deltas]
    replayed = RequestProcessor(registry)
    replayed.restore("r", checkpoint)
    after = run(replayed, *events, finish(len(events) + 1))
    text = ""
    for delta in before_crash + after.deltas:
        assert delta.text_offset <= len(text)
        assert text[delta.text_offset :] == delta.text[: len(text) - delta.text_offset]
        text += delta.text[len(text) - delta.text_offset :]
    assert text == after.completions[0].text == "a€b😀c" + "A" * 8
