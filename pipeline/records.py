"""A logged generation as a reader hands it over: parsed, and where in its file it came from.

The seam between file formats and the core. A reader (JSONL, Parquet, an OpenAI batch file, in
`workers/formats/`) turns its file into `SourceRecord`s; `pipeline.offline` and `workers.io.replay`
only ever see these, so a new format touches neither. Parsing belongs to the reader because only
it knows the encoding (a JSON line, an Arrow row); the core keeps the rules that hold whatever the
format (one request id once, the decode itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.events import LoggedGeneration, dump_json
from schemas.validation import Rejection


@dataclass(slots=True)
class Position:
    """Where a record sits in its file, as a user would look it up there.

    One is built per record, so it is a plain slotted dataclass (a frozen one costs several
    times as much to create); nothing changes it after the reader.

    A text file counts lines from 1 (an editor's line number); a table file counts rows from 0
    across the whole file (the index pandas, DuckDB and `pyarrow` show), with the row group the
    row was read from, which is where a reader of a large file seeks.
    """

    line: int | None = None
    row: int | None = None
    row_group: int | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"line {self.line}"
        return f"row {self.row} (row group {self.row_group})"


@dataclass(slots=True)
class SourceRecord:
    """One record of an input file: the generation it holds, or why it holds none.

    `raw` is the record as it was read (a JSONL line) so a dead letter can carry it byte for
    byte. A table row has no such bytes: `raw` is then None for a good row, and `original()`
    writes the parsed generation as a JSON line when (rarely) a dead letter needs it, rather than
    paying that for every row; a bad row's reader sets `raw` to the row as JSON.
    """

    position: Position
    parsed: LoggedGeneration | Rejection
    raw: bytes | None = None

    def original(self) -> bytes:
        if self.raw is not None:
            return self.raw
        if isinstance(self.parsed, LoggedGeneration):
            return dump_json(self.parsed)
        return b""
