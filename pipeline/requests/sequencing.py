"""Sequencing: the seq rules that decide what each event is to its request.

A prompt opens a request (or is a duplicate); a later event of a live request is decoded now
when it is the next seq (with the held ones it releases), held when it comes early, counted
as a duplicate when seen before; an event of an ended request is a duplicate, an event after
a stop, or a dead letter. What is to be decoded is collected per request (`Work`) for the
batch's decode round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pipeline.decode_stream import DecodeStream
from pipeline.request_state import (
    ActiveRequest,
    FailedRequest,
    FinishedRequest,
    HeldEvent,
    RequestState,
    RestoredRequest,
)
from pipeline.requests import failures
from pipeline.requests.outcomes import Outcomes
from pipeline.requests.work import Work
from pipeline.results import BatchResult, Origin
from pipeline.tokenizer_registry import TokenizerRegistry, UnknownModelError
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt, ParsedTokens

# How many out-of-order events one request may hold while it waits for a missing seq. Producers
# that reorder do so by a few events (retries across partitions leaders); a request whose gap
# needs more than this is broken upstream, and holding more only grows memory and changelog.
MAX_HELD_EVENTS = 64


class Sequencer:
    """Applies the seq rules to one event at a time, sharing the processor's requests."""

    def __init__(
        self,
        outcomes: Outcomes,
        registry: TokenizerRegistry,
        rebuilt: Callable[[str, RestoredRequest], ActiveRequest],
        *,
        unknown_generated_ids: Literal["error", "skip"],
        max_held_bytes: int | None,
    ) -> None:
        self.outcomes = outcomes
        self.requests: dict[str, RequestState | RestoredRequest] = outcomes.requests
        self.registry = registry
        self.rebuilt = rebuilt
        self.unknown_generated_ids = unknown_generated_ids
        # Held (out-of-order) events are stored in the request's snapshot until the gap closes;
        # past this many bytes of held records in one request, it fails like a gap that never
        # closes, before its snapshot outgrows the changelog's record size. None: no limit.
        self.max_held_bytes = max_held_bytes

    def sequence(
        self,
        event: ParsedEvent,
        origin: Origin,
        at: float,
        work: dict[str, Work],
        result: BatchResult,
    ) -> None:
        request_id = event.request_id
        state = self.requests.get(request_id)
        if type(state) is ActiveRequest and type(event) is not ParsedPrompt:
            # The common case first: the next event of a live request.
            if at > state.last_event_at:
                state.last_event_at = at
            self._active(request_id, state, event, origin, work, result)
            return
        if type(event) is ParsedPrompt:
            if state is None or (type(state) is FailedRequest and state.at_open):
                self._open(event, origin, at, result)
            else:
                result.duplicates += 1
            return
        if state is None:
            self.outcomes.dead_letter(
                result,
                DeadLetterReason.MISSING_PROMPT,
                event,
                origin,
                "no prompt event was seen for this request",
            )
            return
        if type(state) is RestoredRequest:
            state = self.rebuilt(request_id, state)
        state.last_event_at = max(state.last_event_at, at)
        if isinstance(state, FailedRequest):
            self.outcomes.dead_letter(
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
                self.outcomes.after_stop(request_id, state, event, result)
            else:
                self.outcomes.dead_letter(
                    result,
                    DeadLetterReason.EVENT_AFTER_FINISH,
                    event,
                    origin,
                    f"seq {event.seq} after finish at seq {state.last_seq}",
                )
            return
        self._active(request_id, state, event, origin, work, result)

    def _active(
        self,
        request_id: str,
        state: ActiveRequest,
        event: ParsedTokens | ParsedFinish,
        origin: Origin,
        work: dict[str, Work],
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
            self.outcomes.dead_letter(
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
                failures.fail_gap(self.outcomes, request_id, state, work, result)
            return
        if entry is None:
            entry = work[request_id] = Work(request_id, state)
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
            self.outcomes.dead_letter(
                result, DeadLetterReason.UNKNOWN_MODEL, event, origin, str(error)
            )
            self.requests[request_id] = FailedRequest(
                model=event.model,
                reason=DeadLetterReason.UNKNOWN_MODEL,
                last_event_at=at,
                at_open=True,
            )
            return
        bad_id = model.first_out_of_range(event.prompt_token_ids)
        if bad_id is not None:
            self.outcomes.dead_letter(
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
            **self.outcomes.stages.opened(event, model),
        )


def _prompt_tokens(event: ParsedPrompt) -> int:
    """The prompt's full length: its count when the producer sent only a tail."""
    count = event.prompt_tokens
    return len(event.prompt_token_ids) if count is None else count
