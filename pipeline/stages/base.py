"""The text-stage interface: what a request's options do to its text, in one shape.

A text stage sits between the decode and the outcomes of one request. The decoder asks each of
a request's stages, in order, what it needs of the decode (`per_token`: each id's text, so the
chunk is pushed id by id; `stream_before`: a copy of the stream from before the chunk), whether
a chunk can be used (`check`), whether the chunk's text ends the request (`stops`, then
`end`), and hands each the chunk's ids that count (`decoded`). The text then flows through
the stages: `release` says what of the text reaching a stage may go on now (the rest it holds
back), `publish` fills in or rewrites the stage's fields of a delta, `complete` those of the
completion. A stage's state lives on the request's state (`pipeline.request_state`), in its own
snapshot field.

A request's stages are chosen in one place (`pipeline.stages.Stages`), from its prompt event
and the processor's configuration, by a `StageKind` per stage module, into a `Plan` (the hooks
its stages have): a request without options gets the empty plan and pays for no hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pipeline.chat.config import ChatParsers
    from pipeline.decode_stream import DecodeStream
    from pipeline.request_state import ActiveRequest
    from pipeline.requests.outcomes import Outcomes
    from pipeline.requests.work import Work
    from pipeline.results import BatchResult, Delta
    from pipeline.tokenizer_registry import ModelTokenizer, TokenizerRegistry
    from schemas.events import DeadLetterReason
    from schemas.fast_events import ParsedPrompt

# (index of the unusable event in the chunk, reason, message): what fails a chunk's request.
Fault = tuple[int, "DeadLetterReason", str]


@dataclass(slots=True)
class Chunk:
    """One request's chunk as decoded, as its stages see it."""

    entry: Work
    ids: list[int]  # the chunk's generated ids, joined
    pushed: int  # how many of them were decoded (all, or those before a failing id)
    text: str  # their text, with the finish flush when the chunk finishes the request
    texts: list[str] | None  # each pushed id's text, when a stage asked (`per_token`)
    before: DecodeStream | None  # the stream before the chunk, when a stage asked
    finished: bool
    plan: Plan


class TextStage:
    """One decode option's work on a request's text; every hook defaults to doing nothing."""

    __slots__ = ()
    per_token: ClassVar[bool] = False  # the chunk is pushed id by id, `Chunk.texts` filled
    stream_before: ClassVar[bool] = False  # `Chunk.before` is a copy of the stream

    def check(self, entry: Work) -> Fault | None:
        """Before the chunk is decoded: None, or the event that fails its request."""
        return None

    def stops(self, state: ActiveRequest, text: str) -> Any:
        """Where the chunk's `text` ends the request (a stop string), or None: a cheap test
        run on every chunk, before its ids are handed to the stages."""
        return None

    def end(self, out: Outcomes, chunk: Chunk, found: Any, result: BatchResult) -> None:
        """End the request where `stops` found its end: publish its last delta and its
        completion (through the other stages) and close it."""

    def decoded(self, state: ActiveRequest, chunk: Chunk, count: int) -> None:
        """The chunk's first `count` ids are the request's (all pushed, or up to a stop)."""

    def release(self, state: ActiveRequest, text: str, finished: bool) -> str:
        """Of the text reaching this stage, what goes on now; the stage holds the rest."""
        return text

    def publish(self, state: ActiveRequest, delta: Delta) -> None:
        """Fill in (or rewrite) this stage's fields of a delta about to be published."""

    def complete(self, state: ActiveRequest, fields: dict[str, Any]) -> None:
        """Fill in (or rewrite) this stage's fields of the request's completion."""

    def holds(self, state: ActiveRequest) -> bool:
        """Whether the stage holds text back that a failure must still publish."""
        return False


class StageKind:
    """A stage module's choice, made once per processor: which requests get the stage."""

    __slots__ = ()

    def opened(self, event: ParsedPrompt, model: ModelTokenizer) -> Mapping[str, Any]:
        """The request state's fields this stage takes from its prompt event."""
        return {}

    def choose(self, request_id: str, state: ActiveRequest, entry: Work | None) -> TextStage | None:
        """The request's stage, or None when it has none (`entry`: its chunk, if decoding). A
        stage that keeps state of its own (beyond the request's fields) is made here, for
        a new request or one restored from its snapshot."""
        return None

    def settled(self, state: ActiveRequest, entry: Work | None) -> bool:
        """Whether `choose` can no longer change its answer for this request."""
        return True


# A plan's attribute for each hook: the bound hooks of the stages that have it.
_HOOKS = {
    "check": "checks",
    "stops": "stoppers",
    "decoded": "decodes",
    "release": "releases",
    "publish": "publishes",
    "complete": "completes",
    "holds": "holders",
}


class Plan:
    """A request's stages, and for each hook the bound hooks of the stages that have one: the
    decode calls no hook a stage leaves to `TextStage` (its per-chunk cost is only the work
    its stages do). Falsy for a request without stages."""

    __slots__ = ("stages", "per_token", "stream_before", "whole", *_HOOKS.values())

    def __init__(self, stages: tuple[TextStage, ...]) -> None:
        self.stages = stages
        self.per_token = any(stage.per_token for stage in stages)
        self.stream_before = any(stage.stream_before for stage in stages)
        for hook, name in _HOOKS.items():
            base = getattr(TextStage, hook)
            bound = tuple(
                getattr(stage, hook) for stage in stages if getattr(type(stage), hook) is not base
            )
            setattr(self, name, bound)
        # Stages that check no chunk and need nothing of the decode but its text.
        self.whole = not (self.checks or self.per_token or self.stream_before)  # type: ignore[attr-defined]
        # With each `stops`, the same stage's `end`.
        self.stoppers = tuple(  # type: ignore[assignment]
            (stage.stops, stage.end) for stage in stages if type(stage).stops is not TextStage.stops
        )

    def __bool__(self) -> bool:
        return bool(self.stages)


NO_PLAN = Plan(())


@dataclass(frozen=True)
class StageConfig:
    """What stage kinds are built from: the processor's registry and chat-parser settings."""

    registry: TokenizerRegistry
    chat_parsers: ChatParsers
