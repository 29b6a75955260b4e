"""What the processor hands back: text deltas, dead letters, and the result of one batch.

Kept apart from the lifecycle (`pipeline.processor`) because every caller reads these and none
needs the lifecycle to do so: the worker ships them to Kafka, `detok run` to files, metrics count
them. `Origin` is the one thing the processor needs of where an event came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.logprobs import LogprobEntry
from schemas.events import (
    Completion,
    DeadLetterReason,
    FilteredIdsRecord,
    StopSignal,
    encode_json,
)

# A Kafka header's value may be null (the Java client allows it, and so does librdkafka).
Header = tuple[str, bytes | None]


class Origin(Protocol):
    """Where an event came from: what a dead letter or a held event's snapshot needs of it.

    `value` is the record the event was parsed from, byte for byte: a dead letter carries it, and
    a held event's snapshot stores only it (the event is parsed again on restore). The processor
    only stores origins and hands them back; `EventOrigin` is the plain one, and the Kafka worker
    passes a lazy view of the consumed record instead (building a full origin for every record
    cost as much as parsing it, and only dead letters ever read one).
    """

    @property
    def source(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def headers(self) -> tuple[Header, ...]: ...
    @property
    def timestamp_ms(self) -> int | None: ...


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
    headers: tuple[Header, ...] = ()
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that could not be processed, and why.

    `origin` is None only for records the processor makes up itself (a TTL expiry), whose value
    is then `synthetic_value`. `error_class` is the name of an exception class: the one in
    `pipeline.dead_letter_reasons.REASONS[reason]`, or the exception actually raised.
    """

    reason: DeadLetterReason
    error_class: str
    message: str
    request_id: str | None
    seq: int | None
    origin: Origin | None
    synthetic_value: bytes = b""

    @property
    def value(self) -> bytes | None:
        return self.origin.value if self.origin is not None else self.synthetic_value


@dataclass(slots=True)
class Delta:
    """New text of one request over input seqs seq_start..seq_end, before it goes on the wire.

    `text_offset` counts the characters (code points) of the request's text before this delta:
    how a reader places replayed deltas under at-least-once (see `schemas.events.TextDelta`).
    Plain and mutable so the worker can coalesce a request's deltas of one transaction by
    extending the first (`absorb`) and build the wire record once, at commit.
    """

    request_id: str
    model: str
    seq_start: int
    seq_end: int
    text_offset: int
    text: str
    final: bool = False
    # The `Logprobs.content` entries (their JSON) of the tokens whose text this delta completes
    # (`pipeline.logprobs`); None when the input carried no logprobs.
    logprobs: list[LogprobEntry] | None = None
    # Chat outputs (`schemas.events.TextDelta`): None for a request without a chat stage.
    reasoning: str | None = None
    reasoning_offset: int | None = None
    tool_calls: list[dict] | None = None

    def absorb(self, later: Delta) -> None:
        """Extend this delta by the next one of its request (each field by the text it adds,
        placed by this delta's offsets)."""
        self.seq_end = later.seq_end
        self.text += later.text
        self.final = later.final
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(later.logprobs)
            else:
                self.logprobs += later.logprobs
        if later.reasoning is not None:
            if self.reasoning is None:
                self.reasoning, self.reasoning_offset = later.reasoning, later.reasoning_offset
            else:
                self.reasoning += later.reasoning
        if later.tool_calls is not None:
            self.tool_calls = merge_tool_calls(self.tool_calls or [], later.tool_calls)

    def to_wire_json(self) -> bytes:
        """The `TextDelta` record, encoded directly: building and dumping the pydantic model
        took ~7 us a delta against ~1 us here, and the worker writes thousands per commit."""
        record = {
            "type": "delta",
            "request_id": self.request_id,
            "model": self.model,
            "seq_start": self.seq_start,
            "seq_end": self.seq_end,
            "text_offset": self.text_offset,
            "text": self.text,
            "final": self.final,
            "logprobs": None if self.logprobs is None else {"content": self.logprobs},
        }
        if self.reasoning_offset is not None:  # a parsed request's (see `TextDelta`)
            record["reasoning"] = self.reasoning
            record["reasoning_offset"] = self.reasoning_offset
            record["tool_calls"] = self.tool_calls
        return encode_json(record)


def merge_tool_calls(calls: list[dict], later: list[dict]) -> list[dict]:
    """Tool-call pieces (`DeltaToolCall` dicts) followed by later ones of the same request:
    a later piece of the call the first list ends with extends that piece's arguments (its
    `arguments_offset` stays the first piece's); the others follow. New dicts where merged."""
    merged = list(calls)
    for piece in later:
        last = merged[-1] if merged else None
        if last is not None and last["index"] == piece["index"]:
            function = dict(last.get("function") or {})
            function["arguments"] = (function.get("arguments") or "") + (
                (piece.get("function") or {}).get("arguments") or ""
            )
            merged[-1] = {**last, "function": function}
        else:
            merged.append(piece)
    return merged


@dataclass
class BatchResult:
    """Everything one `process` (or `expire`) call produced, in the order to publish it."""

    deltas: list[Delta] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    filtered_ids: list[FilteredIdsRecord] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    # Requests ended before their finish event was consumed (a stop string, a failure, the
    # TTL): the worker writes each to the control topic with its completion, for the engine.
    stop_signals: list[StopSignal] = field(default_factory=list)
    duplicates: int = 0
    events_by_type: dict[str, int] = field(
        default_factory=lambda: {"prompt": 0, "tokens": 0, "finish": 0}
    )
    decoded_tokens: int = 0
    # Events consumed after a stop string ended their request (the server kept generating):
    # they produce nothing, and the worker exports their count.
    events_after_stop: int = 0
    # Request ids whose state changed (or was removed): the worker snapshots exactly these.
    touched: set[str] = field(default_factory=set)

    def merge(self, part: BatchResult) -> None:
        """Add another result to this one, field by field (lists, counts, sets, per-type
        dicts)."""
        for item in dataclasses.fields(self):
            mine, theirs = getattr(self, item.name), getattr(part, item.name)
            if isinstance(mine, list):
                mine.extend(theirs)
            elif isinstance(mine, set):
                mine |= theirs
            elif isinstance(mine, dict):
                for key, count in theirs.items():
                    mine[key] = mine.get(key, 0) + count
            else:
                setattr(self, item.name, mine + theirs)
