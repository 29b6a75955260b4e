"""The stop-strings stage: the text ends at the first stop string (docs/decode-options.md).

The request's scanner (`pipeline.stop_strings`: an Aho-Corasick automaton over the stop list,
its node kept between chunks, so the work is linear in the text) finds a stop in the held-back
tail plus the new text and says how much of the text may still begin one; this stage holds
that much back from deltas (`stop_held`) and, when a stop completes, ends the request at it:
the completion holds the text up to the stop, and the ids up to the one whose text completed
it. It keeps a copy of the stream from before each chunk, replayed id by id only for the chunk
in which a stop completes, to find that id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.decode_stream import push_each
from pipeline.request_state import ActiveRequest, FinishedRequest, HeldEvent, json_size
from pipeline.requests.failures import fail_too_large
from pipeline.requests.outcomes import Outcomes
from pipeline.requests.work import Work
from pipeline.results import BatchResult
from pipeline.stages.base import Chunk, StageConfig, StageKind, TextStage
from pipeline.stop_strings import StopMatch, StopScanner, scanner_for
from pipeline.tokenizer_registry import ModelTokenizer
from schemas.fast_events import ParsedFinish, ParsedPrompt, ParsedTokens


class StopStrings(TextStage, StageKind):
    """The stage of a request with stop strings (one per processor: its state is the
    request's `stop_held` and scanner)."""

    __slots__ = ()
    stream_before = True

    def __init__(self, config: StageConfig) -> None:
        pass

    def opened(self, event: ParsedPrompt, model: ModelTokenizer) -> Mapping[str, Any]:
        return {"stop": event.stop, "include_stop_str_in_output": event.include_stop_str_in_output}

    def choose(self, request_id: str, state: ActiveRequest, entry: Work | None) -> TextStage | None:
        return self if state.stop is not None else None

    def stops(self, state: ActiveRequest, text: str) -> StopMatch | None:
        found = state.stop_matcher or scanner(state)
        return found.scan(state.stop_held, text)  # type: ignore[union-attr]

    def end(self, out: Outcomes, chunk: Chunk, found: StopMatch, result: BatchResult) -> None:
        stop(out, chunk, found, result)

    def release(self, state: ActiveRequest, text: str, finished: bool) -> str:
        """What of the held tail plus `text` (just scanned without a stop) deltas may carry
        now: the rest may still begin a stop string, and waits in `stop_held` (nothing waits
        past the finish)."""
        published = state.stop_held + text
        state.stop_held = "" if finished else state.stop_matcher.held  # type: ignore[union-attr]
        return published[: len(published) - len(state.stop_held)]

    def holds(self, state: ActiveRequest) -> bool:
        return bool(state.stop_held)


def scanner(state: ActiveRequest) -> StopScanner | None:
    """The request's scanner, made on first use (over its stop list's cached matcher); None for
    a request without stop strings. It must scan every chunk, an empty one too."""
    found = state.stop_matcher
    if found is None and state.stop is not None:
        found = state.stop_matcher = scanner_for(state.stop)
    return found


def stop(out: Outcomes, chunk: Chunk, match: StopMatch, result: BatchResult) -> None:
    """A stop string completed in this chunk: publish the completion at the stop.

    The completion holds the text up to the stop string's start (its end with
    `include_stop_str_in_output`) and the ids up to the one whose text completed it; the
    chunk's later events are consumed as events after the stop. The request's other stages
    see only those ids (`decoded`) and that text (the final delta).
    """
    entry = chunk.entry
    state = entry.state
    held = state.stop_held
    base = state.text_chars - len(held)  # where `held + text` starts in the text
    end = base + match.end
    cut = base + (match.end if state.include_stop_str_in_output else match.start)
    pushed = chunk.pushed
    texts = chunk.texts
    if texts is None:
        texts = []
        if chunk.before is not None:
            # Up to the failing id, if any: the stop came before it.
            push_each(chunk.before, chunk.ids[:pushed], texts)
    completing, in_flush = _completing_token(state.text_chars, texts, end, pushed)
    whole = (state.text() + chunk.text)[:cut]
    limit = out.max_text_bytes
    if limit is not None and json_size(whole) > limit:
        for decoded in chunk.plan.decodes:
            decoded(state, chunk, pushed)
        fail_too_large(out, entry, chunk.text, result)
        return
    for decoded in chunk.plan.decodes:
        decoded(state, chunk, completing)
    state.generated_tokens += completing
    result.decoded_tokens += completing
    state.text_parts = [whole] if whole else ()
    state.text_chars = cut
    state.text_size = json_size(whole)
    state.stop_held = ""
    out.filtered_ids(entry.request_id, state, result)
    events = entry.events
    stopping = len(events) - 1 if in_flush else _event_of_token(events, completing)
    seq = events[stopping].event.seq
    out.publish(entry.request_id, state, seq, whole[base:], True, result, chunk.plan)
    completion = out.completion(
        entry.request_id, state, "ok", "stop", stop_reason=match.stop, plan=chunk.plan
    )
    result.completions.append(completion)
    result.events_after_stop += len(events) - 1 - stopping
    marker = FinishedRequest(
        last_seq=events[-1].event.seq,
        last_event_at=state.last_event_at,
        stopped=type(events[-1].event) is not ParsedFinish,
    )
    out.close(entry.request_id, state, marker, result)


def _completing_token(text_chars: int, texts: list[str], end: int, pushed: int) -> tuple[int, bool]:
    """How many ids of the chunk it takes for the text (`text_chars` before the chunk) to reach
    character `end` (the id whose text completed a stop, counted from 1), and whether only the
    finish flush reaches it (then every pushed id counts)."""
    reached = text_chars
    for index, text in enumerate(texts):
        reached += len(text)
        if reached >= end:
            return index + 1, False
    return pushed, True


def _event_of_token(events: Sequence[HeldEvent], count: int) -> int:
    """The index of the event holding the `count`-th id of the joined chunk (from 1); with no
    ids (count 0), the first event."""
    consumed = 0
    for index, held in enumerate(events):
        if type(held.event) is ParsedTokens:
            consumed += len(held.event.token_ids)
            if count <= consumed and consumed > 0:
                return index
    return len(events) - 1 if count else 0
