"""The state every decode strategy shares, its snapshot format, and the stream's errors.

One state for all strategies (`pipeline.decode_reference`, `pipeline.decode_byte_level`,
`pipeline.decode_spm`), so the changelog has one format whichever decoder a model has. The rules
the fields follow are in docs/decode-semantics.md.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Generator, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

U32 = 1 << 32
SNAPSHOT_VERSION = 2

# Seeding reads only the last PROMPT_CONTEXT_IDS ids of a prompt (docs/decode-semantics.md,
# 'Seeding'). The 4..6-id suffix sweep reads at most 6; the bound is for the full-prompt fallback
# (no clean suffix: a prompt ending inside a character, suffixes that are all U+FFFD or mostly
# out-of-vocabulary ids), which upstream decodes whole. Decoding a 500k-id prompt for one
# request's left context costs as much as decoding its answer, and a fallback-seeded window held
# the whole prompt in state and snapshots; 64 ids is ten times what a character straddling the
# generation needs and more than the 32 heads the mid-character search probes, so the byte
# strategies seed exactly as on the whole prompt. It also makes prompt tails exact: a producer
# that sends only the last 64 ids (with `prompt_tokens`) gets the same output.
PROMPT_CONTEXT_IDS = 64

UnknownPolicy = Literal["error", "skip"]
# What a push generator yields: sequences to decode; it is sent their texts, in the same order.
DecodeRequest = list[list[int]]
PushSteps = Generator[DecodeRequest, list[str], str]


class InvalidTokenIdError(ValueError):
    """A token id that is not an integer in [0, 2**32): malformed input, rejected up front."""


class StrictDecodeError(Exception):
    """A generated id the tokenizer cannot map (docs/decode-semantics.md, 'Unknown ids').

    `partial_text` is the text produced by the ids before it in the same chunk; the stream state
    reflects those ids as pushed, exactly as if they had been pushed one by one before the error.
    """

    def __init__(self, token_id: int, partial_text: str) -> None:
        super().__init__(f"cannot decode unknown token id {token_id}")
        self.token_id = token_id
        self.partial_text = partial_text


class SnapshotFormatError(ValueError):
    """A snapshot that is not one this module wrote: wrong version, missing or mistyped field, or
    fields that contradict each other. Raised by `read_snapshot` (so by
    `DecodeStream.from_snapshot`) before any state is built, so a caller can turn it into its own
    restore failure."""


def utf8_len(text: str) -> int:
    """Length in UTF-8 bytes: the unit lengths are compared in (docs/decode-semantics.md)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def slice_from_byte(text: str, n: int) -> str:
    """`text[n..]` in UTF-8 bytes, with n floored to a char boundary (Rust `floor_char_boundary`).

    Flooring instead of failing is what upstream does for non-monotonic decodes (vllm #17448).
    """
    if text.isascii():
        return text[n:]
    raw = text.encode("utf-8")
    if n >= len(raw):
        return ""
    while n > 0 and (raw[n] & 0xC0) == 0x80:
        n -= 1
    return raw[n:].decode("utf-8")


def validated_ids(token_ids: Sequence[Any]) -> list[int]:
    """The ids as a list of ints, or InvalidTokenIdError naming the first bad one.

    `tokenizers` would raise OverflowError/TypeError on these, deep inside a decode; here the
    whole sequence is checked first, so a malformed chunk changes no state.
    """
    ids = list(token_ids)
    try:
        # C-speed check: array('I') takes exactly the ints in [0, 2**32) (and rejects the rest
        # with OverflowError/TypeError), so prompts of thousands of ids cost no Python loop. The
        # ids themselves are kept (`tolist` would allocate a new int object per id); `snapshot`
        # normalizes int-likes such as numpy integers to plain ints.
        array("I", ids)
        return ids
    except (OverflowError, TypeError, ValueError):
        pass
    out: list[int] = []
    for position, raw in enumerate(ids):
        try:
            value = operator.index(raw)
        except TypeError:
            raise InvalidTokenIdError(
                f"token id at position {position} is not an integer: {raw!r}"
            ) from None
        if not 0 <= value < U32:
            raise InvalidTokenIdError(
                f"token id at position {position} is outside [0, 2**32): {value}"
            )
        out.append(value)
    return out


class DecodeState:
    """Everything one request's decode remembers (see docs/decode-semantics.md, 'State').

    The base of every stream class: the fields are slots of the stream itself, so the fast paths
    read them with no indirection. The tokenizer and `skip_special_tokens` are class attributes
    of the stream class specialized for that tokenizer and flag (`pipeline.decode_stream`).

    - `ids`: the window: left context (`ids[:prefix_index]`) plus ids not emitted yet. Seeding
      runs at construction, so it never holds the whole prompt past that.
    - `prefix`: decode of `ids[:prefix_index]`, text already accounted for.
    - `started`: a token has been pushed (upstream's `prefix_seeded`): before that, `flush`
      emits nothing, so the prompt never leaks.
    - `held`: text that is final but not emitted yet, because per-token pushing would still be
      waiting (the text ends in U+FFFD), as a list of parts (appending stays linear; `hold`).
      The window was cut behind it so an invalid byte run costs constant work per id; when
      `held` is not empty, `prefix` is "" and `prefix_index` 0.
    - `filtered_ids`: prompt ids the tokenizer cannot map, dropped while seeding.

    Both are the shared empty tuple while empty, as they almost always are: a worker holds a
    stream per open request, up to a million of them, and two empty lists were 112 bytes of
    each (pipeline.request_state.ActiveRequest, 'Memory').
    """

    __slots__ = (
        "unknown_generated_ids",
        "ids",
        "prefix",
        "prefix_index",
        "started",
        "held",
        "filtered_ids",
    )

    skip_special_tokens: bool

    def _init_state(self, ids: list[int], unknown_generated_ids: UnknownPolicy) -> None:
        if unknown_generated_ids not in ("error", "skip"):
            raise ValueError(
                f"unknown_generated_ids must be 'error' or 'skip', not {unknown_generated_ids!r}"
            )
        self.unknown_generated_ids: UnknownPolicy = unknown_generated_ids
        self.ids = ids
        self.prefix = ""
        self.prefix_index = 0
        self.started = False
        self.held: list[str] | tuple[()] = ()
        self.filtered_ids: list[int] | tuple[()] = ()

    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-able plain values (for a changelog); see `read_snapshot`."""
        return {
            "version": SNAPSHOT_VERSION,
            "skip_special_tokens": self.skip_special_tokens,
            "unknown_generated_ids": self.unknown_generated_ids,
            "ids": array("I", self.ids).tolist(),
            "prefix": self.prefix,
            "prefix_index": self.prefix_index,
            "started": self.started,
            "held": "".join(self.held),
            "filtered_prompt_ids": array("I", self.filtered_ids).tolist(),
        }

    def clone(self) -> DecodeState:
        """An independent copy: a stop-string request keeps one from before each chunk, to
        replay that chunk id by id only when a stop completes in it (`pipeline.processor`)."""
        other = object.__new__(type(self))
        other.unknown_generated_ids = self.unknown_generated_ids
        other.ids = list(self.ids)
        other.prefix = self.prefix
        other.prefix_index = self.prefix_index
        other.started = self.started
        other.held = list(self.held) or ()
        other.filtered_ids = self.filtered_ids  # set once, while seeding; never mutated after
        return other

    def _restore_state(self, data: Snapshot) -> None:
        self._init_state(data.ids, data.unknown_generated_ids)
        self.prefix = data.prefix
        self.prefix_index = data.prefix_index
        self.started = data.started
        self.held = [data.held] if data.held else ()
        self.filtered_ids = data.filtered_prompt_ids or ()

    def hold(self, text: str) -> None:
        """Append a part to `held`."""
        if self.held:
            self.held.append(text)  # type: ignore[union-attr]  # a non-empty one is a list
        else:
            self.held = [text]


class Snapshot(NamedTuple):
    """A checked snapshot. `needs_seeding`: a version 1 stream that never seeded (`ids` is its
    prompt), restored by seeding it again."""

    skip_special_tokens: bool
    unknown_generated_ids: UnknownPolicy
    ids: list[int]
    prefix: str
    prefix_index: int
    started: bool
    held: str
    filtered_prompt_ids: list[int]
    needs_seeding: bool


def read_snapshot(data: Any) -> Snapshot:
    """The fields of a `snapshot()`, or SnapshotFormatError for anything else.

    Version 1 (before seeding moved to construction) is read too: its `prefix_seeded` is
    `started`, and it held no text.
    """
    if not isinstance(data, dict):
        raise SnapshotFormatError(f"a decode snapshot is an object, not {type(data).__name__}")
    version = data.get("version")
    if type(version) is not int or version not in (1, SNAPSHOT_VERSION):
        raise SnapshotFormatError(f"unsupported decode snapshot version: {version!r}")
    skip = _field(data, "skip_special_tokens", bool)
    policy = _field(data, "unknown_generated_ids", str)
    if policy not in ("error", "skip"):
        raise SnapshotFormatError(f"unknown_generated_ids is not 'error' or 'skip': {policy!r}")
    try:
        ids = validated_ids(_field(data, "ids", list))
        filtered = validated_ids(_field(data, "filtered_prompt_ids", list))
    except InvalidTokenIdError as error:
        raise SnapshotFormatError(f"snapshot ids: {error}") from None
    prefix = _field(data, "prefix", str)
    prefix_index = _field(data, "prefix_index", int)
    if version == 1:
        started, held = _field(data, "prefix_seeded", bool), ""
    else:
        started, held = _field(data, "started", bool), _field(data, "held", str)
    if not 0 <= prefix_index <= len(ids):
        raise SnapshotFormatError("snapshot prefix_index is outside its window")
    if held and (prefix or prefix_index):
        raise SnapshotFormatError("snapshot holds text beside a prefix")
    return Snapshot(
        skip_special_tokens=skip,
        unknown_generated_ids=policy,  # type: ignore[arg-type]  # checked above
        ids=ids,
        prefix=prefix,
        prefix_index=prefix_index,
        started=started,
        held=held,
        filtered_prompt_ids=filtered,
        needs_seeding=version == 1 and not started,
    )


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=U32)]


class CheckedSnapshot(msgspec.Struct):
    """A version 2 `snapshot()` as a typed record: what a restore decodes to check a stream's
    snapshot in one C-speed pass, without building the stream (a lazy restore builds it only
    when the request's next event comes: `pipeline.request_state.RestoredRequest`).

    At least as strict as `read_snapshot`: exact JSON types (msgspec takes no bool for an int,
    no float for an int), the same value ranges, plus `snapshot_is_consistent`. A value it
    refuses is not necessarily bad: the caller then reads it with `read_snapshot`, whose error
    names the fault.
    """

    version: Literal[2]
    skip_special_tokens: bool
    unknown_generated_ids: UnknownPolicy
    ids: list[TokenId]
    prefix: str
    prefix_index: int
    started: bool
    held: str
    filtered_prompt_ids: list[TokenId]


def snapshot_is_consistent(data: CheckedSnapshot) -> bool:
    """The cross-field rules of `read_snapshot`, for a snapshot whose types already hold."""
    if not 0 <= data.prefix_index <= len(data.ids):
        return False
    return not (data.held and (data.prefix or data.prefix_index))


def _field(data: dict[str, Any], name: str, kind: type) -> Any:
    """`data[name]` if present and of type `kind` (a bool is not an int here), else the error."""
    if name not in data:
        raise SnapshotFormatError(f"decode snapshot has no {name!r}")
    value = data[name]
    if type(value) is not kind:
        raise SnapshotFormatError(
            f"decode snapshot {name!r} is {type(value).__name__}, not {kind.__name__}"
        )
    return value
