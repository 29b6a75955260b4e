"""Decode a file of logged generations without Kafka, with the worker's own processor.

The same `RequestProcessor` the Kafka worker runs is fed the same events `detok replay` would
produce, so `detok run` is the oracle for the whole pipeline: replay -> worker -> collect must give
exactly these completions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest

from pipeline.errors import DuplicateRequestIdError
from pipeline.generations import DEFAULT_CHUNK_SIZE, generation_events
from pipeline.processor import RequestProcessor
from pipeline.results import BatchResult, DeadLetter, EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Completion, DeadLetterReason, LoggedGeneration
from schemas.validation import Rejection, parse_model

# Requests decoded together. Each round pushes one chunk of every request in the window through
# one batched decode, as a worker's consumed batch would; 256 keeps state small and rounds large
# enough for `decode_batch` to pay for its thread fan-out.
DEFAULT_WINDOW = 256


@dataclass
class LineOutcome:
    """What one input line became: a completion, a dead letter, or both (a failed decode)."""

    line: int
    completion: Completion | None = None
    dead_letter: DeadLetter | None = None


def run_generations(
    lines: Iterable[bytes],
    registry: TokenizerRegistry,
    *,
    source: str = "input",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    window: int = DEFAULT_WINDOW,
) -> Iterator[LineOutcome]:
    """Yield one outcome per non-blank line, in input order."""
    pending: list[tuple[int, bytes, LoggedGeneration | Rejection]] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        parsed = parse_model(LoggedGeneration, raw)
        if isinstance(parsed, LoggedGeneration) and parsed.request_id in seen:
            parsed = Rejection(
                DeadLetterReason.SCHEMA_VIOLATION,
                DuplicateRequestIdError.__name__,
                f"request id {parsed.request_id!r} already appeared earlier in the input",
            )
        elif isinstance(parsed, LoggedGeneration):
            seen.add(parsed.request_id)
        pending.append((number, raw, parsed))
        if len(pending) == window:
            yield from _run_window(pending, registry, source, chunk_size)
            pending = []
    if pending:
        yield from _run_window(pending, registry, source, chunk_size)


def _run_window(
    pending: list[tuple[int, bytes, LoggedGeneration | Rejection]],
    registry: TokenizerRegistry,
    source: str,
    chunk_size: int,
) -> Iterator[LineOutcome]:
    processor = RequestProcessor(registry)
    outcomes = {number: LineOutcome(number) for number, _, _ in pending}
    line_of: dict[str, int] = {}
    streams = []
    for number, raw, parsed in pending:
        origin = EventOrigin(source=source, partition=0, offset=number, value=raw.rstrip(b"\r\n"))
        if isinstance(parsed, Rejection):
            outcomes[number].dead_letter = DeadLetter(
                parsed.reason, parsed.error_class, parsed.message, None, None, origin
            )
            continue
        line_of[parsed.request_id] = number
        streams.append([(event, origin) for event in generation_events(parsed, chunk_size)])
    for round_events in zip_longest(*streams):
        _collect(processor.process(e for e in round_events if e is not None), outcomes, line_of)
    _collect(processor.flush_incomplete(), outcomes, line_of)
    yield from outcomes.values()


def _collect(
    result: BatchResult, outcomes: dict[int, LineOutcome], line_of: dict[str, int]
) -> None:
    for completion in result.completions:
        outcomes[line_of[completion.request_id]].completion = completion
    for dead_letter in result.dead_letters:
        if dead_letter.origin is not None:
            outcome = outcomes[dead_letter.origin.offset]
        else:
            outcome = outcomes[line_of[dead_letter.request_id]]
        # One dead letter per line: the first reason is the cause, later ones are its echoes.
        if outcome.dead_letter is None:
            outcome.dead_letter = dead_letter
