"""Outcomes: what leaves the processor for a request, in one place.

Text deltas, completions, filtered-id records and dead letters are made here, and so is a
request's end: its completion, its marker in place of its state, its held events dead-lettered
(each record one fate), its changelog segments retired. The failure paths
(`pipeline.requests.failures`) and the expiry (`pipeline.requests.expiry`) end requests through
it; the processor's own decode path publishes through it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pipeline.dead_letter_reasons import REASONS
from pipeline.request_state import (
    ActiveRequest,
    FailedRequest,
    FinishedRequest,
    HeldEvent,
    RequestState,
    RestoredRequest,
    json_prefix,
)
from pipeline.results import BatchResult, DeadLetter, Delta, Origin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Completion, DeadLetterReason, FilteredIdsRecord, StopSignal
from schemas.fast_events import ParsedEvent, ParsedFinish

if TYPE_CHECKING:
    from pipeline.stages import Plan, Stages


class Outcomes:
    """Publishes a request's results into a `BatchResult` and ends requests.

    Shares the processor's table of requests and of retired segments (the same dicts), so that
    ending a request here is ending it for the processor.
    """

    def __init__(
        self,
        requests: dict[str, RequestState | RestoredRequest],
        retired_segments: dict[str, int],
        registry: TokenizerRegistry,
        max_text_bytes: int | None,
        stages: Stages,
    ) -> None:
        self.requests = requests
        self.retired_segments = retired_segments
        self.registry = registry
        self.max_text_bytes = max_text_bytes
        self.stages = stages  # chooses each request's text stages

    @staticmethod
    def dead_letter(
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

    def dead_letter_all(
        self,
        result: BatchResult,
        reason: DeadLetterReason,
        events: Iterable[HeldEvent],
        message: str,
    ) -> None:
        for held in events:
            self.dead_letter(result, reason, held.event, held.origin, message)

    def dead_letter_held(
        self, result: BatchResult, state: ActiveRequest, reason: DeadLetterReason, message: str
    ) -> None:
        """Dead-letter every event the request holds, in seq order, and let go of them."""
        held = state.held
        self.dead_letter_all(result, reason, (held[seq] for seq in sorted(held)), message)
        state.release_held()

    def publish(
        self,
        request_id: str,
        state: ActiveRequest,
        seq: int,
        text: str,
        final: bool,
        result: BatchResult,
        plan: Plan | None = None,
    ) -> None:
        """Publish the delta of `text` (what the stages before publishing released: it ends
        where the text ends, less what is held back) through the request's stages, which fill
        in their fields; a delta that carries nothing is not published, unless `final`."""
        if plan is None:
            plan = self.stages.of(request_id, state)
        if not (plan.stages or text or final):
            return
        offset = state.text_chars - len(state.stop_held) - len(text)
        delta = Delta(request_id, state.model, state.delta_start, seq, offset, text, final)
        if plan.publishes:
            for publish in plan.publishes:
                publish(state, delta)
            if not (final or delta.text or delta.logprobs or delta.reasoning or delta.tool_calls):
                return
        result.deltas.append(delta)
        state.delta_start = seq + 1

    def filtered_ids(self, request_id: str, state: ActiveRequest, result: BatchResult) -> None:
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

    def fitting(self, state: ActiveRequest, text: str) -> str:
        """The longest prefix of `text` that keeps the request within `max_text_bytes`."""
        limit = self.max_text_bytes
        if limit is None:
            return text
        return json_prefix(text, max(limit - state.text_size, 0))

    def completion(
        self,
        request_id: str,
        state: ActiveRequest,
        status: Literal["ok", "failed"],
        finish_reason: str | None,
        error: str | None = None,
        stop_reason: str | None = None,
        plan: Plan | None = None,
    ) -> Completion:
        """The request's completion, its stages' fields filled in (`plan`: the stages its
        last chunk went through, when the caller has them)."""
        fields: dict[str, Any] = {
            "request_id": request_id,
            "model": state.model,
            "text": state.text(),
            "status": status,
            "finish_reason": finish_reason,
            "prompt_tokens": state.prompt_tokens,
            "generated_tokens": state.generated_tokens,
            "filtered_prompt_ids": list(state.stream.filtered_prompt_ids),
            "error": error,
            "stop_reason": stop_reason,
        }
        if plan is None:
            plan = self.stages.of(request_id, state)
        for complete in plan.completes:
            complete(state, fields)
        return Completion(**fields)

    def end_failed(
        self,
        request_id: str,
        state: ActiveRequest,
        reason: DeadLetterReason,
        message: str,
        result: BatchResult,
        last_delta: tuple[int, str] | None = None,
        *,
        finish_seen: bool = False,
    ) -> None:
        """Fail a live request: its final delta (seq, the text the failing chunk added) when
        it has one, a failed completion with the text so far, and the failed marker; and a stop
        signal unless its finish event was consumed (`finish_seen`: in the failing chunk; or
        held)."""
        plan = self.stages.of(request_id, state)
        if last_delta is None and any(holds(state) for holds in plan.holders):
            # Text a stage holds back (for a possible stop string) is the request's: it goes
            # out too.
            seq = state.next_seq - 1
            state.delta_start = min(state.delta_start, seq)
            last_delta = (seq, "")
        if last_delta is not None:
            seq, text = last_delta
            text = state.stop_held + text
            state.stop_held = ""
            self.publish(request_id, state, seq, text, True, result, plan)
        completion = self.completion(request_id, state, "failed", None, message, plan=plan)
        result.completions.append(completion)
        if not (finish_seen or holds_finish(state)):
            stop_signal(request_id, state, reason, result)
        marker = FailedRequest(model=state.model, reason=reason, last_event_at=state.last_event_at)
        self.close(request_id, state, marker, result)

    def close(
        self, request_id: str, state: ActiveRequest, marker: RequestState, result: BatchResult
    ) -> None:
        """Replace an active request by its marker; held events can never be applied now."""
        if type(marker) is FinishedRequest and marker.stopped:
            if state.held:
                # Events already held past a stop are events after it, like those still to come.
                for seq in sorted(state.held):
                    self.after_stop(request_id, marker, state.held[seq].event, result)
                state.release_held()
            if marker.stopped:  # still: no finish among them, the engine may be generating
                stop_signal(request_id, state, "stop_string", result)
        reason = (
            DeadLetterReason.EVENT_AFTER_FINISH
            if isinstance(marker, FinishedRequest)
            else DeadLetterReason.REQUEST_ALREADY_FAILED
        )
        self.dead_letter_held(result, state, reason, "event held for a request that has ended")
        self.retire(request_id, state)
        self.requests[request_id] = marker
        result.touched.add(request_id)

    def retire(self, request_id: str, state: ActiveRequest) -> None:
        """An active request ends: its text segments are deleted with its next records."""
        if state.text_segments:
            self.retired_segments[request_id] = state.text_segments

    def after_stop(
        self, request_id: str, state: FinishedRequest, event: ParsedEvent, result: BatchResult
    ) -> None:
        """An event after a stop string ended the request: consumed and counted; its finish
        makes the marker a plain finished one (later events are then `event_after_finish`)."""
        result.events_after_stop += 1
        state.last_seq = event.seq
        if type(event) is ParsedFinish:
            state.stopped = False
        result.touched.add(request_id)


def holds_finish(state: ActiveRequest) -> bool:
    """Whether the request's finish event is among its held events (consumed, not yet in
    order): its engine has finished, and a stop signal would tell it nothing."""
    return bool(state.held) and any(type(h.event) is ParsedFinish for h in state.held.values())


def stop_signal(
    request_id: str,
    state: ActiveRequest,
    reason: Literal["stop_string"] | DeadLetterReason,
    result: BatchResult,
) -> None:
    """The request ends before its finish event: tell its engine (the control topic), which
    may still be generating for it. Made only on this rare path, never for a plain finish."""
    result.stop_signals.append(
        StopSignal(
            request_id=request_id,
            model=state.model,
            reason=reason,
            generated_tokens=state.generated_tokens,
        )
    )
