"""Expiry: the end of requests nothing will complete, and of markers nothing needs.

An idle request is one whose producer died mid-generation; after the TTL nothing will complete
it, and holding its state forever would leak memory and changelog. Finished and failed markers
only serve to classify late duplicates, and are forgotten after their retention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.dead_letter_reasons import REASONS
from pipeline.request_state import (
    ActiveRequest,
    FailedRequest,
    RequestState,
    RestoredRequest,
)
from pipeline.requests.outcomes import Outcomes, holds_finish, stop_signal
from pipeline.results import BatchResult, DeadLetter
from schemas.events import DeadLetterReason, encode_json


@dataclass
class Lifetimes:
    """How long requests and markers live without an event (`RequestProcessor`'s settings)."""

    request_ttl_s: float
    finished_retention_s: float
    # The live state of a request as restored (`RequestProcessor._rebuilt`).
    rebuilt: Callable[[str, RestoredRequest], ActiveRequest]


def expire(
    out: Outcomes,
    lifetimes: Lifetimes,
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
    (see `due`).
    """
    result = BatchResult()
    reference_of = reference if callable(reference) else _constant(reference)
    if latest is None and not callable(reference):
        latest = reference
    ended = 0
    ttl = lifetimes.request_ttl_s
    for request_id, state in due(out, lifetimes, latest):
        if limit is not None and ended >= limit:
            break
        at = reference_of(request_id)
        if latest is not None and at > latest:
            at = latest
        idle = at - state.last_event_at
        if type(state) is RestoredRequest:
            if idle < ttl:
                continue
            state = lifetimes.rebuilt(request_id, state)
        if type(state) is ActiveRequest:
            if idle < ttl:
                continue
            expire_active(out, ttl, request_id, state, idle, at, result)
        elif idle >= lifetimes.finished_retention_s:
            del out.requests[request_id]
            result.touched.add(request_id)
        else:
            continue
        ended += 1
    return result


def due(
    out: Outcomes, lifetimes: Lifetimes, latest: float | None
) -> list[tuple[str, RequestState | RestoredRequest]]:
    """The requests an expiry must look at: all of them, or with `latest` only those idle
    for at least the shorter bound at `latest`. A worker with a million open requests
    called the reference of each once a second, a sweep costing most of its loop; the
    comprehension costs a small fraction of that, and the few old requests get the full
    check."""
    items = out.requests.items()
    if latest is None:
        return list(items)
    horizon = latest - min(lifetimes.request_ttl_s, lifetimes.finished_retention_s)
    return [(r, s) for r, s in items if s.last_event_at <= horizon]


def expire_active(
    out: Outcomes,
    ttl: float,
    request_id: str,
    state: ActiveRequest,
    idle: float,
    at: float,
    result: BatchResult,
) -> None:
    """Fail an idle request: its held events and a synthetic record go to dead letters.

    A request that never got past its prompt publishes no completion. It has no text, and
    its id may be that of a request finished long ago whose prompt came again after the
    finished marker was forgotten (a late duplicate): a `failed` empty completion would then
    replace the `ok` one in the compacted completions topic. Remembering every finished id
    forever to tell the two apart would cost memory and changelog without bound; the
    `ttl_expired` dead letter tells the user the same thing.
    """
    message = f"no event for {idle:.0f}s (ttl {ttl:.0f}s)"
    if not holds_finish(state):  # an engine stuck or slow: it may yet generate for it
        stop_signal(request_id, state, DeadLetterReason.TTL_EXPIRED, result)
    out.dead_letter_held(
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
        result.completions.append(out.completion(request_id, state, "failed", None, message))
    out.retire(request_id, state)
    out.requests[request_id] = FailedRequest(
        model=state.model, reason=DeadLetterReason.TTL_EXPIRED, last_event_at=at
    )
    result.touched.add(request_id)


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
