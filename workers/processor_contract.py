"""Contract 4 of the session plan over today's `RequestProcessor` (delete at merge).

The worker is written against the processor API the lead decided (`expire(reference, limit=)`,
`forget`, `restore(request_id, bytes)` raising `SnapshotError`, `mark_failed`, `snapshot -> bytes`,
deltas with `text_offset`, the `max_text_bytes`/`max_held_bytes` limits). The processor room
implements it in parallel; until that lands, this adapter gives the worker the same calls on the
current processor. At merge: construct `RequestProcessor` directly in `workers/worker.py` and
delete this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pipeline.processor import (
    BatchResult,
    Delta,
    FailedRequest,
    Origin,
    RequestProcessor,
)
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason, encode_json
from schemas.fast_events import Event


class SnapshotError(Exception):
    """A changelog value that cannot become request state (`pipeline.errors.SnapshotError`)."""


@dataclass(slots=True)
class OffsetDelta:
    """`Delta` with the contract's `text_offset`: characters of the request's text before it."""

    request_id: str
    model: str
    seq_start: int
    seq_end: int
    text: str
    final: bool
    text_offset: int

    def absorb(self, later: OffsetDelta) -> None:
        self.seq_end = later.seq_end
        self.text += later.text
        self.final = later.final

    def to_wire_json(self) -> bytes:
        return encode_json(
            {
                "type": "delta",
                "request_id": self.request_id,
                "model": self.model,
                "seq_start": self.seq_start,
                "seq_end": self.seq_end,
                "text": self.text,
                "final": self.final,
                "text_offset": self.text_offset,
            }
        )


class ContractProcessor:
    """Today's processor, answering the contract-4 calls the worker makes."""

    def __init__(
        self,
        registry: TokenizerRegistry,
        *,
        unknown_generated_ids: Literal["error", "skip"],
        request_ttl_s: float,
        finished_retention_s: float,
        max_text_bytes: int | None = None,
        max_held_bytes: int | None = None,
    ) -> None:
        self.inner = RequestProcessor(
            registry,
            unknown_generated_ids=unknown_generated_ids,
            request_ttl_s=request_ttl_s,
            finished_retention_s=finished_retention_s,
        )
        # Not enforced by today's processor; the worker's produce-time size check is the guard.
        self.max_text_bytes = max_text_bytes
        self.max_held_bytes = max_held_bytes

    def warm_up(self) -> None:
        self.inner.warm_up()

    @property
    def active_requests(self) -> int:
        return self.inner.active_requests

    def process(self, batch: Iterable[tuple[Event, Origin]], now: float) -> BatchResult:
        batch = list(batch)
        text_before = {}
        for event, _ in batch:
            state = self.inner.requests.get(event.request_id)
            text_before.setdefault(event.request_id, len(getattr(state, "text", "")))
        result = self.inner.process(batch, now)
        result.deltas = [_with_offset(d, text_before.get(d.request_id, 0)) for d in result.deltas]
        return result

    def expire(
        self, reference: float | Callable[[str], float], *, limit: int | None = None
    ) -> BatchResult:
        at = reference if callable(reference) else (lambda _: reference)
        requests = self.inner.requests
        due: dict[str, Any] = {}
        for request_id, state in requests.items():
            bound = (
                self.inner.request_ttl_s
                if type(state).__name__ == "ActiveRequest"
                else self.inner.finished_retention_s
            )
            if at(request_id) - state.last_event_at >= bound:
                due[request_id] = state
                if limit is not None and len(due) >= limit:
                    break
        if not due:
            return BatchResult()
        for request_id in due:
            del requests[request_id]
        self.inner.requests = due
        try:
            result = self.inner.expire(float("inf"))
        finally:
            expired, self.inner.requests = self.inner.requests, requests
        for request_id, state in expired.items():
            state.last_event_at = at(request_id)
            requests[request_id] = state
        return result

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.inner.requests.pop(request_id, None)

    def restore(self, request_id: str, snapshot: bytes | None) -> None:
        try:
            decoded = None if snapshot is None else msgspec.json.decode(snapshot)
            self.inner.restore(request_id, decoded)
        except Exception as error:
            self.inner.requests.pop(request_id, None)
            raise SnapshotError(f"{type(error).__name__}: {error}") from error

    def mark_failed(self, request_id: str, reason: DeadLetterReason) -> None:
        self.inner.requests[request_id] = FailedRequest(None, reason, time.time())

    def snapshot(self, request_id: str) -> bytes | None:
        snapshot = self.inner.snapshot(request_id)
        return None if snapshot is None else encode_json(snapshot)


def _with_offset(delta: Delta, text_offset: int) -> OffsetDelta:
    return OffsetDelta(
        delta.request_id,
        delta.model,
        delta.seq_start,
        delta.seq_end,
        delta.text,
        delta.final,
        text_offset,
    )
