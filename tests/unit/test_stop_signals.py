"""Stop signals (issue 31 item 2): the processor says which requests it ended before their finish
event (a stop string, a failure, the TTL), once each, and never for a request that finished.

The property test drives random requests through random batch cuts: whatever the cut, a request
gets a signal exactly when its completion (or its TTL expiry) came before its finish event was
consumed, at most one, with the completion's `generated_tokens`.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.results import BatchResult
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import StopSignal
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt
from tests.unit.request_events import bytes_registry, finish, ids, origin, prompt, run, tokens

UNKNOWN_ID = 15_000  # above the byte tokenizer's vocabulary, below the model's: a strict failure


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def stop_prompt(request_id: str, stop: list[str] | None) -> ParsedPrompt:
    return ParsedPrompt(request_id=request_id, model="bytes", prompt_token_ids=ids("Hi"), stop=stop)


def signals(result: BatchResult) -> list[tuple[str, str, int]]:
    return [(s.request_id, s.reason, s.generated_tokens) for s in result.stop_signals]


def test_a_stop_string_before_the_finish_is_signalled_with_the_ids_it_used(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt("r", ["STOP"]), tokens(1, "abc ST", "r"))
    assert signals(result) == []  # only held back so far
    result = run(processor, tokens(2, "OP and more", "r"))
    (completion,) = result.completions
    assert signals(result) == [("r", "stop_string", completion.generated_tokens)]
    assert completion.generated_tokens == len(ids("abc STOP"))
    (signal,) = result.stop_signals
    assert signal.model == "bytes" and signal.type == "stop"
    # The events the engine still sends produce nothing, and no second signal.
    later = run(processor, tokens(3, "x", "r"), finish(4, "r"))
    assert later.stop_signals == [] and later.events_after_stop == 2


def test_a_stop_in_the_chunk_of_the_finish_is_not_signalled(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt("r", ["STOP"]), tokens(1, "a STOP b", "r"), finish(2, "r"))
    assert result.completions[0].stop_reason == "STOP"
    assert result.stop_signals == []


def test_a_held_finish_counts_as_consumed(registry) -> None:
    """The stop completes in seq 1 while seq 3 (the finish) waits for seq 2: the engine has
    finished, so no signal."""
    processor = RequestProcessor(registry)
    run(processor, stop_prompt("r", ["STOP"]))
    result = processor.process(
        [(finish(3, "r"), origin(1)), (tokens(1, "a STOP", "r"), origin(2))], 0.0
    )
    assert result.completions[0].stop_reason == "STOP" and result.stop_signals == []


def test_a_normal_finish_is_never_signalled(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, stop_prompt("r", ["zz"]), tokens(1, "abc", "r"), finish(2, "r"))
    plain = run(processor, prompt("p"), tokens(1, "abc", "p"), finish(2, "p"))
    assert result.completions and plain.completions
    assert result.stop_signals == plain.stop_signals == []


def test_a_strict_decode_failure_is_signalled_unless_the_finish_came_with_it(registry) -> None:
    processor = RequestProcessor(registry)
    early = run(processor, prompt("a"), tokens(1, [*ids("ok "), UNKNOWN_ID, 65], "a"))
    assert early.completions[0].status == "failed"
    assert signals(early) == [("a", "strict_decode_failure", 3)]
    late = run(processor, prompt("b"), tokens(1, [65, UNKNOWN_ID], "b"), finish(2, "b"))
    assert late.completions[0].status == "failed" and late.stop_signals == []


def test_output_too_large_is_signalled(registry) -> None:
    processor = RequestProcessor(registry, max_text_bytes=10)
    result = run(processor, prompt("r"), tokens(1, "a" * 30, "r"))
    (completion,) = result.completions
    assert completion.status == "failed"
    assert signals(result) == [("r", "output_too_large", completion.generated_tokens)]


def test_a_sequence_gap_is_signalled(registry) -> None:
    processor = RequestProcessor(registry, max_held_bytes=1)
    run(processor, prompt("r"), tokens(1, "abc", "r"))
    result = run(processor, tokens(3, "x", "r"))  # seq 2 lost; one held event passes the bound
    assert [c.status for c in result.completions] == ["failed"]
    assert signals(result) == [("r", "sequence_gap", 3)]


def test_the_ttl_is_signalled_for_a_live_request_and_not_for_a_held_finish(registry) -> None:
    processor = RequestProcessor(registry, request_ttl_s=10.0)
    run(processor, prompt("idle"), tokens(1, "abc", "idle"))
    run(processor, prompt("quiet"))  # never got past its prompt: no completion, still a signal
    run(processor, prompt("gap"), tokens(1, "abc", "gap"), finish(3, "gap"))  # seq 2 lost
    result = processor.expire(100.0)
    assert sorted(signals(result)) == [("idle", "ttl_expired", 3), ("quiet", "ttl_expired", 0)]
    assert {c.request_id for c in result.completions} == {"idle", "gap"}


def test_a_restore_failure_of_a_live_head_is_signalled(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, prompt("r"), tokens(1, "abc", "r"))
    head = dict(processor.changelog_records("r"))[b"r"]
    fresh = RequestProcessor(registry)
    result = fresh.fail_restore("r", head, "the tokenizer is gone")
    assert [c.status for c in result.completions] == ["failed"]
    assert signals(result) == [("r", "restore_failed", 3)]


def test_signals_are_wire_records() -> None:
    signal = StopSignal(request_id="r", model="m", reason="stop_string", generated_tokens=4)
    assert StopSignal.model_validate_json(signal.model_dump_json()) == signal


# --- The rule under any batching --------------------------------------------------------------

TEXTS = st.text(alphabet="ab S", min_size=0, max_size=6)


@st.composite
def requests(draw: st.DrawFn) -> list[tuple[str, list[ParsedEvent]]]:
    """A few requests, each with or without a stop string, a bad id or a finish."""
    made = []
    for index in range(draw(st.integers(1, 4))):
        request_id = f"r{index}"
        stop = draw(st.sampled_from([None, ["S"], ["ab"]]))
        events: list[ParsedEvent] = [stop_prompt(request_id, stop)]
        for seq in range(1, draw(st.integers(1, 5)) + 1):
            token_ids = ids(draw(TEXTS))
            if draw(st.integers(0, 9)) == 0:
                token_ids.append(UNKNOWN_ID)
            events.append(tokens(seq, token_ids, request_id))
        if draw(st.booleans()):
            events.append(finish(len(events), request_id))
        made.append((request_id, events))
    return made


def interleaved(draw: st.DrawFn, made: list[tuple[str, list[ParsedEvent]]]) -> list[ParsedEvent]:
    """The requests' events merged in a random order that keeps each request's own order."""
    queues = [list(events) for _, events in made]
    merged = []
    while any(queues):
        queue = draw(st.sampled_from([q for q in queues if q]))
        merged.append(queue.pop(0))
    return merged


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_one_signal_exactly_for_requests_ended_before_their_finish(registry, data) -> None:
    made = data.draw(requests())
    events = interleaved(data.draw, made)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(events) - 1)), max_size=4)))
    processor = RequestProcessor(registry)
    total = BatchResult()
    ended_before_finish: set[str] = set()
    finish_consumed: set[str] = set()
    for start, end in zip([0, *cuts], [*cuts, len(events)], strict=True):
        batch = events[start:end]
        result = processor.process([(e, origin(i)) for i, e in enumerate(batch)], 0.0)
        finish_consumed |= {e.request_id for e in batch if type(e) is ParsedFinish}
        for completion in result.completions:
            if completion.request_id not in finish_consumed:
                ended_before_finish.add(completion.request_id)
        total.merge(result)
    signalled = [s.request_id for s in total.stop_signals]
    assert sorted(signalled) == sorted(ended_before_finish)
    completions = {c.request_id: c for c in total.completions}
    for signal in total.stop_signals:
        completion = completions[signal.request_id]
        assert completion.status == "failed" or completion.stop_reason is not None
        assert signal.generated_tokens == completion.generated_tokens
        expected = "stop_string" if completion.status == "ok" else "strict_decode_failure"
        assert signal.reason == expected
