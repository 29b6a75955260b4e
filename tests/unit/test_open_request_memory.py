"""A million open requests at most 1 KB each (issue 15): the memory of a live open request.

A live request starts with shared empty containers (its text parts, held events, logprob
columns and entries, its stream's held text and filtered ids) and gets its own on first use
(`pipeline.request_state.ActiveRequest`, 'Memory'). Two things must hold: a prompt-only request
stays small, and sharing never leaks: requests interleaved in one processor, with commits in
between, publish exactly what each publishes alone in a processor of its own, whatever they
hold, append, stop or record.
"""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.request_state import NO_HELD, ActiveRequest, HeldEvent
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import ParsedEvent, ParsedPrompt, ParsedTokens
from tests.unit.request_events import bytes_registry, finish, ids, origin, prompt, run
from tests.unit.test_lazy_restore import WORDS

# A prompt-only request's own objects on the byte-level tokenizer, measured by tracemalloc:
# its state (~250 B), its stream and window (~150 B), its id and its entry in the processor's
# map. 1,000 B before its empty containers were shared; the worker adds its owner map entry
# and allocator overhead on top (bench/bench_shapes.py measures the whole: target 1 KB).
PROMPT_ONLY_BUDGET = 600


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def test_a_prompt_only_request_stays_within_its_budget(registry) -> None:
    processor = RequestProcessor(registry)
    processor.warm_up()  # the tokenizer's decode tables are the model's, not any request's
    count = 2_000
    prompts = [
        (prompt(f"open-{n:06d}", f"Hello there {n}"), origin(n, timestamp_ms=1_000))
        for n in range(count)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        processor.process(prompts, 2.0)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del prompts
    assert processor.active_requests == count
    assert grown / count <= PROMPT_ONLY_BUDGET, f"{grown / count:.0f} B per open request"


def test_the_shared_held_events_refuse_an_insertion() -> None:
    with pytest.raises(TypeError):
        NO_HELD[2] = None  # type: ignore[index]


def test_holding_an_event_gives_the_request_a_dict_of_its_own(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, prompt("a"), prompt("b"))
    event = ParsedTokens(request_id="a", seq=2, token_ids=ids("x"))
    state = processor.requests["a"]
    assert type(state) is ActiveRequest
    state.hold(2, HeldEvent(event, origin(1)))
    other = processor.requests["b"]
    assert type(other) is ActiveRequest
    assert list(state.held) == [2] and not other.held and other.held is NO_HELD


REQUESTS = ["a", "b", "c"]


@st.composite
def request_events(draw: st.DrawFn, request_id: str) -> list[ParsedEvent]:
    """One request: a prompt (maybe with a stop string), chunks (maybe with logprobs: then
    all of them), maybe a finish."""
    stop = draw(st.sampled_from([None, ["o w"], ["\n"]]))
    out: list[ParsedEvent] = [
        ParsedPrompt(request_id=request_id, model="bytes", prompt_token_ids=ids("Hi"), stop=stop)
    ]
    with_logprobs = draw(st.booleans())
    chunks = draw(st.lists(st.text(alphabet="".join(WORDS), max_size=4), max_size=5))
    for seq, text in enumerate(chunks, start=1):
        token_ids = ids(text)
        logprobs = [-0.5] * len(token_ids) if with_logprobs else None
        out.append(
            ParsedTokens(request_id=request_id, seq=seq, token_ids=token_ids, logprobs=logprobs)
        )
    if draw(st.booleans()):
        out.append(finish(len(chunks) + 1, request_id))
    return out


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[dict[str, list[ParsedEvent]], list[list[ParsedEvent]]]:
    """Each request's events (the next two now and then swapped, so one is held) and all of
    them interleaved into batches."""
    own = {r: draw(request_events(r)) for r in REQUESTS[: draw(st.integers(2, len(REQUESTS)))]}
    for events in own.values():
        if len(events) > 2 and draw(st.booleans()):
            events[1], events[2] = events[2], events[1]
    queues = {r: list(events) for r, events in own.items()}
    merged: list[ParsedEvent] = []
    while any(queues.values()):
        request_id = draw(st.sampled_from([r for r, q in queues.items() if q]))
        merged.append(queues[request_id].pop(0))
    cuts = sorted(draw(st.lists(st.integers(0, len(merged)), max_size=5)))
    batches = [merged[a:b] for a, b in zip([0, *cuts], [*cuts, len(merged)], strict=True)]
    return own, batches


def outputs(
    processor: RequestProcessor, batches: list[list[ParsedEvent]], offsets: dict[int, int]
) -> dict[str, list]:
    """Per request, what the batches make the worker publish, with a commit after each.
    Each event's origin is its own record at its offset in `offsets` (by event identity)."""
    out: dict[str, list] = {}
    for batch in batches:
        result = processor.process([(e, origin(offsets[id(e)], e)) for e in batch], 1.0)
        for delta in result.deltas:
            out.setdefault(delta.request_id, []).append(delta)
        for completion in result.completions:
            out.setdefault(completion.request_id, []).append(completion)
        for letter in result.dead_letters:
            out.setdefault(letter.request_id, []).append((letter.reason, letter.message))
        for request_id in sorted(result.touched):
            records = processor.changelog_records(request_id)
            out.setdefault(request_id, []).append([value for _, value in records])
    return out


@settings(max_examples=120, deadline=None)
@given(interleavings())
def test_requests_sharing_empty_containers_publish_what_each_does_alone(
    registry, interleaving
) -> None:
    own, batches = interleaving
    offsets = {id(e): n for n, e in enumerate(e for batch in batches for e in batch)}
    together = outputs(RequestProcessor(registry), batches, offsets)
    for request_id in own:
        # The same batches, with only this request's events: the same deltas and commits.
        alone_batches = [[e for e in batch if e.request_id == request_id] for batch in batches]
        alone = outputs(RequestProcessor(registry), alone_batches, offsets)
        assert together.get(request_id) == alone.get(request_id)
