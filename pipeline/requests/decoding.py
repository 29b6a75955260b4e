"""Decoding: one batched round per input batch, and one way from a chunk's text to outcomes.

Every request with in-order events this batch is decoded here, on one path. A request's decode
options choose its text stages (`pipeline.stages`), and a request pays only for the stages it
has: a request without options goes whole into the batched round and through `_advance` with
one test per stage. Logprobs push a chunk id by id (each token's text is part of its entry);
stop strings keep a copy of the stream from before the chunk, replayed id by id only for the
chunk in which a stop completes, to find the token that completed it.

Adding a text stage: its module in `pipeline/stages/`, its snapshot field in
`pipeline.request_state._ActiveFields`, and its line in `_advance` (and in `_stages_asked`
when it needs per-token texts or the stream from before the chunk).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.batch import ChunkResult, decode_round
from pipeline.decode_stream import (
    DecodeStream,
    InvalidTokenIdError,
    StrictDecodeError,
    push_each,
)
from pipeline.request_state import FinishedRequest, HeldEvent, json_size
from pipeline.requests import failures
from pipeline.requests.outcomes import Outcomes
from pipeline.requests.work import Work
from pipeline.results import BatchResult, Delta
from pipeline.stages import logprobs, stop_strings
from schemas.fast_events import ParsedFinish, ParsedTokens
from schemas.validation import is_record_fault

# (request, its chunk, its decode outcome, per-token texts or None, its stream before or None)
_Step = tuple[Work, list[int], ChunkResult, list[str] | None, DecodeStream | None]


class Decoder:
    """Decodes the batch's chunks and turns each into its request's outcomes."""

    def __init__(self, outcomes: Outcomes, max_text_bytes: int | None) -> None:
        self.outcomes = outcomes
        self.registry = outcomes.registry
        self.max_text_bytes = max_text_bytes  # see `RequestProcessor`

    def decode(self, work: Sequence[Work], result: BatchResult) -> None:
        """Decode every request's chunk: one batched round for the chunks pushed whole (those
        of requests whose stages need no per-token text), id by id for the others."""
        requests = self.outcomes.requests
        # Only requests still active get decoded: a gap overflow may have failed one meanwhile.
        plain: list[tuple[Work, list[int]]] = []
        staged: list[tuple[Work, list[int], DecodeStream | None]] = []
        singles: list[_Step] = []
        for entry in work:
            state = entry.state
            if requests.get(entry.request_id) is not state:
                continue
            if state.stop is None and (state.logprobs is False or not logprobs.wanted(entry)):
                plain.append((entry, _joined_ids(entry.events)))  # no stage: the fast path
                continue
            try:
                self._stages_asked(entry, staged, singles, result)
            except BaseException as error:  # as in `process`: this request only
                if not is_record_fault(error):
                    raise
                failures.fail_unexpected(self.outcomes, entry, error, result)
        batched = [(w, chunk, before) for w, chunk, before in staged]
        batched += [(w, chunk, None) for w, chunk in plain]
        try:
            outcomes = decode_round([(w.state.stream, chunk) for w, chunk, _ in batched])
        except BaseException as error:  # the round isolates streams; this fault is around them
            if not is_record_fault(error):
                raise
            for entry, _, _ in batched:
                failures.fail_unexpected(self.outcomes, entry, error, result)
            return
        steps: list[_Step] = [
            (w, c, o, None, before) for (w, c, before), o in zip(batched, outcomes, strict=True)
        ]
        # Requests with stages first, then the rest: the order results have always come in.
        steps[len(staged) : len(staged)] = singles
        for entry, chunk, outcome, texts, before in steps:
            try:
                self._advance(entry, chunk, outcome, texts, before, result)
            except BaseException as unexpected:  # as in `process`: this request only
                if not is_record_fault(unexpected):
                    raise
                failures.fail_unexpected(self.outcomes, entry, unexpected, result)

    def _stages_asked(
        self,
        entry: Work,
        staged: list[tuple[Work, list[int], DecodeStream | None]],
        singles: list[_Step],
        result: BatchResult,
    ) -> None:
        """What a request's stages need of its decode: logprobs push the chunk id by id (into
        `singles`, decoded here); stop strings a copy of the stream before the chunk (into
        `staged`, for the batched round). A chunk whose logprobs are unusable fails here."""
        fault = logprobs.check(self.registry, entry)
        if fault is not None:
            failures.fail_on_event(self.outcomes, entry, *fault, result)
            return
        chunk = _joined_ids(entry.events)
        stream = entry.state.stream
        if entry.state.logprobs:
            texts: list[str] = []
            try:
                push_each(stream, chunk, texts)
                outcome = ChunkResult("".join(texts))
            except (StrictDecodeError, InvalidTokenIdError) as error:
                outcome = ChunkResult("".join(texts), error)
            singles.append((entry, chunk, outcome, texts, None))
        else:
            staged.append((entry, chunk, stream.clone()))  # type: ignore[arg-type]

    def _advance(
        self,
        entry: Work,
        chunk: list[int],
        outcome: ChunkResult,
        texts: list[str] | None,
        before: DecodeStream | None,
        result: BatchResult,
    ) -> None:
        """A chunk's decoded text into its request: its stages (logprobs recorded, a stop
        found or text held back for one), then the delta, and at the finish the completion."""
        out = self.outcomes
        state = entry.state
        error = outcome.error
        if error is not None and not isinstance(error, StrictDecodeError | InvalidTokenIdError):
            failures.fail_unexpected(out, entry, error, result)
            return
        text = outcome.text
        pushed = len(chunk)
        if error is not None:
            bad_id = getattr(error, "token_id", None)
            pushed = chunk.index(bad_id) if bad_id in chunk else 0
        last = entry.events[-1].event
        finished = error is None and type(last) is ParsedFinish
        if finished:
            text += state.stream.flush()
        if chunk and state.logprobs is None:
            state.logprobs = False  # its first ids came without logprobs: see `wanted`
        if state.logprobs:
            logprobs.record(state, entry.events, pushed, texts or [])
        matcher = None
        if state.stop is not None:
            matcher = stop_strings.scanner(state)
            match = matcher.scan(state.stop_held, text)  # type: ignore[union-attr]
            if match is not None:
                stop_strings.stop(out, entry, chunk, pushed, text, texts, before, match, result)
                return
        if error is not None:
            failures.fail_decode(out, entry, chunk, text, error, result)  # type: ignore[arg-type]
            return
        state.generated_tokens += pushed
        result.decoded_tokens += pushed
        limit = self.max_text_bytes
        size = None  # encoded once: the limit check and the running size share it
        if limit is not None:
            size = json_size(text)
            if state.text_size + size > limit:
                failures.fail_too_large(out, entry, text, result)
                return
        state.add_text(text, size)
        published = text
        if matcher is not None:
            published = stop_strings.hold_back(state, matcher, state.stop_held + text, finished)
        out.filtered_ids(entry.request_id, state, result)
        entries = None
        if state.logprobs:
            entries = logprobs.new_entries(self.registry, state, finished, state.text_chars)
        if published or finished or entries:
            offset = state.text_chars - len(state.stop_held) - len(published)
            result.deltas.append(
                Delta(
                    entry.request_id,
                    state.model,
                    state.delta_start,
                    last.seq,
                    offset,
                    published,
                    finished,
                    entries,
                )
            )
            state.delta_start = last.seq + 1
        if finished:
            result.completions.append(
                out.completion(entry.request_id, state, "ok", last.finish_reason)
            )
            marker = FinishedRequest(last_seq=last.seq, last_event_at=state.last_event_at)
            out.close(entry.request_id, state, marker, result)


def _joined_ids(events: Sequence[HeldEvent]) -> list[int]:
    """The generated ids of a request's in-order events, as one chunk (list extends, no
    per-id Python loop: this runs for every active request of every batch)."""
    ids: list[int] = []
    for held in events:
        if type(held.event) is ParsedTokens:
            ids += held.event.token_ids
    return ids
