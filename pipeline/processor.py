"""Events in, results out: the per-request lifecycle shared by `detok run` and the Kafka worker.

A request is a prompt (seq 0), generated-id chunks (seq 1, 2, ...) and a finish. The processor
applies the sequence rules, drives one batched decode round per input batch, and returns plain
results (`pipeline.results`): text deltas, completions, filtered-id records and dead letters. It
never sees Kafka: the caller hands it parsed events with an opaque `Origin` and ships whatever
comes back.

State lives in `RequestProcessor.requests` (request id -> `pipeline.request_state` record, or a
`RestoredRequest` not rebuilt since its restore); the worker snapshots the requests a batch
touched into its changelog (`snapshot`), rebuilds them after a crash or a rebalance
(`restore`), and drops those of a revoked partition (`forget`).

One rule holds throughout: whatever goes wrong with one request (a broken event, a decoder that
raises, an output past the broker's limit) ends that request, with a dead letter for each of its
events involved and a failed completion; the other requests of the batch go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer

from pipeline.batch import ChunkResult, decode_round
from pipeline.dead_letter_reasons import REASONS
from pipeline.decode_stream import (
    DecodeStream,
    InvalidTokenIdError,
    StrictDecodeError,
    push_each,
)
from pipeline.errors import SnapshotError
from pipeline.logprobs import build_entries, check_alternatives, logprobs_model
from pipeline.request_state import (
    ActiveRequest,
    FailedRequest,
    FinishedRequest,
    HeldEvent,
    RequestState,
    RestoredRequest,
    active_head_fields,
    encode_head,
    encode_snapshot,
    json_prefix,
    json_size,
    rebuild,
    restore_state,
    segment_key,
)
from pipeline.results import BatchResult, DeadLetter, Delta, EventOrigin, Origin
from pipeline.stop_strings import StopMatch, matcher_for
from pipeline.tokenizer_registry import TokenizerRegistry, UnknownModelError
from pipeline.vocab_tables import profile_for
from schemas.events import (
    Completion,
    DeadLetterReason,
    FilteredIdsRecord,
    TokenLogprob,
    encode_json,
)
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt, ParsedTokens
from schemas.validation import is_record_fault

# How many out-of-order events one request may hold while it waits for a missing seq. Producers
# that reorder do so by a few events (retries across partitions leaders); a request whose gap
# needs more than this is broken upstream, and holding more only grows memory and changelog.
MAX_HELD_EVENTS = 64


@dataclass
class _Work:
    """One active request's share of a batch: the in-order events to decode now."""

    request_id: str
    state: ActiveRequest
    events: list[HeldEvent] = field(default_factory=list)
    finished: bool = False  # the last of `events` is the request's finish


class RequestProcessor:
    """Applies the sequence rules and the decode to batches of events."""

    def __init__(
        self,
        registry: TokenizerRegistry,
        *,
        unknown_generated_ids: Literal["error", "skip"] = "error",
        request_ttl_s: float = 3600.0,
        finished_retention_s: float = 600.0,
        max_text_bytes: int | None = None,
        max_held_bytes: int | None = None,
    ) -> None:
        self.registry = registry
        self.unknown_generated_ids = unknown_generated_ids
        # An idle request is one whose producer died mid-generation; after this long nothing
        # will complete it, and holding its state forever would leak memory and changelog.
        self.request_ttl_s = request_ttl_s
        # Finished and failed markers only serve to classify late duplicates; a duplicate that
        # comes later than this is treated as a fresh event (see `_expire_active` for why a
        # late prompt reopening a finished request can no longer replace its completion).
        self.finished_retention_s = finished_retention_s
        # A request's text is carried whole by its completion and by each of its snapshots, so
        # it must fit the output topics' record size: past this many bytes (as JSON: UTF-8,
        # escapes included) the request fails (`output_too_large`) with the text up to the
        # limit. None: no limit.
        self.max_text_bytes = max_text_bytes
        # Held (out-of-order) events are stored in the request's snapshot until the gap closes;
        # past this many bytes of held records in one request, it fails like a gap that never
        # closes, before its snapshot outgrows the changelog's record size. None: no limit.
        self.max_held_bytes = max_held_bytes
        self.requests: dict[str, RequestState | RestoredRequest] = {}
        # Requests that ended since their last changelog records, with how many text segments
        # they had there: each segment key gets a tombstone (`changelog_records`).
        self.retired_segments: dict[str, int] = {}

    def warm_up(self) -> None:
        """Build every model's decode tables now rather than inside the first batch that needs
        them: that costs a few hundred ms per tokenizer, a latency spike nobody should see."""
        for name in self.registry.names:
            profile_for(self.registry.get(name).tokenizer)

    # -- the batch ----------------------------------------------------------------------------

    def process(self, batch: Iterable[tuple[ParsedEvent, Origin]], now: float = 0.0) -> BatchResult:
        """Sequence and decode one batch of events, consumed at `now` (the caller's clock).

        Each request's `last_event_at` is `now`: idleness is measured in the clock that
        consumed its events, never in its records' timestamps. A producer's clock is its own:
        one running minutes slow, or a replay that keeps the logged records' original
        CreateTime, made every live request of theirs look idle by that lag once its partition
        was caught up and the TTL sweep compared with the wall clock (issue 32 item 3).
        """
        result = BatchResult()
        work: dict[str, _Work] = {}
        counts = result.events_by_type
        at = now
        for event, origin in batch:
            counts[event.type] += 1
            try:
                self._sequence(event, origin, at, work, result)
            except BaseException as error:  # one request's fault must not end the batch
                if not is_record_fault(error):
                    raise
                self._fail_sequencing(event, origin, at, error, work, result)
        self._decode(list(work.values()), result)
        return result

    def _sequence(
        self,
        event: ParsedEvent,
        origin: Origin,
        at: float,
        work: dict[str, _Work],
        result: BatchResult,
    ) -> None:
        request_id = event.request_id
        state = self.requests.get(request_id)
        if type(state) is ActiveRequest and type(event) is not ParsedPrompt:
            # The common case first: the next event of a live request.
            if at > state.last_event_at:
                state.last_event_at = at
            self._sequence_active(request_id, state, event, origin, work, result)
            return
        if type(event) is ParsedPrompt:
            if state is None or (type(state) is FailedRequest and state.at_open):
                self._open(event, origin, at, result)
            else:
                result.duplicates += 1
            return
        if state is None:
            self._dead_letter(
                result,
                DeadLetterReason.MISSING_PROMPT,
                event,
                origin,
                "no prompt event was seen for this request",
            )
            return
        if type(state) is RestoredRequest:
            state = self._rebuilt(request_id, state)
        state.last_event_at = max(state.last_event_at, at)
        if isinstance(state, FailedRequest):
            self._dead_letter(
                result,
                DeadLetterReason.REQUEST_ALREADY_FAILED,
                event,
                origin,
                f"request already failed ({state.reason.value})",
            )
            result.touched.add(request_id)
            return
        if isinstance(state, FinishedRequest):
            if event.seq <= state.last_seq:
                result.duplicates += 1
            elif state.stopped:
                self._after_stop(request_id, state, event, result)
            else:
                self._dead_letter(
                    result,
                    DeadLetterReason.EVENT_AFTER_FINISH,
                    event,
                    origin,
                    f"seq {event.seq} after finish at seq {state.last_seq}",
                )
            return
        self._sequence_active(request_id, state, event, origin, work, result)

    def _sequence_active(
        self,
        request_id: str,
        state: ActiveRequest,
        event: ParsedTokens | ParsedFinish,
        origin: Origin,
        work: dict[str, _Work],
        result: BatchResult,
    ) -> None:
        result.touched.add(request_id)
        seq = event.seq
        next_seq = state.next_seq
        held = state.held
        if seq < next_seq or seq in held:
            result.duplicates += 1
            return
        entry = work.get(request_id)
        if entry is not None and entry.finished:
            # Finished earlier in this very batch; the marker replaces the state after decoding.
            self._dead_letter(
                result,
                DeadLetterReason.EVENT_AFTER_FINISH,
                event,
                origin,
                f"seq {seq} after finish at seq {entry.events[-1].event.seq}",
            )
            return
        if seq > next_seq:
            held = state.hold(seq, HeldEvent(event, origin))
            if len(held) > MAX_HELD_EVENTS or (
                self.max_held_bytes is not None and state.held_bytes > self.max_held_bytes
            ):
                self._fail_gap(request_id, state, work, result)
            return
        if entry is None:
            entry = work[request_id] = _Work(request_id, state)
        entry.events.append(HeldEvent(event, origin))
        next_seq += 1
        if type(event) is ParsedFinish:
            entry.finished = True
        # Events that were waiting for this one are now in order, up to a finish.
        while not entry.finished and next_seq in held:
            queued = held.pop(next_seq)
            state.held_bytes -= queued.size
            entry.events.append(queued)
            next_seq += 1
            entry.finished = type(queued.event) is ParsedFinish
        state.next_seq = next_seq

    def _open(self, event: ParsedPrompt, origin: Origin, at: float, result: BatchResult) -> None:
        request_id = event.request_id
        result.touched.add(request_id)
        try:
            model = self.registry.get(event.model)
        except UnknownModelError as error:
            self._dead_letter(result, DeadLetterReason.UNKNOWN_MODEL, event, origin, str(error))
            self.requests[request_id] = FailedRequest(
                model=event.model,
                reason=DeadLetterReason.UNKNOWN_MODEL,
                last_event_at=at,
                at_open=True,
            )
            return
        bad_id = model.first_out_of_range(event.prompt_token_ids)
        if bad_id is not None:
            self._dead_letter(
                result,
                DeadLetterReason.TOKEN_ID_OUT_OF_RANGE,
                event,
                origin,
                f"prompt token id {bad_id} is outside the model vocabulary "
                f"({model.model_vocab_size} ids)",
            )
            self.requests[request_id] = FailedRequest(
                model=event.model,
                reason=DeadLetterReason.TOKEN_ID_OUT_OF_RANGE,
                last_event_at=at,
                at_open=True,
            )
            return
        stream = DecodeStream(
            model.tokenizer,
            event.prompt_token_ids,
            skip_special_tokens=event.skip_special_tokens,
            unknown_generated_ids=self.unknown_generated_ids,
        )
        self.requests[request_id] = ActiveRequest(
            model=model.name,  # the registry's string: one per model, not one per request
            stream=stream,
            prompt_tokens=_prompt_tokens(event),
            last_event_at=at,
            stop=event.stop,
            include_stop_str_in_output=event.include_stop_str_in_output,
        )

    # -- decoding -----------------------------------------------------------------------------

    def _decode(self, work: Sequence[_Work], result: BatchResult) -> None:
        # Only requests still active get decoded: a gap overflow may have failed one meanwhile.
        work = [w for w in work if self.requests.get(w.request_id) is w.state]
        # Requests with decode options take their own path (`_decode_with_options`); the rest
        # pays one test each for them.
        optioned = [
            w
            for w in work
            if w.state.stop is not None or (w.state.logprobs is not False and _has_logprobs(w))
        ]
        if optioned:
            work = [w for w in work if w.state.stop is None and not _has_logprobs(w)]
            self._decode_with_options(optioned, result)
        chunks = [_joined_ids(w.events) for w in work]
        try:
            outcomes = decode_round(
                [(w.state.stream, chunk) for w, chunk in zip(work, chunks, strict=True)]
            )
        except BaseException as error:  # the round isolates streams; this fault is around them
            if not is_record_fault(error):
                raise
            for entry in work:
                self._fail_unexpected(entry, error, result)
            return
        for entry, chunk, outcome in zip(work, chunks, outcomes, strict=True):
            error = outcome.error
            try:
                if error is None:
                    self._advance(entry, chunk, outcome.text, result)
                elif isinstance(error, StrictDecodeError | InvalidTokenIdError):
                    self._fail_decode(entry, chunk, outcome.text, error, result)
                else:
                    self._fail_unexpected(entry, error, result)
            except BaseException as unexpected:  # as in `process`: this request only
                if not is_record_fault(unexpected):
                    raise
                self._fail_unexpected(entry, unexpected, result)

    def _advance(self, entry: _Work, chunk: list[int], text: str, result: BatchResult) -> None:
        state = entry.state
        last = entry.events[-1].event
        finished = type(last) is ParsedFinish
        if finished:
            text += state.stream.flush()
        if chunk and state.logprobs is None:
            state.logprobs = False  # its first ids came without logprobs: see `_has_logprobs`
        state.generated_tokens += len(chunk)
        result.decoded_tokens += len(chunk)
        limit = self.max_text_bytes
        size = None  # encoded once: the limit check and the running size share it
        if limit is not None:
            size = json_size(text)
            if state.text_size + size > limit:
                self._fail_too_large(entry, text, result)
                return
        offset = state.text_chars
        if text:
            state.add_text(text, size)
        self._maybe_filtered_ids(entry.request_id, state, result)
        if text or finished:
            result.deltas.append(
                Delta(
                    entry.request_id,
                    state.model,
                    state.delta_start,
                    last.seq,
                    offset,
                    text,
                    finished,
                )
            )
            state.delta_start = last.seq + 1
        if finished:
            result.completions.append(
                self._completion(entry.request_id, state, "ok", last.finish_reason)
            )
            marker = FinishedRequest(last_seq=last.seq, last_event_at=state.last_event_at)
            self._close(entry.request_id, state, marker, result)

    # -- decode options (docs/decode-options.md) ------------------------------------------------

    def _decode_with_options(self, work: list[_Work], result: BatchResult) -> None:
        """Decode requests with stop strings or logprobs.

        A logprob request pushes its chunk id by id: each token's text is part of its output.
        A request with only stop strings pushes its chunk whole, in the batched round like any
        other, keeping a copy of its stream from before: the copy is replayed id by id only for
        the chunk in which a stop completes, to find the token that completed it.
        """
        batched: list[tuple[_Work, list[int], DecodeStream]] = []
        singles: list[tuple[_Work, list[int], ChunkResult, list[str]]] = []
        for entry in work:
            try:
                if not self._check_logprobs(entry, result):
                    continue
                chunk = _joined_ids(entry.events)
                stream = entry.state.stream
                if entry.state.logprobs:
                    texts: list[str] = []
                    try:
                        push_each(stream, chunk, texts)
                        outcome = ChunkResult("".join(texts))
                    except (StrictDecodeError, InvalidTokenIdError) as error:
                        outcome = ChunkResult("".join(texts), error)
                    singles.append((entry, chunk, outcome, texts))
                else:
                    batched.append((entry, chunk, stream.clone()))  # type: ignore[arg-type]
            except BaseException as error:  # as in `process`: this request only
                if not is_record_fault(error):
                    raise
                self._fail_unexpected(entry, error, result)
        try:
            outcomes = decode_round([(w.state.stream, chunk) for w, chunk, _ in batched])
        except BaseException as error:  # the round isolates streams; this fault is around them
            if not is_record_fault(error):
                raise
            for entry, _, _ in batched:
                self._fail_unexpected(entry, error, result)
            outcomes, batched = [], []
        steps = [
            (w, c, o, None, before) for (w, c, before), o in zip(batched, outcomes, strict=True)
        ]
        steps += [(w, c, o, texts, None) for w, c, o, texts in singles]
        for entry, chunk, outcome, texts, before in steps:
            try:
                error = outcome.error
                if error is not None and not isinstance(
                    error, StrictDecodeError | InvalidTokenIdError
                ):
                    self._fail_unexpected(entry, error, result)
                else:
                    self._advance_with_options(entry, chunk, outcome, texts, before, result)
            except BaseException as unexpected:  # as in `process`: this request only
                if not is_record_fault(unexpected):
                    raise
                self._fail_unexpected(entry, unexpected, result)

    def _check_logprobs(self, entry: _Work, result: BatchResult) -> bool:
        """Whether the chunk's logprobs can be used; if not, the request fails here.

        The first tokens event decides whether a request has logprobs; in one that has them,
        a later event without them fails it (its entries could not be written), while logprobs
        on a later event of a request without them are ignored. An alternative id the tokenizer
        and the model cannot have produced is `token_id_out_of_range`, like such a prompt id.
        """
        state = entry.state
        expected = state.logprobs
        if expected is None and state.generated_tokens:
            expected = state.logprobs = False  # see `_has_logprobs`
        if expected is False:
            return True  # decided without logprobs: later ones are ignored
        limit: int | None = None
        for index, held in enumerate(entry.events):
            event = held.event
            if type(event) is not ParsedTokens or not event.token_ids:
                continue
            present = event.logprobs is not None
            if expected is None:
                expected = present
            if not expected:
                break  # decided without logprobs: later ones are ignored
            if not present:
                self._fail_on_event(
                    entry,
                    index,
                    DeadLetterReason.SCHEMA_VIOLATION,
                    "this tokens event has no logprobs, and its request's first one had",
                    result,
                )
                return False
            if event.top_logprobs is not None:
                if limit is None:
                    model = self.registry.get(state.model)
                    limit = max(model.model_vocab_size or 0, model.tokenizer_vocab_size)
                bad = check_alternatives(event.top_logprobs, limit)
                if bad >= 0:
                    self._fail_on_event(
                        entry,
                        index,
                        DeadLetterReason.TOKEN_ID_OUT_OF_RANGE,
                        f"top_logprobs token id {bad} is outside the tokenizer and the model "
                        f"vocabulary ({limit} ids)",
                        result,
                    )
                    return False
        if expected is not None:
            state.logprobs = expected
        return True

    def _fail_on_event(
        self, entry: _Work, index: int, reason: DeadLetterReason, message: str, result: BatchResult
    ) -> None:
        """One event of the chunk is unusable: it is dead-lettered with `reason`, the chunk's
        other events as already failed, and the request fails with its text so far."""
        held = entry.events[index]
        self._dead_letter(result, reason, held.event, held.origin, message)
        self._dead_letter_all(
            result,
            DeadLetterReason.REQUEST_ALREADY_FAILED,
            (h for i, h in enumerate(entry.events) if i != index),
            "another event of this request's chunk was unusable",
        )
        self._end_failed(entry.request_id, entry.state, reason, message, result)

    def _advance_with_options(
        self,
        entry: _Work,
        chunk: list[int],
        outcome: ChunkResult,
        texts: list[str] | None,
        before: DecodeStream | None,
        result: BatchResult,
    ) -> None:
        """`_advance` with stop strings and logprobs: find a stop, hold back what may begin
        one, record each token's place in the text."""
        state = entry.state
        error = outcome.error
        text = outcome.text
        pushed = len(chunk)
        if error is not None:
            bad_id = getattr(error, "token_id", None)
            pushed = chunk.index(bad_id) if bad_id in chunk else 0
        last = entry.events[-1].event
        finished = error is None and type(last) is ParsedFinish
        if finished:
            text += state.stream.flush()
        if state.logprobs:
            self._record_logprobs(state, entry.events, pushed, texts or [])
        matcher = state.stop_matcher
        if matcher is None and state.stop is not None:
            matcher = state.stop_matcher = matcher_for(state.stop)
        if matcher is not None:
            held = state.stop_held
            match = matcher.find(held + text) if text else None
            if match is not None:
                self._stop(entry, chunk, pushed, text, texts, before, match, result)
                return
        if error is not None:
            self._fail_decode(entry, chunk, text, error, result)  # type: ignore[arg-type]
            return
        state.generated_tokens += pushed
        result.decoded_tokens += pushed
        limit = self.max_text_bytes
        if limit is not None and state.text_size + json_size(text) > limit:
            self._fail_too_large(entry, text, result)
            return
        state.add_text(text)
        published = state.stop_held + text
        if matcher is not None:
            kept = 0 if finished else matcher.held_length(published)
            state.stop_held = published[len(published) - kept :] if kept else ""
            published = published[: len(published) - kept]
        self._maybe_filtered_ids(entry.request_id, state, result)
        entries = self._new_entries(state, finished, state.text_chars)
        if published or finished or entries:
            self._publish_delta(
                entry.request_id, state, last.seq, published, finished, entries, result
            )
        if finished:
            result.completions.append(
                self._completion(entry.request_id, state, "ok", last.finish_reason)
            )
            marker = FinishedRequest(last_seq=last.seq, last_event_at=state.last_event_at)
            self._close(entry.request_id, state, marker, result)

    def _record_logprobs(
        self, state: ActiveRequest, events: Sequence[HeldEvent], pushed: int, texts: list[str]
    ) -> None:
        """Append the logprob columns of the first `pushed` ids of the chunk."""
        state.own_columns()
        taken = 0
        for held in events:
            event = held.event
            # An event without ids owes no logprobs (`_check_logprobs` passes it over too).
            if type(event) is not ParsedTokens or not event.token_ids or taken >= pushed:
                continue
            count = min(len(event.token_ids), pushed - taken)
            state.lp_ids += event.token_ids[:count]
            state.lp_values += event.logprobs[:count]  # type: ignore[index]  # checked
            tops = event.top_logprobs
            state.lp_tops += tops[:count] if tops is not None else [[] for _ in range(count)]
            taken += count
        offset = state.text_chars
        offsets = state.lp_offsets
        for text in texts[:pushed]:
            offsets.append(offset)
            offset += len(text)

    def _new_entries(
        self, state: ActiveRequest, finished: bool, cut: int
    ) -> list[TokenLogprob] | None:
        """Entries no delta has carried whose text is now published, or None for a request
        without logprobs. A token's text is settled once the next token is pushed (the last
        token's only at the end, which may add the finish flush), and published once no part
        of it is held back for a possible stop."""
        if not state.logprobs:
            return None
        published = state.text_chars - len(state.stop_held)
        offsets = state.lp_offsets
        count = len(offsets)
        first = state.lp_sent
        last = count if finished else max(count - 1, first)
        while last > first and last < count and offsets[last] > published:
            last -= 1
        if last <= first:
            return []
        state.lp_sent = last
        entries = self._entries(state, first, last, cut)
        built = state.lp_built
        if len(built) == first:  # kept for the completion (not after a restore)
            if built:
                built += entries  # type: ignore[operator]  # a non-empty one is a list
            else:
                state.lp_built = list(entries)  # its own: the delta carries `entries`
        return entries

    def _entries(self, state: ActiveRequest, first: int, last: int, cut: int) -> list[TokenLogprob]:
        start = min(state.lp_offsets[first], cut)
        return build_entries(
            profile_for(self.registry.get(state.model).tokenizer),
            state.lp_ids,
            state.lp_values,
            state.lp_tops,
            state.lp_offsets,
            first,
            last,
            state.text_tail(state.text_chars - start),
            start,
            cut,
        )

    def _publish_delta(
        self,
        request_id: str,
        state: ActiveRequest,
        seq: int,
        text: str,
        final: bool,
        entries: list[TokenLogprob] | None,
        result: BatchResult,
    ) -> None:
        offset = state.text_chars - len(state.stop_held) - len(text)
        result.deltas.append(
            Delta(request_id, state.model, state.delta_start, seq, offset, text, final, entries)
        )
        state.delta_start = seq + 1

    def _stop(
        self,
        entry: _Work,
        chunk: list[int],
        pushed: int,
        text: str,
        texts: list[str] | None,
        before: DecodeStream | None,
        match: StopMatch,
        result: BatchResult,
    ) -> None:
        """A stop string completed in this chunk: publish the completion at the stop.

        The completion holds the text up to the stop string's start (its end with
        `include_stop_str_in_output`) and the ids up to the one whose text completed it; the
        chunk's later events are consumed as events after the stop.
        """
        state = entry.state
        held = state.stop_held
        base = state.text_chars - len(held)  # where `held + text` starts in the text
        end = base + match.end
        cut = base + (match.end if state.include_stop_str_in_output else match.start)
        if texts is None:
            texts = []
            if before is not None:
                # Up to the failing id, if any: the stop came before it.
                push_each(before, chunk[:pushed], texts)
        completing, in_flush = _completing_token(state.text_chars, texts, end, pushed)
        whole = (state.text() + text)[:cut]
        limit = self.max_text_bytes
        if limit is not None and json_size(whole) > limit:
            self._fail_too_large(entry, text, result)
            return
        state.generated_tokens += completing
        result.decoded_tokens += completing
        state.text_parts = [whole] if whole else ()
        state.text_chars = cut
        state.text_size = json_size(whole)
        state.stop_held = ""
        entries = None
        if state.logprobs:
            kept = len(state.lp_offsets) - pushed + completing
            del state.lp_ids[kept:], state.lp_values[kept:], state.lp_tops[kept:]
            del state.lp_offsets[kept:]
            entries = self._new_entries(state, True, cut)
        self._maybe_filtered_ids(entry.request_id, state, result)
        events = entry.events
        stopping = len(events) - 1 if in_flush else _event_of_token(events, completing)
        result.deltas.append(
            Delta(
                entry.request_id,
                state.model,
                state.delta_start,
                events[stopping].event.seq,
                base,
                whole[base:],
                True,
                entries,
            )
        )
        result.completions.append(
            self._completion(entry.request_id, state, "ok", "stop", stop_reason=match.stop)
        )
        result.events_after_stop += len(events) - 1 - stopping
        marker = FinishedRequest(
            last_seq=events[-1].event.seq,
            last_event_at=state.last_event_at,
            stopped=type(events[-1].event) is not ParsedFinish,
        )
        self._close(entry.request_id, state, marker, result)

    def _after_stop(
        self, request_id: str, state: FinishedRequest, event: ParsedEvent, result: BatchResult
    ) -> None:
        """An event after a stop string ended the request: consumed and counted; its finish
        makes the marker a plain finished one (later events are then `event_after_finish`)."""
        result.events_after_stop += 1
        state.last_seq = event.seq
        if type(event) is ParsedFinish:
            state.stopped = False
        result.touched.add(request_id)

    def _fail_decode(
        self,
        entry: _Work,
        chunk: list[int],
        partial_text: str,
        error: StrictDecodeError | InvalidTokenIdError,
        result: BatchResult,
    ) -> None:
        state = entry.state
        # The failing id is the first occurrence of its value: any earlier one would have failed.
        bad_id = getattr(error, "token_id", None)
        bad_index = chunk.index(bad_id) if bad_id in chunk else len(chunk)
        state.generated_tokens += bad_index
        result.decoded_tokens += bad_index
        partial_text = self._fitting(state, partial_text)
        offset = state.text_chars - len(state.stop_held)
        state.add_text(partial_text)
        self._maybe_filtered_ids(entry.request_id, state, result)
        failing = _failing_event_index(entry.events, bad_index)
        failing_event = entry.events[failing]
        self._dead_letter(
            result,
            DeadLetterReason.STRICT_DECODE_FAILURE,
            failing_event.event,
            failing_event.origin,
            str(error),
            error_class=type(error).__name__,
        )
        self._dead_letter_all(
            result,
            DeadLetterReason.REQUEST_ALREADY_FAILED,
            entry.events[failing + 1 :],
            "an earlier event of this request failed to decode",
        )
        self._end_failed(
            entry.request_id,
            state,
            DeadLetterReason.STRICT_DECODE_FAILURE,
            str(error),
            result,
            last_delta=(failing_event.event.seq, offset, partial_text),
        )

    def _fail_too_large(self, entry: _Work, text: str, result: BatchResult) -> None:
        """The text would pass `max_text_bytes`: keep what fits, fail the request on the event
        that completed the chunk (the chunk decodes as one, so no finer event is known)."""
        state = entry.state
        kept = self._fitting(state, text)
        offset = state.text_chars - len(state.stop_held)
        state.add_text(kept)
        self._maybe_filtered_ids(entry.request_id, state, result)
        last = entry.events[-1]
        message = (
            f"the text of request {entry.request_id!r} passes {self.max_text_bytes} bytes (the "
            f"largest completion the output topic takes); it is cut there"
        )
        self._dead_letter(
            result, DeadLetterReason.OUTPUT_TOO_LARGE, last.event, last.origin, message
        )
        self._end_failed(
            entry.request_id,
            state,
            DeadLetterReason.OUTPUT_TOO_LARGE,
            message,
            result,
            last_delta=(last.event.seq, offset, kept),
        )

    def _fitting(self, state: ActiveRequest, text: str) -> str:
        """The longest prefix of `text` that keeps the request within `max_text_bytes`."""
        limit = self.max_text_bytes
        if limit is None:
            return text
        return json_prefix(text, max(limit - state.text_size, 0))

    def _maybe_filtered_ids(
        self, request_id: str, state: ActiveRequest, result: BatchResult
    ) -> None:
        filtered = state.stream.filtered_prompt_ids
        if filtered and not state.filtered_ids_sent:
            state.filtered_ids_sent = True
            result.filtered_ids.append(
                FilteredIdsRecord(
                    request_id=request_id,
                    model=state.model,
                    filtered_ids=list(filtered),
                    filtered_count=len(filtered),
                    prompt_tokens=state.prompt_tokens,
                )
            )

    # -- unexpected errors ----------------------------------------------------------------------

    def _fail_sequencing(
        self,
        event: ParsedEvent,
        origin: Origin,
        at: float,
        error: BaseException,
        work: dict[str, _Work],
        result: BatchResult,
    ) -> None:
        """An exception while sequencing one event: that event is dead-lettered with it, and
        its request fails (a prompt's request is marked failed at open, so a redrive reopens
        it); events of the request already queued in this batch are dead-lettered too."""
        request_id = event.request_id
        result.dead_letters.append(_unexpected_letter(event, origin, error))
        state = self.requests.get(request_id)
        entry = work.pop(request_id, None)
        if entry is not None:
            queued = [h for h in entry.events if h.event is not event]
            self._dead_letter_all(
                result,
                DeadLetterReason.REQUEST_ALREADY_FAILED,
                queued,
                "an event of this request failed unexpectedly",
            )
        if isinstance(state, ActiveRequest):
            held = state.held.get(event.seq)
            if held is not None and held.event is event:
                del state.held[event.seq]  # type: ignore[attr-defined]  # holds one: a dict
            self._end_failed(
                request_id, state, DeadLetterReason.UNEXPECTED_ERROR, _describe(error), result
            )
        elif state is None:
            self.requests[request_id] = FailedRequest(
                model=getattr(event, "model", None),
                reason=DeadLetterReason.UNEXPECTED_ERROR,
                last_event_at=at,
                at_open=True,
            )
        result.touched.add(request_id)

    def _fail_unexpected(self, entry: _Work, error: BaseException, result: BatchResult) -> None:
        """An exception while decoding one request's chunk: every event of the chunk is
        dead-lettered with it (which id caused it is unknown), and the request fails with the
        text it had before the chunk (the stream's state is no longer trusted)."""
        for held in entry.events:
            result.dead_letters.append(_unexpected_letter(held.event, held.origin, error))
        if self.requests.get(entry.request_id) is entry.state:
            self._end_failed(
                entry.request_id,
                entry.state,
                DeadLetterReason.UNEXPECTED_ERROR,
                _describe(error),
                result,
            )

    # -- endings ------------------------------------------------------------------------------

    def _completion(
        self,
        request_id: str,
        state: ActiveRequest,
        status: Literal["ok", "failed"],
        finish_reason: str | None,
        error: str | None = None,
        stop_reason: str | None = None,
    ) -> Completion:
        logprobs = None
        if state.logprobs:
            # Validated once here into the models; deltas carry the plain entries.
            count = len(state.lp_offsets)
            entries = state.lp_built
            if len(entries) != count:
                entries = self._entries(state, 0, count, state.text_chars) if count else []
            logprobs = logprobs_model(entries)
        return Completion(
            request_id=request_id,
            model=state.model,
            text=state.text(),
            status=status,
            finish_reason=finish_reason,
            prompt_tokens=state.prompt_tokens,
            generated_tokens=state.generated_tokens,
            filtered_prompt_ids=list(state.stream.filtered_prompt_ids),
            error=error,
            stop_reason=stop_reason,
            logprobs=logprobs,
        )

    def _end_failed(
        self,
        request_id: str,
        state: ActiveRequest,
        reason: DeadLetterReason,
        message: str,
        result: BatchResult,
        last_delta: tuple[int, int, str] | None = None,
    ) -> None:
        """Fail a live request: its final delta (seq, text offset, text) when it has one, a
        failed completion with the text so far, and the failed marker."""
        if last_delta is None and state.stop_held:
            # Text held back for a possible stop string is the request's: it goes out too.
            seq = state.next_seq - 1
            state.delta_start = min(state.delta_start, seq)
            last_delta = (seq, state.text_chars - len(state.stop_held), "")
        if last_delta is not None:
            seq, offset, text = last_delta
            text = state.stop_held + text
            state.stop_held = ""
            entries = self._new_entries(state, True, state.text_chars)
            result.deltas.append(
                Delta(request_id, state.model, state.delta_start, seq, offset, text, True, entries)
            )
        result.completions.append(self._completion(request_id, state, "failed", None, message))
        marker = FailedRequest(model=state.model, reason=reason, last_event_at=state.last_event_at)
        self._close(request_id, state, marker, result)

    def _close(
        self, request_id: str, state: ActiveRequest, marker: RequestState, result: BatchResult
    ) -> None:
        """Replace an active request by its marker; held events can never be applied now."""
        if type(marker) is FinishedRequest and marker.stopped and state.held:
            # Events already held past a stop are events after it, like those still to come.
            for seq in sorted(state.held):
                self._after_stop(request_id, marker, state.held[seq].event, result)
            state.release_held()
        reason = (
            DeadLetterReason.EVENT_AFTER_FINISH
            if isinstance(marker, FinishedRequest)
            else DeadLetterReason.REQUEST_ALREADY_FAILED
        )
        self._dead_letter_held(result, state, reason, "event held for a request that has ended")
        self._retire(request_id, state)
        self.requests[request_id] = marker
        result.touched.add(request_id)

    def _fail_gap(
        self, request_id: str, state: ActiveRequest, work: dict[str, _Work], result: BatchResult
    ) -> None:
        message = (
            f"seq {state.next_seq} never arrived; {len(state.held)} later events held "
            f"({state.held_bytes} bytes)"
        )
        self._dead_letter_held(result, state, DeadLetterReason.SEQUENCE_GAP, message)
        # In-order events of this batch would have been decoded with the request; now they
        # cannot be, and a consumed event is never dropped without a trace.
        entry = work.pop(request_id, None)
        if entry is not None:
            self._dead_letter_all(
                result,
                DeadLetterReason.REQUEST_ALREADY_FAILED,
                entry.events,
                "the request failed on a sequence gap before this event was decoded",
            )
        self._end_failed(request_id, state, DeadLetterReason.SEQUENCE_GAP, message, result)

    def expire(
        self,
        reference: float | Callable[[str], float],
        *,
        limit: int | None = None,
        latest: float | None = None,
    ) -> BatchResult:
        """End what has been idle too long: live requests fail (TTL), markers are forgotten.

        Idleness is `reference(request_id) - last_event_at`, the latter in the clock that
        consumed the request's events (`process`). `latest`, when given, is that clock now (the
        worker's wall clock), and no reference counts past it: a reference is then never later
        than the request's own clock, so nothing expires early, whatever a producer's clock
        says. The worker passes, per request's partition, the wall clock once that partition
        is caught up, and before, the newest record time consumed from it: during a backlog
        that lags the wall clock, so a request consumed during it does not look idle while its
        later events still wait in it, and one restored from before an outage is idle for as
        long as the backlog's records have moved on since. At most `limit` requests are ended
        per call: an expiry writes a completion, dead letters and a snapshot, and 200k requests
        idle at once must go out over several commits, not as one transaction.

        With `latest`, requests newer than it minus the shorter of the TTL and the retention
        cannot be due, and are passed over in one comprehension, without a reference call each
        (see `_due`).
        """
        result = BatchResult()
        reference_of = reference if callable(reference) else _constant(reference)
        if latest is None and not callable(reference):
            latest = reference
        ended = 0
        for request_id, state in self._due(latest):
            if limit is not None and ended >= limit:
                break
            at = reference_of(request_id)
            if latest is not None and at > latest:
                at = latest
            idle = at - state.last_event_at
            if type(state) is RestoredRequest:
                if idle < self.request_ttl_s:
                    continue
                state = self._rebuilt(request_id, state)
            if type(state) is ActiveRequest:
                if idle < self.request_ttl_s:
                    continue
                self._expire_active(request_id, state, idle, at, result)
            elif idle >= self.finished_retention_s:
                del self.requests[request_id]
                result.touched.add(request_id)
            else:
                continue
            ended += 1
        return result

    def _due(self, latest: float | None) -> list[tuple[str, RequestState | RestoredRequest]]:
        """The requests an expiry must look at: all of them, or with `latest` only those idle
        for at least the shorter bound at `latest`. A worker with a million open requests
        called the reference of each once a second, a sweep costing most of its loop; the
        comprehension costs a small fraction of that, and the few old requests get the full
        check."""
        items = self.requests.items()
        if latest is None:
            return list(items)
        horizon = latest - min(self.request_ttl_s, self.finished_retention_s)
        return [(r, s) for r, s in items if s.last_event_at <= horizon]

    def _expire_active(
        self, request_id: str, state: ActiveRequest, idle: float, at: float, result: BatchResult
    ) -> None:
        """Fail an idle request: its held events and a synthetic record go to dead letters.

        A request that never got past its prompt publishes no completion. It has no text, and
        its id may be that of a request finished long ago whose prompt came again after the
        finished marker was forgotten (a late duplicate): a `failed` empty completion would then
        replace the `ok` one in the compacted completions topic. Remembering every finished id
        forever to tell the two apart would cost memory and changelog without bound; the
        `ttl_expired` dead letter tells the user the same thing.
        """
        message = f"no event for {idle:.0f}s (ttl {self.request_ttl_s:.0f}s)"
        self._dead_letter_held(
            result,
            state,
            DeadLetterReason.SEQUENCE_GAP,
            f"seq {state.next_seq} never arrived",
        )
        result.dead_letters.append(
            DeadLetter(
                reason=DeadLetterReason.TTL_EXPIRED,
                error_class=REASONS[DeadLetterReason.TTL_EXPIRED].error_class_name,
                message=message,
                request_id=request_id,
                seq=state.next_seq,
                origin=None,
                synthetic_value=_expiry_record(request_id, state),
            )
        )
        if state.next_seq > 1:
            result.completions.append(self._completion(request_id, state, "failed", None, message))
        self._retire(request_id, state)
        self.requests[request_id] = FailedRequest(
            model=state.model, reason=DeadLetterReason.TTL_EXPIRED, last_event_at=at
        )
        result.touched.add(request_id)

    def flush_incomplete(self) -> BatchResult:
        """At the end of a finite input: every request still open is dead-lettered as expired."""
        self.request_ttl_s = 0.0
        return self.expire(float("inf"))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop these requests' state, whatever it is (their partition was revoked: the new
        owner restores them from the changelog)."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.retired_segments.pop(request_id, None)

    # -- dead letters -------------------------------------------------------------------------

    @staticmethod
    def _dead_letter(
        result: BatchResult,
        reason: DeadLetterReason,
        event: ParsedEvent,
        origin: Origin,
        message: str,
        error_class: str | None = None,
    ) -> None:
        result.dead_letters.append(
            DeadLetter(
                reason,
                error_class or REASONS[reason].error_class_name,
                message,
                event.request_id,
                event.seq,
                origin,
            )
        )

    def _dead_letter_all(
        self,
        result: BatchResult,
        reason: DeadLetterReason,
        events: Iterable[HeldEvent],
        message: str,
    ) -> None:
        for held in events:
            self._dead_letter(result, reason, held.event, held.origin, message)

    def _dead_letter_held(
        self, result: BatchResult, state: ActiveRequest, reason: DeadLetterReason, message: str
    ) -> None:
        """Dead-letter every event the request holds, in seq order, and let go of them."""
        held = state.held
        self._dead_letter_all(result, reason, (held[seq] for seq in sorted(held)), message)
        state.release_held()

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self, request_id: str) -> bytes | None:
        """The changelog value of one request, or None when it is gone (a tombstone)."""
        state = self.state(request_id)
        return None if state is None else encode_snapshot(state)

    def changelog_records(self, request_id: str) -> list[tuple[bytes, bytes | None]]:
        """The changelog records (key, value) one request's commit writes, in order: tombstones
        for the text segments of a request that ended, an active request's new text segment,
        then its head (None: a tombstone). See `pipeline.request_state`, 'Incremental
        changelog'."""
        records: list[tuple[bytes, bytes | None]] = [
            (segment_key(request_id, number), None)
            for number in range(self.retired_segments.pop(request_id, 0))
        ]
        state = self.state(request_id)
        if type(state) is ActiveRequest:
            segment, head = encode_head(state)
            if segment is not None:
                records.append((segment_key(request_id, segment[0]), segment[1]))
            records.append((request_id.encode(), head))
        else:
            records.append((request_id.encode(), None if state is None else encode_snapshot(state)))
        return records

    def _retire(self, request_id: str, state: ActiveRequest) -> None:
        """An active request ends: its text segments are deleted with its next records."""
        if state.text_segments:
            self.retired_segments[request_id] = state.text_segments

    def restore(
        self,
        request_id: str,
        snapshot: bytes | None,
        segments: Mapping[int, bytes] | None = None,
    ) -> None:
        """Put back one request from its changelog value (None removes it) and its text
        segments (number -> value). An active request is kept as its checked head and rebuilt
        when first needed (`pipeline.request_state`, 'lazy restore'): `state` gives it rebuilt.

        Raises `SnapshotError` for a value it cannot restore, leaving the request's state as it
        was; the caller then decides (the worker: `mark_failed` and a dead letter).
        """
        if snapshot is None:
            self.requests.pop(request_id, None)
            return
        self.requests[request_id] = restore_state(
            request_id, snapshot, self._tokenizer_of, segments
        )

    def state(self, request_id: str) -> RequestState | None:
        """A request's state, rebuilt first if it is still as restored (`RestoredRequest`)."""
        state = self.requests.get(request_id)
        if type(state) is RestoredRequest:
            return self._rebuilt(request_id, state)
        return state

    def _rebuilt(self, request_id: str, restored: RestoredRequest) -> ActiveRequest:
        state = self.requests[request_id] = rebuild(request_id, restored, self._tokenizer_of)
        return state

    def mark_failed(
        self,
        request_id: str,
        reason: DeadLetterReason,
        now: float | None = None,
        message: str | None = None,
    ) -> BatchResult:
        """Fail a request from outside a batch (its events raised, its snapshot cannot be
        encoded or written, its state cannot be restored): its later events are dead-lettered
        `request_already_failed` instead of being taken for a new request's.

        A live request ends as every failure ends one (`_end_failed`): its held events
        dead-lettered, its failed completion with the text so far. The caller publishes the
        result with the failed marker, in the same commit: a marker written without its
        completion left a request that never completed (issue 32 item 1).
        """
        result = BatchResult()
        result.touched.add(request_id)
        state = self.state(request_id)
        if type(state) is ActiveRequest:
            message = message or f"request failed ({reason.value})"
            self._end_failed(request_id, state, reason, message, result)
            return result
        self.requests[request_id] = FailedRequest(
            model=None,
            reason=reason,
            last_event_at=time.time() if now is None else now,
        )
        return result

    def fail_restore(self, request_id: str, value: bytes | None, message: str) -> BatchResult:
        """A changelog record that cannot be restored: the request is marked failed, and when the
        record is recognisably a live request's head, its failed completion is published (with
        no text: the text could not be restored either). A marker that does not restore
        publishes nothing: its request already had its completion."""
        result = self.mark_failed(request_id, DeadLetterReason.RESTORE_FAILED, message=message)
        head = active_head_fields(value)
        if head is None or result.completions:
            return result
        try:
            completion = Completion(
                request_id=request_id,
                model=head.model,
                text="",
                status="failed",
                prompt_tokens=head.prompt_tokens,
                generated_tokens=head.generated_tokens,
                error=message,
            )
        except ValueError:  # a model name no completion can carry: the dead letter tells
            return result
        result.completions.append(completion)
        return result

    def _tokenizer_of(self, model: str) -> Tokenizer:
        return self.registry.get(model).tokenizer

    @property
    def active_requests(self) -> int:
        return sum(
            type(s) is ActiveRequest or type(s) is RestoredRequest for s in self.requests.values()
        )


def _prompt_tokens(event: ParsedPrompt) -> int:
    """The prompt's full length: its count when the producer sent only a tail."""
    count = event.prompt_tokens
    return len(event.prompt_token_ids) if count is None else count


def _joined_ids(events: Sequence[HeldEvent]) -> list[int]:
    """The generated ids of a request's in-order events, as one chunk (list extends, no
    per-id Python loop: this runs for every active request of every batch)."""
    ids: list[int] = []
    for held in events:
        if type(held.event) is ParsedTokens:
            ids += held.event.token_ids
    return ids


def _has_logprobs(entry: _Work) -> bool:
    """Whether a request's chunk is decoded with logprobs: decided by its first tokens event,
    so a request decoded without them costs one attribute test here."""
    logprobs = entry.state.logprobs
    if logprobs is not None:
        return logprobs
    if entry.state.generated_tokens:
        return False  # decided without (a snapshot leaves an option-less request's None)
    return any(
        type(held.event) is ParsedTokens and held.event.logprobs is not None
        for held in entry.events
    )


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


def _failing_event_index(events: Sequence[HeldEvent], bad_index: int) -> int:
    """Which of a request's in-order events holds the id at `bad_index` of their joined chunk."""
    consumed = 0
    for index, held in enumerate(events):
        if isinstance(held.event, ParsedTokens):
            consumed += len(held.event.token_ids)
            if bad_index < consumed:
                return index
    return len(events) - 1


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _unexpected_letter(event: ParsedEvent, origin: Origin, error: BaseException) -> DeadLetter:
    return DeadLetter(
        DeadLetterReason.UNEXPECTED_ERROR,
        type(error).__name__,
        str(error) or type(error).__name__,
        event.request_id,
        event.seq,
        origin,
    )


def _constant(value: float) -> Callable[[str], float]:
    return lambda _request_id: value


def _expiry_record(request_id: str, state: ActiveRequest) -> bytes:
    return encode_json(
        {
            "request_id": request_id,
            "model": state.model,
            "next_seq": state.next_seq,
            "generated_tokens": state.generated_tokens,
            "text": state.text(),
        }
    )


__all__ = [
    "MAX_HELD_EVENTS",
    "BatchResult",
    "DeadLetter",
    "Delta",
    "EventOrigin",
    "Origin",
    "RequestProcessor",
    "SnapshotError",
    "StrictDecodeError",
]
