"""Events in, results out: the per-request lifecycle shared by `detok run` and the Kafka worker.

A request is a prompt (seq 0), generated-id chunks (seq 1, 2, ...) and a finish. The processor
applies the sequence rules, drives one batched decode round per input batch, and returns plain
results: text deltas, completions, filtered-id metrics and dead letters. It never sees Kafka: the
caller hands it parsed events with an opaque `Origin` and ships whatever comes back.

State lives in `RequestProcessor.requests` (request id -> state), so the worker can snapshot the
requests a batch touched into its changelog and rebuild them after a crash or a rebalance.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream, StrictDecodeError
from pipeline.tokenizer_registry import TokenizerRegistry, UnknownModelError
from pipeline.vocab_tables import profile_for
from schemas.events import Completion, DeadLetterReason, FilteredIdsMetric, encode_json
from schemas.fast_events import (
    Event,
    FinishEvent,
    PromptEvent,
    TokensEvent,
    event_from_json,
    event_to_json,
)

# How many out-of-order events one request may hold while it waits for a missing seq. Producers
# that reorder do so by a few events (retries across partitions leaders); a request whose gap
# needs more than this is broken upstream, and holding more only grows memory and changelog.
MAX_HELD_EVENTS = 64


class Origin(Protocol):
    """Where an event came from: what a dead letter or a held event's snapshot needs of it.

    The processor only stores origins and hands them back; `EventOrigin` is the plain one, and
    the Kafka worker passes a lazy view of the consumed record instead (building a full origin
    for every record cost as much as parsing it, and only dead letters ever read one).
    """

    @property
    def source(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def value(self) -> bytes: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]: ...
    @property
    def timestamp_ms(self) -> int | None: ...
    def to_json(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class EventOrigin:
    """Where an event came from, kept so a dead letter can carry the original bytes.

    For a JSONL file: the file name, the line number as offset, and the line as value; for a
    Kafka record (restored from a snapshot): topic, partition, offset, key, value, headers and
    timestamp. One is built per input line, so it is a plain slotted dataclass: a frozen one
    costs 4x as much to create.
    """

    source: str
    partition: int
    offset: int
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "partition": self.partition,
            "offset": self.offset,
            "value": base64.b64encode(self.value).decode(),
            "key": None if self.key is None else base64.b64encode(self.key).decode(),
            "headers": [[k, base64.b64encode(v).decode()] for k, v in self.headers],
            "timestamp_ms": self.timestamp_ms,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventOrigin:
        key = data["key"]
        return cls(
            source=data["source"],
            partition=data["partition"],
            offset=data["offset"],
            value=base64.b64decode(data["value"]),
            key=None if key is None else base64.b64decode(key),
            headers=tuple((k, base64.b64decode(v)) for k, v in data["headers"]),
            timestamp_ms=data["timestamp_ms"],
        )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be processed, and why.

    `origin` is None only for records the processor makes up itself (a TTL expiry), whose value
    is then `synthetic_value`.
    """

    reason: DeadLetterReason
    error_class: str
    message: str
    request_id: str | None
    seq: int | None
    origin: Origin | None
    synthetic_value: bytes = b""

    @property
    def value(self) -> bytes:
        return self.origin.value if self.origin is not None else self.synthetic_value


@dataclass(slots=True)
class Delta:
    """New text of one request over input seqs seq_start..seq_end, before it goes on the wire.

    Plain and mutable so the worker can coalesce a request's deltas of one transaction by
    extending the first (`absorb`) and build the wire model once, at commit.
    """

    request_id: str
    model: str
    seq_start: int
    seq_end: int
    text: str
    final: bool = False

    def absorb(self, later: Delta) -> None:
        self.seq_end = later.seq_end
        self.text += later.text
        self.final = later.final

    def to_wire_json(self) -> bytes:
        """The `TextDelta` record, encoded directly: building and dumping the pydantic model
        took ~7 us a delta against ~1 us here, and the worker writes thousands per commit."""
        return encode_json(
            {
                "type": "delta",
                "request_id": self.request_id,
                "model": self.model,
                "seq_start": self.seq_start,
                "seq_end": self.seq_end,
                "text": self.text,
                "final": self.final,
            }
        )


@dataclass(slots=True)
class HeldEvent:
    event: TokensEvent | FinishEvent
    origin: Origin


@dataclass
class ActiveRequest:
    """A live request: its decode stream, the text so far, and where its sequence stands."""

    model: str
    stream: DecodeStream
    prompt_tokens: int
    next_seq: int = 1  # the seq that must come next; later ones are held
    delta_start: int = 1  # first seq not yet covered by a published delta
    generated_tokens: int = 0
    text: str = ""
    metric_sent: bool = False
    last_event_at: float = 0.0
    held: dict[int, HeldEvent] = field(default_factory=dict)


@dataclass
class FailedRequest:
    """A request that can no longer produce text; its later events are dead-lettered too."""

    model: str | None
    reason: DeadLetterReason
    last_event_at: float = 0.0


@dataclass
class FinishedRequest:
    """A marker kept after finish so that late duplicates are counted, not dead-lettered."""

    last_seq: int
    last_event_at: float = 0.0


RequestState = ActiveRequest | FailedRequest | FinishedRequest


@dataclass
class BatchResult:
    """Everything one `process` call produced, in the order the caller should publish it."""

    deltas: list[Delta] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    metrics: list[FilteredIdsMetric] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    duplicates: int = 0
    events_by_type: dict[str, int] = field(
        default_factory=lambda: {"prompt": 0, "tokens": 0, "finish": 0}
    )
    decoded_tokens: int = 0
    # Request ids whose state changed (or was removed): the worker snapshots exactly these.
    touched: set[str] = field(default_factory=set)


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
    ) -> None:
        self.registry = registry
        self.unknown_generated_ids = unknown_generated_ids
        # An idle request is one whose producer died mid-generation; after this long nothing
        # will complete it, and holding its state forever would leak memory and changelog.
        self.request_ttl_s = request_ttl_s
        # Finished and failed markers only serve to classify late duplicates; a duplicate that
        # comes later than this is treated as a fresh (orphan) event.
        self.finished_retention_s = finished_retention_s
        self.requests: dict[str, RequestState] = {}

    def warm_up(self) -> None:
        """Build every model's decode tables now rather than inside the first batch that needs
        them: that costs a few hundred ms per tokenizer, a latency spike nobody should see."""
        for name in self.registry.names:
            profile_for(self.registry.get(name).tokenizer)

    # -- the batch ----------------------------------------------------------------------------

    def process(self, batch: Iterable[tuple[Event, Origin]], now: float = 0.0) -> BatchResult:
        result = BatchResult()
        work: dict[str, _Work] = {}
        for event, origin in batch:
            result.events_by_type[event.type] += 1
            self._sequence(event, origin, now, work, result)
        self._decode(list(work.values()), result)
        return result

    def _sequence(
        self,
        event: Event,
        origin: Origin,
        now: float,
        work: dict[str, _Work],
        result: BatchResult,
    ) -> None:
        request_id = event.request_id
        state = self.requests.get(request_id)
        if type(state) is ActiveRequest and type(event) is not PromptEvent:
            # The common case first: the next event of a live request.
            state.last_event_at = now
            self._sequence_active(request_id, state, event, origin, work, result)
            return
        if isinstance(event, PromptEvent):
            if state is None:
                self._open(event, origin, now, result)
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
        state.last_event_at = now
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
        event: TokensEvent | FinishEvent,
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
            held[seq] = HeldEvent(event, origin)
            if len(held) > MAX_HELD_EVENTS:
                self._fail_gap(request_id, state, result)
                work.pop(request_id, None)
            return
        if entry is None:
            entry = work[request_id] = _Work(request_id, state)
        entry.events.append(HeldEvent(event, origin))
        next_seq += 1
        if type(event) is FinishEvent:
            entry.finished = True
        # Events that were waiting for this one are now in order, up to a finish.
        while not entry.finished and next_seq in held:
            queued = held.pop(next_seq)
            entry.events.append(queued)
            next_seq += 1
            entry.finished = type(queued.event) is FinishEvent
        state.next_seq = next_seq

    def _open(self, event: PromptEvent, origin: Origin, now: float, result: BatchResult) -> None:
        request_id = event.request_id
        result.touched.add(request_id)
        try:
            model = self.registry.get(event.model)
        except UnknownModelError as error:
            self._dead_letter(
                result,
                DeadLetterReason.UNKNOWN_MODEL,
                event,
                origin,
                str(error),
                error_class="UnknownModelError",
            )
            self.requests[request_id] = FailedRequest(
                event.model, DeadLetterReason.UNKNOWN_MODEL, now
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
                error_class="TokenIdOutOfRange",
            )
            self.requests[request_id] = FailedRequest(
                event.model, DeadLetterReason.TOKEN_ID_OUT_OF_RANGE, now
            )
            return
        stream = DecodeStream(
            model.tokenizer,
            event.prompt_token_ids,
            skip_special_tokens=event.skip_special_tokens,
            unknown_generated_ids=self.unknown_generated_ids,
        )
        self.requests[request_id] = ActiveRequest(
            model=event.model,
            stream=stream,
            prompt_tokens=len(event.prompt_token_ids),
            last_event_at=now,
        )

    # -- decoding -----------------------------------------------------------------------------

    def _decode(self, work: Sequence[_Work], result: BatchResult) -> None:
        # Only requests still active get decoded: a gap overflow may have failed one meanwhile.
        work = [w for w in work if self.requests.get(w.request_id) is w.state]
        chunks = [_joined_ids(w.events) for w in work]
        outcomes = decode_round(
            [(w.state.stream, chunk) for w, chunk in zip(work, chunks, strict=True)]
        )
        for entry, chunk, outcome in zip(work, chunks, outcomes, strict=True):
            if outcome.error is None:
                self._advance(entry, chunk, outcome.text, result)
            else:
                self._fail_decode(entry, chunk, outcome.text, outcome.error, result)

    def _advance(self, entry: _Work, chunk: list[int], text: str, result: BatchResult) -> None:
        state = entry.state
        state.generated_tokens += len(chunk)
        result.decoded_tokens += len(chunk)
        last = entry.events[-1].event
        finished = isinstance(last, FinishEvent)
        if finished:
            text += state.stream.flush()
        state.text += text
        self._maybe_metric(entry.request_id, state, result)
        if text or finished:
            result.deltas.append(
                Delta(entry.request_id, state.model, state.delta_start, last.seq, text, finished)
            )
            state.delta_start = last.seq + 1
        if finished:
            result.completions.append(
                self._completion(entry.request_id, state, "ok", last.finish_reason)
            )
            self._close(
                entry.request_id, state, FinishedRequest(last.seq, state.last_event_at), result
            )

    def _fail_decode(
        self,
        entry: _Work,
        chunk: list[int],
        partial_text: str,
        error: Exception,
        result: BatchResult,
    ) -> None:
        state = entry.state
        # The failing id is the first occurrence of its value: any earlier one would have failed.
        bad_id = getattr(error, "token_id", None)
        bad_index = chunk.index(bad_id) if bad_id in chunk else len(chunk)
        state.generated_tokens += bad_index
        result.decoded_tokens += bad_index
        state.text += partial_text
        self._maybe_metric(entry.request_id, state, result)
        failing = _failing_event_index(entry.events, bad_index)
        failing_event = entry.events[failing]
        failing_seq = failing_event.event.seq
        self._dead_letter(
            result,
            DeadLetterReason.STRICT_DECODE_FAILURE,
            failing_event.event,
            failing_event.origin,
            str(error),
            error_class=type(error).__name__,
        )
        for held in entry.events[failing + 1 :]:
            self._dead_letter(
                result,
                DeadLetterReason.REQUEST_ALREADY_FAILED,
                held.event,
                held.origin,
                "an earlier event of this request failed to decode",
            )
        result.deltas.append(
            Delta(entry.request_id, state.model, state.delta_start, failing_seq, partial_text, True)
        )
        result.completions.append(
            self._completion(entry.request_id, state, "failed", None, str(error))
        )
        failed = FailedRequest(
            state.model, DeadLetterReason.STRICT_DECODE_FAILURE, state.last_event_at
        )
        self._close(entry.request_id, state, failed, result)

    def _maybe_metric(self, request_id: str, state: ActiveRequest, result: BatchResult) -> None:
        filtered = state.stream.filtered_prompt_ids
        if filtered and not state.metric_sent:
            state.metric_sent = True
            result.metrics.append(
                FilteredIdsMetric(
                    request_id=request_id,
                    model=state.model,
                    filtered_ids=list(filtered),
                    filtered_count=len(filtered),
                    prompt_tokens=state.prompt_tokens,
                )
            )

    # -- endings ------------------------------------------------------------------------------

    def _completion(
        self,
        request_id: str,
        state: ActiveRequest,
        status: Literal["ok", "failed"],
        finish_reason: str | None,
        error: str | None = None,
    ) -> Completion:
        return Completion(
            request_id=request_id,
            model=state.model,
            text=state.text,
            status=status,
            finish_reason=finish_reason,
            prompt_tokens=state.prompt_tokens,
            generated_tokens=state.generated_tokens,
            filtered_prompt_ids=list(state.stream.filtered_prompt_ids),
            error=error,
        )

    def _close(
        self, request_id: str, state: ActiveRequest, marker: RequestState, result: BatchResult
    ) -> None:
        """Replace an active request by its marker; held events can never be applied now."""
        for seq in sorted(state.held):
            held = state.held[seq]
            self._dead_letter(
                result,
                DeadLetterReason.EVENT_AFTER_FINISH
                if isinstance(marker, FinishedRequest)
                else DeadLetterReason.REQUEST_ALREADY_FAILED,
                held.event,
                held.origin,
                "event held for a request that has ended",
            )
        state.held.clear()
        self.requests[request_id] = marker
        result.touched.add(request_id)

    def _fail_gap(self, request_id: str, state: ActiveRequest, result: BatchResult) -> None:
        message = f"seq {state.next_seq} never arrived; {len(state.held)} later events held"
        for seq in sorted(state.held):
            held = state.held[seq]
            self._dead_letter(
                result, DeadLetterReason.SEQUENCE_GAP, held.event, held.origin, message
            )
        state.held.clear()
        result.completions.append(self._completion(request_id, state, "failed", None, message))
        self._close(
            request_id,
            state,
            FailedRequest(state.model, DeadLetterReason.SEQUENCE_GAP, state.last_event_at),
            result,
        )

    def expire(self, now: float) -> BatchResult:
        """End what has been idle too long: live requests fail (TTL), markers are forgotten."""
        result = BatchResult()
        for request_id, state in list(self.requests.items()):
            idle = now - state.last_event_at
            if isinstance(state, ActiveRequest):
                if idle < self.request_ttl_s:
                    continue
                message = f"no event for {idle:.0f}s (ttl {self.request_ttl_s:.0f}s)"
                for seq in sorted(state.held):
                    held = state.held[seq]
                    self._dead_letter(
                        result,
                        DeadLetterReason.SEQUENCE_GAP,
                        held.event,
                        held.origin,
                        f"seq {state.next_seq} never arrived",
                    )
                state.held.clear()
                result.dead_letters.append(
                    DeadLetter(
                        reason=DeadLetterReason.TTL_EXPIRED,
                        error_class="RequestExpired",
                        message=message,
                        request_id=request_id,
                        seq=state.next_seq,
                        origin=None,
                        synthetic_value=_expiry_record(request_id, state),
                    )
                )
                result.completions.append(
                    self._completion(request_id, state, "failed", None, message)
                )
                self.requests[request_id] = FailedRequest(
                    state.model, DeadLetterReason.TTL_EXPIRED, now
                )
                result.touched.add(request_id)
            elif idle >= self.finished_retention_s:
                del self.requests[request_id]
                result.touched.add(request_id)
        return result

    def flush_incomplete(self) -> BatchResult:
        """At the end of a finite input: every request still open is dead-lettered as expired."""
        self.request_ttl_s = 0.0
        return self.expire(float("inf"))

    @staticmethod
    def _dead_letter(
        result: BatchResult,
        reason: DeadLetterReason,
        event: Event,
        origin: Origin,
        message: str,
        error_class: str = "SequenceError",
    ) -> None:
        result.dead_letters.append(
            DeadLetter(reason, error_class, message, event.request_id, event.seq, origin)
        )

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self, request_id: str) -> dict[str, Any] | None:
        """The JSON-able state of one request, or None when it is gone (a tombstone)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        if isinstance(state, FinishedRequest):
            return {"kind": "finished", "last_seq": state.last_seq, "at": state.last_event_at}
        if isinstance(state, FailedRequest):
            return {
                "kind": "failed",
                "model": state.model,
                "reason": state.reason.value,
                "at": state.last_event_at,
            }
        return {
            "kind": "active",
            "model": state.model,
            "stream": state.stream.snapshot(),
            "prompt_tokens": state.prompt_tokens,
            "next_seq": state.next_seq,
            "delta_start": state.delta_start,
            "generated_tokens": state.generated_tokens,
            "text": state.text,
            "metric_sent": state.metric_sent,
            "at": state.last_event_at,
            "held": [
                {"event": event_to_json(held.event), "origin": held.origin.to_json()}
                for held in state.held.values()
            ],
        }

    def restore(self, request_id: str, snapshot: dict[str, Any] | None) -> None:
        """Put back one request from its snapshot (None removes it)."""
        if snapshot is None:
            self.requests.pop(request_id, None)
            return
        kind = snapshot["kind"]
        if kind == "finished":
            self.requests[request_id] = FinishedRequest(snapshot["last_seq"], snapshot["at"])
        elif kind == "failed":
            self.requests[request_id] = FailedRequest(
                snapshot["model"], DeadLetterReason(snapshot["reason"]), snapshot["at"]
            )
        else:
            tokenizer = self.registry.get(snapshot["model"]).tokenizer
            held = {}
            for item in snapshot["held"]:
                event = event_from_json(item["event"])
                held[event.seq] = HeldEvent(event, EventOrigin.from_json(item["origin"]))
            self.requests[request_id] = ActiveRequest(
                model=snapshot["model"],
                stream=DecodeStream.from_snapshot(tokenizer, snapshot["stream"]),
                prompt_tokens=snapshot["prompt_tokens"],
                next_seq=snapshot["next_seq"],
                delta_start=snapshot["delta_start"],
                generated_tokens=snapshot["generated_tokens"],
                text=snapshot["text"],
                metric_sent=snapshot["metric_sent"],
                last_event_at=snapshot["at"],
                held=held,
            )

    @property
    def active_requests(self) -> int:
        return sum(isinstance(s, ActiveRequest) for s in self.requests.values())


def _joined_ids(events: Sequence[HeldEvent]) -> list[int]:
    """The generated ids of a request's in-order events, as one chunk (list extends, no
    per-id Python loop: this runs for every active request of every batch)."""
    ids: list[int] = []
    for held in events:
        if type(held.event) is TokensEvent:
            ids += held.event.token_ids
    return ids


def _failing_event_index(events: Sequence[HeldEvent], bad_index: int) -> int:
    """Which of a request's in-order events holds the id at `bad_index` of their joined chunk."""
    consumed = 0
    for index, held in enumerate(events):
        if isinstance(held.event, TokensEvent):
            consumed += len(held.event.token_ids)
            if bad_index < consumed:
                return index
    return len(events) - 1


def _expiry_record(request_id: str, state: ActiveRequest) -> bytes:
    return json.dumps(
        {
            "request_id": request_id,
            "model": state.model,
            "next_seq": state.next_seq,
            "generated_tokens": state.generated_tokens,
            "text": state.text,
        }
    ).encode()


__all__ = [
    "BatchResult",
    "DeadLetter",
    "EventOrigin",
    "Origin",
    "RequestProcessor",
    "StrictDecodeError",
]
