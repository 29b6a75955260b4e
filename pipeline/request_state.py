"""A request's state between events, and its changelog snapshot, as typed records.

An active request is its decode stream, its text so far, where its sequence stands and the
out-of-order events it holds; an ended one leaves a small marker (finished or failed) so that its
late events are classified rather than taken for new requests. The Kafka worker writes a snapshot
of every request a transaction touched to a compacted changelog and rebuilds the states from it
after a crash or a rebalance.

The snapshot is derived from the records, not written field by field: the states are msgspec
Structs, the markers are their own snapshot, and an active request's plain fields live in one
base Struct shared by the live state and its record, so a field added there is snapshotted and
restored with no other change. A typed decode validates every field on the way back, and the
envelope carries a version so that a changelog written by another format is refused by name
(`SnapshotError`) rather than misread.
"""

from __future__ import annotations

import base64
import binascii
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from tokenizers import Tokenizer

from pipeline.decode_stream import DecodeStream
from pipeline.errors import SnapshotError
from pipeline.results import EventOrigin, Header, Origin
from schemas.events import DeadLetterReason, encode_json
from schemas.fast_events import ParsedFinish, ParsedTokens
from schemas.validation import Rejection, parse_event

# Version 1 of the changelog value: an envelope `{"version": 1, "state": {"kind": ...}}`. The
# format before it (a bare state dict, no version) is refused like any other unknown version.
SNAPSHOT_VERSION = 1

Seq = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]


@dataclass(slots=True)
class HeldEvent:
    """An event with its origin: held while it waits for a missing seq, or queued to decode."""

    event: ParsedTokens | ParsedFinish
    origin: Origin


class HeldRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A held event in a snapshot: its Kafka record, stored once.

    Only the record is kept, the event is parsed from it again on restore: storing the parsed
    event next to the base64 of its record made a 450 KB tokens event a 1 MB snapshot, which the
    broker refused. The value is stored as text (a record that parsed as an event is UTF-8
    JSON, so it costs a few escapes, not base64's third); any other value falls back to base64.
    """

    source: str
    partition: int
    offset: int
    value: str
    value_is_base64: bool = False
    key: bytes | None = None
    headers: list[Header] = []
    timestamp_ms: int | None = None


def held_record(origin: Origin) -> HeldRecord:
    raw = origin.value
    try:
        value, is_base64 = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        value, is_base64 = base64.b64encode(raw).decode(), True
    return HeldRecord(
        source=origin.source,
        partition=origin.partition,
        offset=origin.offset,
        value=value,
        value_is_base64=is_base64,
        key=origin.key,
        headers=list(origin.headers),
        timestamp_ms=origin.timestamp_ms,
    )


def held_origin(record: HeldRecord) -> EventOrigin:
    value = (
        base64.b64decode(record.value, validate=True)
        if record.value_is_base64
        else record.value.encode("utf-8")
    )
    return EventOrigin(
        source=record.source,
        partition=record.partition,
        offset=record.offset,
        value=value,
        key=record.key,
        headers=tuple(record.headers),
        timestamp_ms=record.timestamp_ms,
    )


def json_size(text: str) -> int:
    """Bytes `text` takes inside a JSON record (UTF-8, quotes and control characters escaped,
    as `encode_json` writes completions and snapshots)."""
    return len(encode_json(text)) - 2


def json_prefix(text: str, size: int) -> str:
    """The longest prefix of `text` whose `json_size` is at most `size` (whole characters)."""
    if json_size(text) <= size:
        return text
    used = 0
    for index, char in enumerate(text):
        used += json_size(char)
        if used > size:
            return text[:index]
    return text


class _ActiveFields(msgspec.Struct, kw_only=True):
    """The plain fields of an active request, shared by the live state and its record."""

    model: str
    prompt_tokens: Count
    next_seq: Seq = 1  # the seq that must come next; later ones are held
    delta_start: Seq = 1  # first seq not yet covered by a published delta
    generated_tokens: Count = 0
    filtered_ids_sent: bool = False
    last_event_at: float = 0.0  # event time of its latest event, in seconds
    # Decode options (docs/decode-options.md). Stop strings, from the prompt event:
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    # The tail of the text deltas have not carried yet: it may still begin a stop string.
    stop_held: str = ""
    # Logprob columns, one entry per generated id (`pipeline.logprobs`). `logprobs` is None
    # until a tokens event is decoded, then whether the request's events carry logprobs.
    logprobs: bool | None = None
    lp_ids: list[int] = []
    lp_values: list[float] = []
    lp_tops: list[list[tuple[int, float]]] = []
    lp_offsets: list[Count] = []  # characters of text before each token's text
    lp_sent: Count = 0  # entries already carried by deltas


class ActiveRequest(_ActiveFields, kw_only=True):
    """A live request: its decode stream, the text so far, and the events it holds.

    The text is kept as parts with running counts: `str +=` on an attribute copies the whole
    text every time (only a local's string can grow in place), which made a long generation
    quadratic. It is joined only for a completion or a snapshot.
    """

    stream: DecodeStream
    text_parts: list[str] = []
    text_chars: int = 0  # characters: a delta's `text_offset`
    text_size: int = 0  # bytes the text takes in a JSON record: what `max_text_bytes` bounds
    held: dict[int, HeldEvent] = {}
    held_bytes: int = 0  # the size of the held events' records, bounded by `max_held_bytes`
    # Logprob entries deltas carried, kept for the completion; not snapshotted (a restored
    # request rebuilds them from its columns).
    lp_built: list[dict[str, Any]] = []

    def add_text(self, text: str, size: int | None = None) -> None:
        """Append `text`; `size` is its `json_size` when the caller has it already."""
        if not text:
            return
        self.text_parts.append(text)
        self.text_chars += len(text)
        self.text_size += json_size(text) if size is None else size

    def text_tail(self, chars: int) -> str:
        """The last `chars` characters of the text, without joining the whole of it."""
        if chars <= 0:
            return ""
        parts = self.text_parts
        taken = 0
        index = len(parts)
        while index > 0 and taken < chars:
            index -= 1
            taken += len(parts[index])
        tail = "".join(parts[index:])
        return tail[len(tail) - chars :] if taken > chars else tail

    def text(self) -> str:
        """The whole text. The join is kept as the one part, so parts never pile up between
        snapshots; a snapshot still copies the whole text, which `max_text_bytes` bounds."""
        parts = self.text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""


class ActiveRecord(_ActiveFields, kw_only=True, tag_field="kind", tag="active"):
    """An active request in a snapshot: its plain fields and the snapshots of the rest."""

    stream: Any  # `DecodeStream.snapshot()`: the decode module's own format, opaque here
    text: str = ""
    held: list[HeldRecord] = []


class FailedRequest(msgspec.Struct, kw_only=True, tag_field="kind", tag="failed"):
    """A request that can no longer produce text; its later events are dead-lettered too.

    `at_open` marks a request that failed on its prompt (an unknown model, an out-of-range
    prompt id, an error while opening it): it produced nothing, so the same prompt sent again
    (a redrive once the model is added) opens it afresh instead of counting as a duplicate.
    """

    model: str | None
    reason: DeadLetterReason
    last_event_at: float = 0.0
    at_open: bool = False


class FinishedRequest(msgspec.Struct, kw_only=True, tag_field="kind", tag="finished"):
    """A marker kept after finish so that late duplicates are counted, not dead-lettered."""

    last_seq: Seq
    last_event_at: float = 0.0
    # Ended by a stop string before its finish: later events are counted, not dead-lettered,
    # until the finish comes (docs/decode-options.md).
    stopped: bool = False


RequestState = ActiveRequest | FailedRequest | FinishedRequest

_ACTIVE_FIELDS = _ActiveFields.__struct_fields__
_active_values = operator.attrgetter(*_ACTIVE_FIELDS)


def _active_fields(state: _ActiveFields) -> dict[str, Any]:
    """The shared plain fields of a live state or a record, by name."""
    return dict(zip(_ACTIVE_FIELDS, _active_values(state), strict=True))


class _Snapshot(msgspec.Struct, kw_only=True):
    version: int
    state: ActiveRecord | FailedRequest | FinishedRequest


class _Version(msgspec.Struct):
    version: int


_SNAPSHOT_DECODER = msgspec.json.Decoder(_Snapshot)
_VERSION_DECODER = msgspec.json.Decoder(_Version)


def encode_snapshot(state: RequestState) -> bytes:
    """The changelog value of one request's state.

    An active request is written as the mapping an `ActiveRecord` decodes from, not built as
    one: constructing the Struct only to encode it doubled the cost of a snapshot, and the
    worker writes one for every request each commit touched.
    """
    if type(state) is ActiveRequest:
        record: dict[str, Any] | FailedRequest | FinishedRequest = {
            "kind": "active",
            **_active_fields(state),
            "stream": state.stream.snapshot(),
            "text": state.text(),
            "held": [held_record(state.held[seq].origin) for seq in sorted(state.held)],
        }
    else:
        record = state
    return encode_json({"version": SNAPSHOT_VERSION, "state": record})


def decode_snapshot(
    request_id: str, data: bytes, tokenizer_of: Callable[[str], Tokenizer]
) -> RequestState:
    """The state a changelog value holds; `SnapshotError` for anything it cannot restore.

    `tokenizer_of(model)` gives an active request's tokenizer (raising for a model that is no
    longer configured).
    """
    try:
        snapshot = _SNAPSHOT_DECODER.decode(data)
    except (msgspec.DecodeError, TypeError) as error:
        # Another version may not fit this one's types: say so rather than name a field.
        _check_version(request_id, _version_of(data))
        raise SnapshotError(f"request {request_id!r}: invalid snapshot: {error}") from None
    _check_version(request_id, snapshot.version)
    record = snapshot.state
    if not isinstance(record, ActiveRecord):
        return record
    try:
        tokenizer = tokenizer_of(record.model)
    except LookupError as error:
        raise SnapshotError(f"request {request_id!r}: {error}") from None
    try:
        stream = DecodeStream.from_snapshot(tokenizer, record.stream)
    except Exception as error:  # any failure of the stream's own format is a bad snapshot
        raise SnapshotError(
            f"request {request_id!r}: cannot restore its decode stream: "
            f"{type(error).__name__}: {error}"
        ) from error
    held = _held_events(request_id, record)
    return ActiveRequest(
        **_active_fields(record),
        stream=stream,
        text_parts=[record.text] if record.text else [],
        text_chars=len(record.text),
        text_size=json_size(record.text),
        held={held.event.seq: held for held in held},
        held_bytes=sum(len(h.origin.value) for h in held),
    )


def _version_of(data: bytes) -> int | None:
    try:
        return _VERSION_DECODER.decode(data).version
    except (msgspec.DecodeError, TypeError):
        return None


def _check_version(request_id: str, version: int | None) -> None:
    if version is not None and version != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"request {request_id!r}: snapshot version {version} (this worker reads "
            f"version {SNAPSHOT_VERSION})"
        )


def _held_events(request_id: str, record: ActiveRecord) -> list[HeldEvent]:
    events = []
    for item in record.held:
        try:
            origin = held_origin(item)
        except binascii.Error as error:
            raise SnapshotError(f"request {request_id!r}: held record: {error}") from None
        event = parse_event(origin.value)
        if isinstance(event, Rejection):
            raise SnapshotError(
                f"request {request_id!r}: held record at offset {item.offset} does not parse: "
                f"{event.message}"
            )
        if (
            not isinstance(event, ParsedTokens | ParsedFinish)
            or event.request_id != request_id
            or event.seq <= record.next_seq
        ):
            raise SnapshotError(
                f"request {request_id!r}: held record at offset {item.offset} is not a later "
                f"event of this request"
            )
        events.append(HeldEvent(event, origin))
    return events
