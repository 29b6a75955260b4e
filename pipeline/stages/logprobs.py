"""The logprobs stage: each generated id's logprob and alternatives, placed in the text.

A request has logprobs when its first tokens event with ids carries them (docs/decode-
options.md). Its ids are pushed one by one (each token's text is part of its entry); the stage
keeps the columns (`ActiveRequest.lp_*`), checks each event's alternatives against the
vocabulary, and builds the entries deltas and the completion carry (`pipeline.logprobs`).
An entry's `text_offset` counts the request's generated text as decoded (before any other
stage splits it), so entries stay per token whatever a later stage makes of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.logprobs import LogprobEntry, build_entries, check_alternatives, logprobs_model
from pipeline.request_state import ActiveRequest, HeldEvent
from pipeline.stages.base import Chunk, Fault, StageConfig, StageKind, TextStage
from pipeline.tokenizer_registry import TokenizerRegistry
from pipeline.vocab_tables import profile_for
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedTokens

if TYPE_CHECKING:
    from pipeline.requests.work import Work
    from pipeline.results import Delta


class Logprobs(TextStage, StageKind):
    """The stage of a request with logprobs (one per processor: its state is the request's
    columns)."""

    __slots__ = ("registry",)
    per_token = True

    def __init__(self, config: StageConfig) -> None:
        self.registry = config.registry

    def choose(self, request_id: str, state: ActiveRequest, entry: Work | None) -> TextStage | None:
        """Decided by the request's first tokens event with ids, so a request decoded without
        logprobs costs nothing here once decided."""
        logprobs = state.logprobs
        if logprobs is not None:
            return self if logprobs else None
        first = _first_with_ids(state, entry)
        return self if first is not None and first.logprobs is not None else None

    def settled(self, state: ActiveRequest, entry: Work | None) -> bool:
        if state.logprobs is not None or state.generated_tokens:
            return True
        return _first_with_ids(state, entry) is not None

    def check(self, entry: Work) -> Fault | None:
        return check(self.registry, entry)

    def decoded(self, state: ActiveRequest, chunk: Chunk, count: int) -> None:
        if state.logprobs:
            record(state, chunk.entry.events, count, chunk.texts or [])

    def publish(self, state: ActiveRequest, delta: Delta) -> None:
        delta.logprobs = new_entries(self.registry, state, delta.final, state.text_chars)

    def complete(self, state: ActiveRequest, fields: dict[str, Any]) -> None:
        if state.logprobs:
            # Validated once here into the models; deltas carry the plain entries.
            fields["logprobs"] = logprobs_model(all_entries(self.registry, state))


def _first_with_ids(state: ActiveRequest, entry: Work | None) -> ParsedTokens | None:
    """The tokens event that decides whether a request has logprobs, if it is in `entry`;
    None when none is (a request that generated ids already was decided without: a snapshot
    leaves an option-less request's `logprobs` None)."""
    if state.generated_tokens or entry is None:
        return None
    for held in entry.events:
        event = held.event
        if type(event) is ParsedTokens and event.token_ids:
            return event
    return None


def check(registry: TokenizerRegistry, entry: Work) -> Fault | None:
    """Whether the chunk's logprobs can be used: None, or what fails the request.

    The first tokens event with ids decides whether a request has logprobs; in one that has
    them, a later event with ids but without them fails it (its entries could not be written),
    while logprobs on a later event of a request without them are ignored. An alternative id
    the tokenizer and the model cannot have produced is `token_id_out_of_range`, like such a
    prompt id.
    """
    state = entry.state
    expected = state.logprobs
    if expected is None and state.generated_tokens:
        expected = state.logprobs = False  # see `wanted`
    if expected is False:
        return None  # decided without logprobs: later ones are ignored
    limit: int | None = None
    for index, held in enumerate(entry.events):
        event = held.event
        if type(event) is not ParsedTokens or not event.token_ids:
            continue
        present = event.logprobs is not None
        if expected is None:
            expected = present
        if not expected:
            break  # decided without logprobs: later ones are ignored
        if not present:
            message = "this tokens event has no logprobs, and its request's first one had"
            return index, DeadLetterReason.SCHEMA_VIOLATION, message
        if event.top_logprobs is not None:
            if limit is None:
                model = registry.get(state.model)
                limit = max(model.model_vocab_size or 0, model.tokenizer_vocab_size)
            bad = check_alternatives(event.top_logprobs, limit)
            if bad >= 0:
                message = (
                    f"top_logprobs token id {bad} is outside the tokenizer and the model "
                    f"vocabulary ({limit} ids)"
                )
                return index, DeadLetterReason.TOKEN_ID_OUT_OF_RANGE, message
    if expected is not None:
        state.logprobs = expected
    return None


def record(
    state: ActiveRequest, events: Sequence[HeldEvent], pushed: int, texts: list[str]
) -> None:
    """Append the logprob columns of the first `pushed` ids of the chunk."""
    state.own_columns()
    taken = 0
    for held in events:
        event = held.event
        # An event without ids owes no logprobs (`check` passes it over too).
        if type(event) is not ParsedTokens or not event.token_ids or taken >= pushed:
            continue
        count = min(len(event.token_ids), pushed - taken)
        state.lp_ids += event.token_ids[:count]
        state.lp_values += event.logprobs[:count]  # type: ignore[index]  # checked
        tops = event.top_logprobs
        state.lp_tops += tops[:count] if tops is not None else [[] for _ in range(count)]
        taken += count
    offset = state.text_chars
    offsets = state.lp_offsets
    for text in texts[:pushed]:
        offsets.append(offset)
        offset += len(text)


def new_entries(
    registry: TokenizerRegistry, state: ActiveRequest, finished: bool, cut: int
) -> list[LogprobEntry] | None:
    """Entries no delta has carried whose text is now published, or None for a request
    without logprobs. A token's text is settled once the next token is pushed (the last
    token's only at the end, which may add the finish flush), and published once no part
    of it is held back for a possible stop."""
    if not state.logprobs:
        return None
    published = state.text_chars - len(state.stop_held)
    offsets = state.lp_offsets
    count = len(offsets)
    first = state.lp_sent
    last = count if finished else max(count - 1, first)
    while last > first and last < count and offsets[last] > published:
        last -= 1
    if last <= first:
        return []
    state.lp_sent = last
    made = entries(registry, state, first, last, cut)
    built = state.lp_built
    if len(built) == first:  # kept for the completion (not after a restore)
        if built:
            built += made  # type: ignore[operator]  # a non-empty one is a list
        else:
            state.lp_built = list(made)  # its own: the delta carries `made`
    return made


def all_entries(registry: TokenizerRegistry, state: ActiveRequest) -> list[LogprobEntry]:
    """Every entry of the request, for its completion: those deltas carried, or rebuilt from
    the columns (after a restore, or when deltas did not carry them all)."""
    count = len(state.lp_offsets)
    built = state.lp_built
    if len(built) == count:
        return built  # type: ignore[return-value]
    return entries(registry, state, 0, count, state.text_chars) if count else []


def entries(
    registry: TokenizerRegistry, state: ActiveRequest, first: int, last: int, cut: int
) -> list[LogprobEntry]:
    """The entries of tokens `first..last-1`, their text cut at `cut` (`build_entries`)."""
    start = min(state.lp_offsets[first], cut)
    return build_entries(
        profile_for(registry.get(state.model).tokenizer),
        state.lp_ids,
        state.lp_values,
        state.lp_tops,
        state.lp_offsets,
        first,
        last,
        state.text_tail(state.text_chars - start),
        start,
        cut,
    )
