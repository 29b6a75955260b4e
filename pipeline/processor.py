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

What leaves the processor is made in `pipeline.requests.outcomes`, every failure path is in
`pipeline.requests.failures`, expiry in `pipeline.requests.expiry`, and what decode options do
to the text in `pipeline.stages`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from tokenizers import Tokenizer

from pipeline.chat.config import ChatParsers
from pipeline.decode_stream import StrictDecodeError
from pipeline.errors import SnapshotError
from pipeline.request_state import (
    ActiveRequest,
    RequestState,
    RestoredRequest,
    encode_head,
    encode_snapshot,
    rebuild,
    restore_state,
    segment_key,
)
from pipeline.requests import expiry, failures
from pipeline.requests.decoding import Decoder
from pipeline.requests.expiry import Lifetimes
from pipeline.requests.outcomes import Outcomes
from pipeline.requests.sequencing import MAX_HELD_EVENTS, Sequencer
from pipeline.requests.work import Work
from pipeline.results import BatchResult, DeadLetter, Delta, EventOrigin, Origin
from pipeline.stages import StageConfig, Stages
from pipeline.tokenizer_registry import TokenizerRegistry
from pipeline.vocab_tables import profile_for
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedEvent
from schemas.validation import is_record_fault

# The default: no model has a chat-output parser (frozen, so one instance serves every processor).
NO_CHAT_PARSERS = ChatParsers()


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
        chat_parsers: ChatParsers = NO_CHAT_PARSERS,
    ) -> None:
        self.registry = registry
        # An idle request is one whose producer died mid-generation; after this long nothing
        # will complete it, and holding its state forever would leak memory and changelog.
        self.request_ttl_s = request_ttl_s
        # Finished and failed markers only serve to classify late duplicates; a duplicate that
        # comes later than this is treated as a fresh event (see `expiry.expire_active` for why a
        # late prompt reopening a finished request can no longer replace its completion).
        self.finished_retention_s = finished_retention_s
        # A request's text is carried whole by its completion and by each of its snapshots, so
        # it must fit the output topics' record size: past this many bytes (as JSON: UTF-8,
        # escapes included) the request fails (`output_too_large`) with the text up to the
        # limit. None: no limit.
        self.max_text_bytes = max_text_bytes
        self.requests: dict[str, RequestState | RestoredRequest] = {}
        # Requests that ended since their last changelog records, with how many text segments
        # they had there: each segment key gets a tombstone (`changelog_records`).
        self.retired_segments: dict[str, int] = {}
        # Each request's text stages (stop strings, logprobs, chat outputs) are chosen by
        # these, from its prompt and this configuration (`chat_parsers`: the reasoning and
        # tool-call parsers of each model, docs/chat-outputs.md).
        stages = Stages(StageConfig(registry, chat_parsers))
        self.outcomes = Outcomes(
            self.requests, self.retired_segments, registry, max_text_bytes, stages
        )
        self.decoder = Decoder(self.outcomes, max_text_bytes)
        self.sequencer = Sequencer(
            self.outcomes,
            registry,
            self._rebuilt,
            unknown_generated_ids=unknown_generated_ids,
            max_held_bytes=max_held_bytes,
        )

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
        work: dict[str, Work] = {}
        counts = result.events_by_type
        at = now
        sequence = self.sequencer.sequence
        for event, origin in batch:
            counts[event.type] += 1
            try:
                sequence(event, origin, at, work, result)
            except BaseException as error:  # one request's fault must not end the batch
                if not is_record_fault(error):
                    raise
                failures.fail_sequencing(self.outcomes, event, origin, at, error, work, result)
        self.decoder.decode(list(work.values()), result)
        return result

    # -- expiry -------------------------------------------------------------------------------

    def expire(
        self,
        reference: float | Callable[[str], float],
        *,
        limit: int | None = None,
        latest: float | None = None,
    ) -> BatchResult:
        """End what has been idle too long: live requests fail (TTL), markers are forgotten
        (`pipeline.requests.expiry.expire`: idleness, `reference`, `latest` and `limit`)."""
        lifetimes = Lifetimes(self.request_ttl_s, self.finished_retention_s, self._rebuilt)
        return expiry.expire(self.outcomes, lifetimes, reference, limit=limit, latest=latest)

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
        """Fail a request from outside a batch (`pipeline.requests.failures.mark_failed`): the
        caller publishes what it returns, its failed completion included, with the marker."""
        state = self.state(request_id)
        return failures.mark_failed(self.outcomes, request_id, state, reason, now, message)

    def fail_restore(self, request_id: str, value: bytes | None, message: str) -> BatchResult:
        """A changelog record that cannot be restored (`failures.fail_restore`)."""
        state = self.state(request_id)
        return failures.fail_restore(self.outcomes, request_id, state, value, message)

    def _tokenizer_of(self, model: str) -> Tokenizer:
        return self.registry.get(model).tokenizer

    @property
    def active_requests(self) -> int:
        return sum(
            type(s) is ActiveRequest or type(s) is RestoredRequest for s in self.requests.values()
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
