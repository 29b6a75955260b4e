"""Every way a request fails, in one place.

One rule holds throughout: whatever goes wrong with one request (a broken event, a decoder that
raises, an output past the broker's limit, a state that cannot be snapshotted or restored) ends
that request, with a dead letter for each of its events involved and exactly one failed
completion with its text so far (`Outcomes.end_failed`); the other requests of the batch go on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline.decode_stream import InvalidTokenIdError, StrictDecodeError
from pipeline.request_state import (
    ActiveRequest,
    FailedRequest,
    HeldEvent,
    RequestState,
    active_head_fields,
)
from pipeline.requests.outcomes import Outcomes, holds_finish
from pipeline.requests.work import Work
from pipeline.results import BatchResult, DeadLetter, Origin
from schemas.events import Completion, DeadLetterReason, StopSignal
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedTokens


def fail_decode(
    out: Outcomes,
    entry: Work,
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
    partial_text = out.fitting(state, partial_text)
    state.add_text(partial_text)
    out.filtered_ids(entry.request_id, state, result)
    failing = _failing_event_index(entry.events, bad_index)
    failing_event = entry.events[failing]
    out.dead_letter(
        result,
        DeadLetterReason.STRICT_DECODE_FAILURE,
        failing_event.event,
        failing_event.origin,
        str(error),
        error_class=type(error).__name__,
    )
    out.dead_letter_all(
        result,
        DeadLetterReason.REQUEST_ALREADY_FAILED,
        entry.events[failing + 1 :],
        "an earlier event of this request failed to decode",
    )
    out.end_failed(
        entry.request_id,
        state,
        DeadLetterReason.STRICT_DECODE_FAILURE,
        str(error),
        result,
        last_delta=(failing_event.event.seq, partial_text),
        finish_seen=entry.finished,
    )


def fail_too_large(out: Outcomes, entry: Work, text: str, result: BatchResult) -> None:
    """The text would pass `max_text_bytes`: keep what fits, fail the request on the event
    that completed the chunk (the chunk decodes as one, so no finer event is known)."""
    state = entry.state
    kept = out.fitting(state, text)
    state.add_text(kept)
    out.filtered_ids(entry.request_id, state, result)
    last = entry.events[-1]
    message = (
        f"the text of request {entry.request_id!r} passes {out.max_text_bytes} bytes (the "
        f"largest completion the output topic takes); it is cut there"
    )
    out.dead_letter(result, DeadLetterReason.OUTPUT_TOO_LARGE, last.event, last.origin, message)
    out.end_failed(
        entry.request_id,
        state,
        DeadLetterReason.OUTPUT_TOO_LARGE,
        message,
        result,
        last_delta=(last.event.seq, kept),
        finish_seen=entry.finished,
    )


def fail_on_event(
    out: Outcomes,
    entry: Work,
    index: int,
    reason: DeadLetterReason,
    message: str,
    result: BatchResult,
) -> None:
    """One event of the chunk is unusable: it is dead-lettered with `reason`, the chunk's
    other events as already failed, and the request fails with its text so far."""
    held = entry.events[index]
    out.dead_letter(result, reason, held.event, held.origin, message)
    out.dead_letter_all(
        result,
        DeadLetterReason.REQUEST_ALREADY_FAILED,
        (h for i, h in enumerate(entry.events) if i != index),
        "another event of this request's chunk was unusable",
    )
    out.end_failed(
        entry.request_id, entry.state, reason, message, result, finish_seen=entry.finished
    )


def fail_unexpected(out: Outcomes, entry: Work, error: BaseException, result: BatchResult) -> None:
    """An exception while decoding one request's chunk: every event of the chunk is
    dead-lettered with it (which id caused it is unknown), and the request fails with the
    text it had before the chunk (the stream's state is no longer trusted)."""
    for held in entry.events:
        result.dead_letters.append(_unexpected_letter(held.event, held.origin, error))
    if out.requests.get(entry.request_id) is entry.state:
        out.end_failed(
            entry.request_id,
            entry.state,
            DeadLetterReason.UNEXPECTED_ERROR,
            _describe(error),
            result,
            finish_seen=entry.finished,
        )


def fail_sequencing(
    out: Outcomes,
    event: ParsedEvent,
    origin: Origin,
    at: float,
    error: BaseException,
    work: dict[str, Work],
    result: BatchResult,
) -> None:
    """An exception while sequencing one event: that event is dead-lettered with it, and
    its request fails (a prompt's request is marked failed at open, so a redrive reopens
    it); events of the request already queued in this batch are dead-lettered too."""
    request_id = event.request_id
    result.dead_letters.append(_unexpected_letter(event, origin, error))
    state = out.requests.get(request_id)
    entry = work.pop(request_id, None)
    if entry is not None:
        queued = [h for h in entry.events if h.event is not event]
        out.dead_letter_all(
            result,
            DeadLetterReason.REQUEST_ALREADY_FAILED,
            queued,
            "an event of this request failed unexpectedly",
        )
    if isinstance(state, ActiveRequest):
        held = state.held.get(event.seq)
        if held is not None and held.event is event:
            del state.held[event.seq]  # type: ignore[attr-defined]  # holds one: a dict
        out.end_failed(
            request_id,
            state,
            DeadLetterReason.UNEXPECTED_ERROR,
            _describe(error),
            result,
            finish_seen=type(event) is ParsedFinish or (entry is not None and entry.finished),
        )
    elif state is None:
        out.requests[request_id] = FailedRequest(
            model=getattr(event, "model", None),
            reason=DeadLetterReason.UNEXPECTED_ERROR,
            last_event_at=at,
            at_open=True,
        )
    result.touched.add(request_id)


def fail_gap(
    out: Outcomes, request_id: str, state: ActiveRequest, work: dict[str, Work], result: BatchResult
) -> None:
    message = (
        f"seq {state.next_seq} never arrived; {len(state.held)} later events held "
        f"({state.held_bytes} bytes)"
    )
    finish_seen = holds_finish(state)  # before they are dead-lettered
    out.dead_letter_held(result, state, DeadLetterReason.SEQUENCE_GAP, message)
    # In-order events of this batch would have been decoded with the request; now they
    # cannot be, and a consumed event is never dropped without a trace.
    entry = work.pop(request_id, None)
    if entry is not None:
        out.dead_letter_all(
            result,
            DeadLetterReason.REQUEST_ALREADY_FAILED,
            entry.events,
            "the request failed on a sequence gap before this event was decoded",
        )
    finish_seen = finish_seen or (entry is not None and entry.finished)
    out.end_failed(
        request_id, state, DeadLetterReason.SEQUENCE_GAP, message, result, finish_seen=finish_seen
    )


def mark_failed(
    out: Outcomes,
    request_id: str,
    state: RequestState | None,
    reason: DeadLetterReason,
    now: float | None = None,
    message: str | None = None,
) -> BatchResult:
    """Fail a request from outside a batch (its events raised, its snapshot cannot be
    encoded or written, its state cannot be restored): its later events are dead-lettered
    `request_already_failed` instead of being taken for a new request's.

    `state` is the request's, rebuilt if it was as restored. A live request ends as every
    failure ends one (`Outcomes.end_failed`): its held events
    dead-lettered, its failed completion with the text so far. The caller publishes the
    result with the failed marker, in the same commit: a marker written without its
    completion left a request that never completed (issue 32 item 1).
    """
    result = BatchResult()
    result.touched.add(request_id)
    if type(state) is ActiveRequest:
        message = message or f"request failed ({reason.value})"
        out.end_failed(request_id, state, reason, message, result)
        return result
    out.requests[request_id] = FailedRequest(
        model=None,
        reason=reason,
        last_event_at=time.time() if now is None else now,
    )
    return result


def fail_restore(
    out: Outcomes, request_id: str, state: RequestState | None, value: bytes | None, message: str
) -> BatchResult:
    """A changelog record that cannot be restored: the request is marked failed, and when the
    record is recognisably a live request's head, its failed completion is published (with
    no text: the text could not be restored either). A marker that does not restore
    publishes nothing: its request already had its completion."""
    result = mark_failed(out, request_id, state, DeadLetterReason.RESTORE_FAILED, message=message)
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
    # A live request's head: its engine may still be generating (its held events, if it
    # had any, are as lost as its text).
    result.stop_signals.append(
        StopSignal(
            request_id=request_id,
            model=head.model,
            reason=DeadLetterReason.RESTORE_FAILED,
            generated_tokens=head.generated_tokens,
        )
    )
    return result


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
