"""Decode logged generations without Kafka, with the worker's own processor.

The same `RequestProcessor` the Kafka worker runs is fed the same events `detok replay` would
produce, so `detok run` is the oracle for the whole pipeline: replay -> worker -> collect must give
exactly these completions. Records come from a reader (`pipeline.records`): this module knows
nothing of lines, JSON or Parquet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest

from pipeline.chat.config import ChatParsers
from pipeline.errors import DuplicateRequestIdError
from pipeline.generations import DEFAULT_CHUNK_SIZE, generation_events
from pipeline.processor import RequestProcessor
from pipeline.records import Position, SourceRecord
from pipeline.results import BatchResult, DeadLetter, Header
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Completion, DeadLetterReason, LoggedGeneration
from schemas.fast_events import ParsedEvent
from schemas.validation import MAX_MESSAGE_CHARS, Rejection, is_row_fault

# Requests decoded together. Each round pushes one chunk of every request in the window through
# one batched decode, as a worker's consumed batch would; 256 keeps state small and rounds large
# enough for `decode_batch` to pay for its thread fan-out.
DEFAULT_WINDOW = 256


@dataclass
class Outcome:
    """What one input record became: a completion, a dead letter, or both (a failed decode)."""

    position: Position
    completion: Completion | None = None
    dead_letter: DeadLetter | None = None


@dataclass(slots=True)
class _RecordOrigin:
    """The processor's `Origin` of a file record: its index in the window as offset, and its
    original bytes built only if a dead letter asks (a Parquet row has none to hand)."""

    source: str
    offset: int
    record: SourceRecord
    partition: int = 0
    key: bytes | None = None
    headers: tuple[Header, ...] = ()
    timestamp_ms: int | None = None

    @property
    def value(self) -> bytes:
        return self.record.original()


def run_generations(
    records: Iterable[SourceRecord],
    registry: TokenizerRegistry,
    *,
    source: str = "input",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window: int = DEFAULT_WINDOW,
    chat_parsers: ChatParsers = ChatParsers(),  # noqa: B008 (frozen: one shared empty default)
) -> Iterator[Outcome]:
    """Yield one outcome per record, in input order; `chat_parsers` split each model's text
    into content, reasoning and tool calls as a worker's do (docs/chat-outputs.md).

    A request id seen earlier in the input is refused here, whatever the format: two
    generations under one id would be one request to the processor.
    """
    pending: list[SourceRecord] = []
    seen: set[str] = set()
    for record in records:
        parsed = record.parsed
        if isinstance(parsed, LoggedGeneration):
            if parsed.request_id in seen:
                record.parsed = Rejection(
                    DeadLetterReason.SCHEMA_VIOLATION,
                    DuplicateRequestIdError.__name__,
                    f"request id {parsed.request_id!r} already appeared earlier in the input",
                )
            else:
                seen.add(parsed.request_id)
        pending.append(record)
        if len(pending) == window:
            yield from _run_window(pending, registry, source, chunk_size, chat_parsers)
            pending = []
    if pending:
        yield from _run_window(pending, registry, source, chunk_size, chat_parsers)


def _run_window(
    pending: list[SourceRecord],
    registry: TokenizerRegistry,
    source: str,
    chunk_size: int,
    chat_parsers: ChatParsers,
) -> Iterator[Outcome]:
    processor = RequestProcessor(registry, chat_parsers=chat_parsers)
    outcomes = [Outcome(record.position) for record in pending]
    index_of: dict[str, int] = {}
    streams = []
    for index, record in enumerate(pending):
        origin = _RecordOrigin(source, index, record)
        parsed = record.parsed
        if isinstance(parsed, LoggedGeneration):
            parsed = _events_of(parsed, chunk_size)
        if isinstance(parsed, Rejection):
            outcomes[index].dead_letter = DeadLetter(
                parsed.reason, parsed.error_class, parsed.message, None, None, origin
            )
            continue
        request_id, events = parsed
        index_of[request_id] = index
        streams.append([(event, origin) for event in events])
    for round_events in zip_longest(*streams):
        _collect(processor.process(e for e in round_events if e is not None), outcomes, index_of)
    _collect(processor.flush_incomplete(), outcomes, index_of)
    yield from outcomes


def _events_of(
    generation: LoggedGeneration, chunk_size: int
) -> tuple[str, list[ParsedEvent]] | Rejection:
    """The generation's events, or the rejection of its record: an exception cutting one
    generation (a reader that let a row through that the events refuse, issue 32) fails that
    record alone, and the rest of the file completes."""
    try:
        return generation.request_id, generation_events(generation, chunk_size)
    except BaseException as error:
        if not is_row_fault(error):
            raise
        message = str(error)[:MAX_MESSAGE_CHARS]
        return Rejection(DeadLetterReason.UNEXPECTED_ERROR, type(error).__name__, message)


def _collect(result: BatchResult, outcomes: list[Outcome], index_of: dict[str, int]) -> None:
    for completion in result.completions:
        outcomes[index_of[completion.request_id]].completion = completion
    for dead_letter in result.dead_letters:
        if dead_letter.origin is not None:
            outcome = outcomes[dead_letter.origin.offset]
        else:
            outcome = outcomes[index_of[dead_letter.request_id]]
        # One dead letter per record: the first reason is the cause, later ones are its echoes.
        if outcome.dead_letter is None:
            outcome.dead_letter = dead_letter
