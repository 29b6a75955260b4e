"""detok's own JSONL: one logged generation per line in, one completion per line out.

The format `detok run` has always read and written; the other formats are measured against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pipeline.records import Position, SourceRecord
from schemas.events import Completion, LoggedGeneration
from schemas.validation import parse_model
from workers.formats.base import RequestFailure


def jsonl_records(lines: Iterable[bytes]) -> Iterator[SourceRecord]:
    """One record per non-blank line, numbered from 1 as an editor numbers them."""
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        line = raw.rstrip(b"\r\n")
        yield SourceRecord(Position(line=number), parse_model(LoggedGeneration, line), line)


def completion_line(completion: Completion | None, failure: RequestFailure | None) -> str | None:
    """detok's completion line, for every completion (a failed one says so in `status`)."""
    return None if completion is None else completion.model_dump_json()
