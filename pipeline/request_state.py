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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, Literal, cast

import msgspec
from tokenizers import Tokenizer

from pipeline.decode_state import CheckedSnapshot, snapshot_is_consistent
from pipeline.decode_stream import DecodeStream
from pipeline.errors import SnapshotError
from pipeline.results import EventOrigin, Header, Origin
from schemas.events import DeadLetterReason, encode_json
from schemas.fast_events import ParsedFinish, ParsedTokens
from schemas.validation import Rejection, parse_event

# Version 2 of the changelog value: an envelope `{"version": 2, "state": {"kind": ...}}` whose
# active state's text is its `text_segments` segment records (see 'Incremental changelog' below)
# followed by its own `text`. Version 1 (the text whole in `text`, no segments) is still read: it
# is version 2 with no segments. The format before it (a bare state dict, no version) is refused
# like any other unknown version; a version 1 reader refuses version 2 by its number rather than
# restore a text without its segments.
#
# Version 3 is version 2 but for a request with logprobs: each of its segments is a
# `LogprobSegment` (the text and the logprob columns it gained since the previous one) instead
# of bare text, so that the columns, like the text, are written once rather than with every head
# (issue 32 item 6: 8,000 tokens with top-5 wrote 25.5 MB). A version 2 head with logprobs
# (its columns all in the head, its segments bare text) is still read; a version 2 reader
# refuses version 3 by its number rather than read a framed segment as text.
SNAPSHOT_VERSION = 3
READABLE_VERSIONS = (1, 2, SNAPSHOT_VERSION)

Seq = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]


@dataclass(slots=True)
class HeldEvent:
    """An event with its origin: held while it waits for a missing seq, or queued to decode."""

    event: ParsedTokens | ParsedFinish
    origin: Origin
    size: int = 0  # bytes its record takes in a snapshot, once held (`held_size`)


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


def held_size(origin: Origin) -> int:
    """Bytes a held event's record takes in its request's snapshot, as `max_held_bytes` must
    count them: its value, key and headers as stored (escaped, base64). Counting the value
    alone let tiny events with ~900 KB of headers grow a snapshot past the changelog's limit
    (issue 32 item 2). The record's other fields (source, partition, offset, timestamp) are a
    few dozen bytes, bounded by `MAX_HELD_EVENTS`. Held events are rare (a producer that
    reorders), so one encode each is cheap."""
    record = held_record(origin)
    return len(encode_json((record.value, record.key, record.headers)))


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


class ChatFields(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A request's chat-output stage (`pipeline.stages.chat`) in its snapshot: the parsers it
    was opened with, its prompt's reasoning state, and what its ids told of reasoning tokens.
    The parser's own state is not here: it is rebuilt from the text deltas carried, fed to it
    once on restore (so the snapshot stays this small, whatever the text's length)."""

    reasoning: str | None = None  # reasoning parser name
    tools: str | None = None  # tool parser name: set only when the request offers tools
    prompt: Literal["open", "closed"] | None = None  # `pipeline.chat.prompt_reasoning_state`
    reasoning_tokens: Count | None = None  # None: not counted (markers that are not ids)
    counting: bool = False  # the ids are still inside reasoning
    started: bool = False  # the start marker's id was seen
    at_implicit: Count | None = None  # the count at the first implicit-end id


class _ActiveFields(msgspec.Struct, kw_only=True):
    """The plain fields of an active request, shared by the live state and its record."""

    model: str
    prompt_tokens: Count
    next_seq: Seq = 1  # the seq that must come next; later ones are held
    delta_start: Seq = 1  # first seq not yet covered by a published delta
    generated_tokens: Count = 0
    filtered_ids_sent: bool = False
    last_event_at: float = 0.0  # when its latest event was consumed (the consumer's clock), s
    # Decode options (docs/decode-options.md). Stop strings, from the prompt event:
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    # The tail of the text deltas have not carried yet: it may still begin a stop string.
    stop_held: str = ""
    # Logprob columns, one entry per generated id (`pipeline.logprobs`). `logprobs` is None
    # until a tokens event is decoded, then whether the request's events carry logprobs.
    # Each column is the shared empty tuple until the request's first entry (`own_columns`):
    # see 'Memory' in `ActiveRequest`. A snapshot writes and reads them as JSON arrays.
    logprobs: bool | None = None
    lp_ids: list[int] = ()  # type: ignore[assignment]
    lp_values: list[float] = ()  # type: ignore[assignment]
    lp_tops: list[list[tuple[int, float]]] = ()  # type: ignore[assignment]
    lp_offsets: list[Count] = ()  # type: ignore[assignment]  # text characters before each token
    lp_sent: Count = 0  # entries already carried by deltas
    chat: ChatFields | None = None  # a request with chat-output parsing (docs/chat-outputs.md)
    text_segments: Count = 0  # text segment records in the changelog (incremental changelog)


# The held events of a request that holds none: shared and read-only, so that an insertion
# into it fails loudly instead of leaking into every other request (see `ActiveRequest.hold`).
NO_HELD: Mapping[int, HeldEvent] = MappingProxyType({})


class ActiveRequest(_ActiveFields, kw_only=True):
    """A live request: its decode stream, the text so far, and the events it holds.

    The text is kept as parts with running counts: `str +=` on an attribute copies the whole
    text every time (only a local's string can grow in place), which made a long generation
    quadratic. It is joined only for a completion or a snapshot.

    Memory: a worker may hold a million open requests, most of them only a prompt (issue 15:
    at most 1 KB each). So the containers a request may never use (its text parts, held
    events, logprob columns and entries) start as shared empty ones (`()`, `NO_HELD`) and a
    request gets its own on first use: seven empty lists and a dict were 400 of the 1,350
    bytes of such a request, and as many objects for the garbage collector to walk.
    """

    stream: DecodeStream
    text_parts: list[str] | tuple[()] = ()
    text_chars: int = 0  # characters: a delta's `text_offset`
    text_size: int = 0  # bytes the text takes in a JSON record: what `max_text_bytes` bounds
    held: Mapping[int, HeldEvent] = NO_HELD  # a dict of its own once it holds one (`hold`)
    held_bytes: int = 0  # the size of the held events' records, bounded by `max_held_bytes`
    # Logprob entries deltas carried, kept for the completion; not snapshotted (a restored
    # request rebuilds them from its columns).
    lp_built: list[Any] | tuple[()] = ()  # `TokenLogprob`s
    stop_matcher: Any = None  # its `stop_strings.StopScanner`, made on first use
    # Its text stages (`pipeline.stages.Stages.of`), kept once chosen; None: not chosen yet
    # (a new or restored request), chosen again from the fields above. Not snapshotted.
    stages: Any = None
    logged_parts: int = 0  # leading `text_parts` already written as changelog segments
    lp_logged: int = 0  # leading logprob column entries already written as changelog segments

    def hold(self, seq: int, event: HeldEvent) -> dict[int, HeldEvent]:
        """Hold an event that came before `seq - 1`; the request's own held events."""
        held = self.held
        if type(held) is not dict:
            held = self.held = {}
        held[seq] = event
        event.size = held_size(event.origin)
        self.held_bytes += event.size
        return held

    def release_held(self) -> None:
        """Let go of every held event (they were dead-lettered or consumed)."""
        self.held = NO_HELD
        self.held_bytes = 0

    def own_columns(self) -> None:
        """Give the request its own logprob columns, before their first entry."""
        if type(self.lp_offsets) is tuple:
            self.lp_ids, self.lp_values, self.lp_tops, self.lp_offsets = [], [], [], []

    def add_text(self, text: str, size: int | None = None) -> None:
        """Append `text`; `size` is its `json_size` when the caller has it already."""
        if not text:
            return
        parts = self.text_parts
        if parts:
            parts.append(text)  # type: ignore[union-attr]  # a non-empty one is a list
        else:
            self.text_parts = [text]
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
        """The whole text. The join is kept (as at most two parts: the text already in the
        changelog's segments and the text not yet), so parts never pile up."""
        parts = self.text_parts
        if len(parts) > 1:
            logged = self.logged_parts
            parts[:] = [p for p in ("".join(parts[:logged]), "".join(parts[logged:])) if p]
            self.logged_parts = 1 if logged else 0
        return parts[0] if len(parts) == 1 else "".join(parts)


class ActiveRecord(_ActiveFields, kw_only=True, tag_field="kind", tag="active"):
    """An active request in a snapshot: its plain fields and the snapshots of the rest."""

    stream: Any  # `DecodeStream.snapshot()`: the decode module's own format, opaque here
    text: str = ""  # the text after its `text_segments` segments
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
# The decode-option fields, from `stop` on: a request without options leaves them out of its
# snapshot (their defaults restore it), so the option costs its changelog nothing.
_PLAIN_FIELDS = _ACTIVE_FIELDS[: _ACTIVE_FIELDS.index("stop")]
_plain_values = operator.attrgetter(*_PLAIN_FIELDS)


def _active_fields(state: _ActiveFields) -> dict[str, Any]:
    """The shared plain fields of a live state or a record, by name."""
    return dict(zip(_ACTIVE_FIELDS, _active_values(state), strict=True))


def _snapshot_fields(state: _ActiveFields) -> dict[str, Any]:
    """`_active_fields`, without the decode-option fields of a request that has no options."""
    if state.stop is None and not state.logprobs and state.chat is None:
        return dict(zip(_PLAIN_FIELDS, _plain_values(state), strict=True))
    return _active_fields(state)


class _Snapshot(msgspec.Struct, kw_only=True):
    version: int
    state: ActiveRecord | FailedRequest | FinishedRequest


class _Version(msgspec.Struct):
    version: int


_SNAPSHOT_DECODER = msgspec.json.Decoder(_Snapshot)
_VERSION_DECODER = msgspec.json.Decoder(_Version)


def encode_snapshot(state: RequestState) -> bytes:
    """A self-contained value of one request's state: an active request's whole text inline,
    no segments (the worker writes `encode_head` and segments instead; this is the form tests
    and tools compare).

    An active request is written as the mapping an `ActiveRecord` decodes from, not built as
    one: constructing the Struct only to encode it doubled the cost of a snapshot, and the
    worker writes one for every request each commit touched.
    """
    if type(state) is ActiveRequest:
        return _encode_active(state, segments=0, text=state.text())
    return encode_json({"version": SNAPSHOT_VERSION, "state": state})


def _encode_active(
    state: ActiveRequest,
    *,
    segments: int,
    text: str,
    omit_defaults: bool = False,
    lp_from: int = 0,
) -> bytes:
    """The value of an active request whose `segments` segments hold what comes before `text`
    and before the logprob entries from `lp_from` on."""
    record = {
        "kind": "active",
        **_snapshot_fields(state),
        "text_segments": segments,
        "stream": state.stream.snapshot(),
        "text": text,
        "held": [held_record(state.held[seq].origin) for seq in sorted(state.held)],
    }
    if lp_from:
        for name in _COLUMNS:
            record[name] = record[name][lp_from:] or ()
    if omit_defaults:
        record = {k: v for k, v in record.items() if not _is_default(k, v)}
    return encode_json({"version": SNAPSHOT_VERSION, "state": record})


_COLUMNS = ("lp_ids", "lp_values", "lp_tops", "lp_offsets")


class LogprobSegment(msgspec.Struct, array_like=True):
    """A version 3 segment: the text and the logprob column entries a request gained since its
    previous segment (`pipeline.logprobs` for the columns)."""

    text: str
    ids: list[int]
    values: list[float]
    tops: list[list[tuple[int, float]]]
    offsets: list[Count]


_LOGPROB_SEGMENT_DECODER = msgspec.json.Decoder(LogprobSegment)


_RECORD_DEFAULTS = {
    field.name: field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    for field in msgspec.structs.fields(ActiveRecord)
    if field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT
}


def _is_default(name: str, value: Any) -> bool:
    """Whether a field's value is the one `ActiveRecord` decodes when the field is absent."""
    default = _RECORD_DEFAULTS.get(name, _NO_DEFAULT)
    return type(value) is type(default) and value == default


_NO_DEFAULT = object()


# -- incremental changelog ----------------------------------------------------------------------
#
# A request's changelog is its head record (key: the request id; the state without its text)
# and its text segments (key: the request id, byte 0xFF, the segment number in decimal; value:
# the UTF-8 text appended since the previous segment). Each commit that touched an active request
# writes one segment with the text it gained, if any, and the head, which counts the segments.
# So the changelog bytes of a request are its text once plus a small head per commit, not its
# whole text per commit (quadratic in a long generation's length). When the request ends, the
# head becomes its marker and every segment key gets a tombstone, so compaction bounds the topic
# as before. 0xFF never occurs in UTF-8, so no request id's head key is another's segment key.

SEGMENT_SEPARATOR = b"\xff"


def segment_key(request_id: str, number: int) -> bytes:
    return request_id.encode() + SEGMENT_SEPARATOR + str(number).encode()


def split_changelog_key(key: bytes) -> tuple[bytes, int | None]:
    """(head key, segment number) of a segment key; (key, None) for a head key. ValueError for a
    segment key whose number is not a decimal."""
    head, separator, number = key.partition(SEGMENT_SEPARATOR)
    if not separator:
        return key, None
    if not number.isdigit():
        raise ValueError(f"changelog key {key[:200]!r} has no segment number")
    return head, int(number)


def encode_head(state: ActiveRequest) -> tuple[tuple[int, bytes] | None, bytes]:
    """The changelog records of an active request at a commit: its new text segment (number,
    UTF-8 text), if it gained text since the last one, and its head.

    The text goes into the segment as it is taken, so a later commit writes only newer text;
    if the commit aborts, the state is restored from the changelog, segment count included.
    """
    parts = state.text_parts
    logged = state.logged_parts
    fresh = None
    if logged < len(parts):
        fresh = parts[logged] if len(parts) - logged == 1 else "".join(parts[logged:])
        parts[logged:] = [fresh]
        state.logged_parts = len(parts)
    value = None
    if state.logprobs:
        first = state.lp_logged
        if fresh is not None or first < len(state.lp_offsets):
            value = encode_json(
                LogprobSegment(
                    fresh or "",
                    state.lp_ids[first:],
                    state.lp_values[first:],
                    state.lp_tops[first:],
                    state.lp_offsets[first:],
                )
            )
            state.lp_logged = len(state.lp_offsets)
    elif fresh is not None:
        value = fresh.encode()
    segment = None
    if value is not None:
        segment = (state.text_segments, value)
        state.text_segments += 1
    # Fields at their defaults are left out: the head is written at every commit (and a
    # million open requests are a million heads to restore), and most of them are.
    head = _encode_active(
        state,
        segments=state.text_segments,
        text="",
        omit_defaults=True,
        lp_from=state.lp_logged,
    )
    return segment, head


def decode_snapshot(
    request_id: str,
    data: bytes,
    tokenizer_of: Callable[[str], Tokenizer],
    segments: Mapping[int, bytes] | None = None,
) -> RequestState:
    """The state a changelog value holds; `SnapshotError` for anything it cannot restore.

    `tokenizer_of(model)` gives an active request's tokenizer (raising for a model that is no
    longer configured). `segments` (number -> value) are the request's text segments; an
    active head naming one that is missing (or that is not UTF-8) cannot be restored.
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
    if snapshot.version == 1:
        record.text_segments = 0  # version 1 had no segments: its text is all inline
    framed = snapshot.version >= 3 and bool(record.logprobs)
    return _active_request(request_id, record, tokenizer_of, segments or {}, framed=framed)


def _active_request(
    request_id: str,
    record: ActiveRecord,
    tokenizer_of: Callable[[str], Tokenizer],
    segments: Mapping[int, bytes],
    logged: str | None = None,
    *,
    framed: bool = False,
) -> ActiveRequest:
    """The live request of a decoded head: `logged` is the text of its segments when already
    joined (a `RestoredRequest`'s), else it is read from `segments` (`LogprobSegment`s when
    `framed`: their columns come before the head's own)."""
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
    fields = _active_fields(record)
    lp_logged = 0
    if framed:
        logged, columns = _logprob_segments(request_id, record, segments)
        lp_logged = len(columns[-1])
        if lp_logged:
            fields.update(zip(_COLUMNS, columns, strict=True))
    elif logged is None:
        logged = _segments_text(request_id, record.text_segments, segments)
    text = logged + record.text
    return ActiveRequest(
        **fields,
        lp_logged=lp_logged,
        stream=stream,
        text_parts=[p for p in (logged, record.text) if p] or (),
        logged_parts=1 if logged else 0,
        text_chars=len(text),
        text_size=json_size(text),
        held={held.event.seq: held for held in held} if held else NO_HELD,
        held_bytes=sum(h.size for h in held),
    )


# -- lazy restore -------------------------------------------------------------------------------
#
# A worker assigned a million open requests restores a million heads before it handles a record.
# Rebuilding each (the head decoded, its stream snapshot re-validated field by field, a decode
# stream, an `ActiveRequest` and its lists) was ~130 us of a worker's restore per request on a
# loaded host, and left ~2 KB of objects each; most of those requests may never get another
# event before they expire. So a restore keeps an active request as its head record, checked
# by one typed decode, and rebuilds it when something needs more than its `last_event_at` (its
# next event, the TTL sweep ending it, a snapshot): the decode work is paid only by requests
# that continue, and then exactly as an eager restore would have paid it.


class RestoredRequest(msgspec.Struct, frozen=True, gc=False):
    """An active request as restored, not rebuilt yet: its changelog head (which passed every
    check `decode_snapshot` makes, so rebuilding it cannot fail) and the text of its segments.

    Smaller than the live state it stands for (a ~330-byte head against over a kilobyte of
    objects for a prompt-only request), and untracked by the garbage collector (`gc=False`: it holds
    only a bytes, a str and a float, so it can be part of no reference cycle).
    """

    head: bytes
    logged: str
    last_event_at: float


class _CheckedActive(_ActiveFields, kw_only=True, tag_field="kind", tag="active"):
    """`ActiveRecord` with its stream typed too: one decode checks the whole head."""

    stream: CheckedSnapshot
    text: str = ""
    held: list[HeldRecord] = []


class _CheckedSnapshotEnvelope(msgspec.Struct, kw_only=True):
    version: int
    state: _CheckedActive | FailedRequest | FinishedRequest


_CHECKED_DECODER = msgspec.json.Decoder(_CheckedSnapshotEnvelope)


def restore_state(
    request_id: str,
    data: bytes,
    tokenizer_of: Callable[[str], Tokenizer],
    segments: Mapping[int, bytes] | None = None,
) -> RequestState | RestoredRequest:
    """What a restore keeps of a changelog value: a `RestoredRequest` for an active request
    that `decode_snapshot` would restore, else exactly `decode_snapshot`'s outcome (a marker,
    the state of a head this check leaves to it, or its `SnapshotError`).

    Only the common head takes the lazy form: the current version, no held events, a stream
    snapshot that `CheckedSnapshot` takes. Anything else (an older version, a held event to
    parse, any fault) goes the eager way, so errors and their messages stay those of
    `decode_snapshot`.
    """
    try:
        snapshot = _CHECKED_DECODER.decode(data)
    except (msgspec.DecodeError, TypeError):
        return decode_snapshot(request_id, data, tokenizer_of, segments)
    record = snapshot.state
    if type(record) is not _CheckedActive and snapshot.version in READABLE_VERSIONS:
        return record  # a marker, as `decode_snapshot` returns it
    if (
        snapshot.version not in (2, SNAPSHOT_VERSION)
        or type(record) is not _CheckedActive
        or record.held
        or record.logprobs  # its segments carry columns: `decode_snapshot` joins them
        or not snapshot_is_consistent(record.stream)
    ):
        return decode_snapshot(request_id, data, tokenizer_of, segments)
    try:
        tokenizer_of(record.model)
        logged = _segments_text(request_id, record.text_segments, segments or {})
    except (LookupError, SnapshotError):
        return decode_snapshot(request_id, data, tokenizer_of, segments)
    # A copy of the head, not the consumed record's own bytes: those were allocated among the
    # record objects a restore drops once applied, and each one kept would pin a block of that
    # memory (RSS stayed at the restore's peak, ~1,020 B a request for 100k, against ~800).
    return RestoredRequest(bytes(memoryview(data)), logged, record.last_event_at)


def rebuild(
    request_id: str, restored: RestoredRequest, tokenizer_of: Callable[[str], Tokenizer]
) -> ActiveRequest:
    """The live state of a `RestoredRequest`: what `decode_snapshot` gives for its head."""
    record = cast(ActiveRecord, _SNAPSHOT_DECODER.decode(restored.head).state)
    return _active_request(request_id, record, tokenizer_of, {}, restored.logged)


def _segments_text(request_id: str, count: int, segments: Mapping[int, bytes]) -> str:
    if not count:
        return ""
    try:
        return "".join(segments[number].decode() for number in range(count))
    except KeyError as missing:
        raise SnapshotError(
            f"request {request_id!r}: text segment {missing} of {count} is missing"
        ) from None
    except UnicodeDecodeError as error:
        message = f"request {request_id!r}: a text segment is not UTF-8: {error}"
        raise SnapshotError(message) from None


class _HeadFields(msgspec.Struct):
    """What a failed restore can still read of an active head (`active_head_fields`)."""

    kind: str
    model: str = ""
    prompt_tokens: Count = 0
    generated_tokens: Count = 0


class _HeadEnvelope(msgspec.Struct):
    state: _HeadFields


_HEAD_FIELDS_DECODER = msgspec.json.Decoder(_HeadEnvelope)


def active_head_fields(value: bytes | None) -> _HeadFields | None:
    """The model and counts of a changelog value that is an active request's head, read
    leniently (the value failed to restore); None for anything else, a marker included."""
    if value is None:
        return None
    try:
        fields = _HEAD_FIELDS_DECODER.decode(value).state
    except (msgspec.DecodeError, TypeError):
        return None
    return fields if fields.kind == "active" and fields.model else None


def _logprob_segments(
    request_id: str, record: ActiveRecord, segments: Mapping[int, bytes]
) -> tuple[str, tuple[list, list, list, list]]:
    """The text and the logprob columns of a version 3 head's segments, then its own columns."""
    texts: list[str] = []
    columns: tuple[list, list, list, list] = ([], [], [], [])
    for number in range(record.text_segments):
        value = segments.get(number)
        if value is None:
            raise SnapshotError(
                f"request {request_id!r}: text segment {number} of {record.text_segments} "
                f"is missing"
            )
        try:
            segment = _LOGPROB_SEGMENT_DECODER.decode(value)
        except msgspec.DecodeError as error:
            raise SnapshotError(
                f"request {request_id!r}: logprob segment {number}: {error}"
            ) from None
        texts.append(segment.text)
        parts = (segment.ids, segment.values, segment.tops, segment.offsets)
        if len({len(part) for part in parts}) != 1:
            raise SnapshotError(f"request {request_id!r}: logprob segment {number}: ragged")
        for column, part in zip(columns, parts, strict=True):
            column += part
    for column, name in zip(columns, _COLUMNS, strict=True):
        column += getattr(record, name)
    return "".join(texts), columns


def _version_of(data: bytes) -> int | None:
    try:
        return _VERSION_DECODER.decode(data).version
    except (msgspec.DecodeError, TypeError):
        return None


def _check_version(request_id: str, version: int | None) -> None:
    if version is not None and version not in READABLE_VERSIONS:
        raise SnapshotError(
            f"request {request_id!r}: snapshot version {version} (this worker reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))})"
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
        events.append(HeldEvent(event, origin, held_size(origin)))
    return events
