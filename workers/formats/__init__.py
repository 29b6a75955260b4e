"""File formats of `detok run`, `detok replay` and `detok collect`, behind one seam.

Readers turn a file into `pipeline.records.SourceRecord`s (a logged generation and its position),
writers take each request's completion (`base.CompletionWriter`). A format comes from the file's
extension (`.parquet` is Parquet, anything else detok's JSONL) unless `--input-format` /
`--output-format` names it; the OpenAI shapes are JSONL files too, so they are always named.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from pipeline.records import SourceRecord
from workers.formats.base import CompletionWriter, Destination, LineWriter
from workers.formats.jsonl import completion_line, jsonl_records
from workers.formats.openai import batch_output_lines, completion_lines, openai_batch_records

INPUT_FORMATS = ("jsonl", "parquet", "openai-batch")
OUTPUT_FORMATS = ("jsonl", "parquet", "openai-completion", "openai-chat", "openai-batch")
PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
# Inputs smaller than this finish before a progress bar would tell anyone anything.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024
# Parquet's progress counts rows; below this many a bar tells nobody anything either.
PROGRESS_MIN_ROWS = 20_000


def format_of(path: Path, given: str | None) -> str:
    """The format named on the command line, else the one the extension says."""
    if given is not None:
        return given
    return "parquet" if path.suffix.lower() in PARQUET_SUFFIXES else "jsonl"


@contextmanager
def reading(path: Path, fmt: str, *, progress: str | None) -> Iterator[Iterator[SourceRecord]]:
    """The records of `path`, with a progress bar named `progress` on stderr for inputs large
    enough to want one (none when `progress` is None). Raises FormatError (MissingExtra) before
    yielding when the file cannot be read as `fmt`, OSError when it cannot be opened."""
    if fmt == "parquet":
        from workers.formats.parquet import parquet_records, parquet_rows

        rows = parquet_rows(path)
        bar = _bar(progress, rows, "rows", rows >= PROGRESS_MIN_ROWS)
        try:
            yield _counted(parquet_records(path), bar)
        finally:
            _close(bar)
        return
    size = path.stat().st_size
    with path.open("rb") as handle:
        bar = _bar(progress, size, "B", size >= PROGRESS_MIN_BYTES)
        try:
            lines = _lines(handle, bar)
            yield openai_batch_records(lines) if fmt == "openai-batch" else jsonl_records(lines)
        finally:
            _close(bar)


def completion_writer(
    destination: Destination, fmt: str, *, created: int, chat: bool = False
) -> CompletionWriter:
    """A writer of `fmt` into `destination`. `chat`: completions may carry chat outputs
    (docs/chat-outputs.md), so Parquet has their columns; without it a file is what it was
    before them (JSON formats write the fields a completion has whatever `chat` says)."""
    if fmt == "parquet":
        from workers.formats.parquet import ParquetCompletions

        return ParquetCompletions(destination, chat=chat)
    if fmt == "openai-completion":
        return LineWriter(destination.open_text(), completion_lines(created))
    if fmt == "openai-chat":
        return LineWriter(destination.open_text(), completion_lines(created, chat=True))
    if fmt == "openai-batch":
        return LineWriter(destination.open_text(), batch_output_lines(created))
    return LineWriter(destination.open_text(), completion_line)


@contextmanager
def replacing(path: Path) -> Iterator[Destination]:
    """A temporary file that replaces `path` when the block ends cleanly and vanishes on an
    error; or `path` itself when it is not a regular file.

    The temporary file sits beside the file `path` names, through any symbolic links (so the
    rename is atomic on one file system and replaces the file, not a link to it); the writer
    creates it exclusively, with the permissions a plain `open` would give. A device, a FIFO or
    a socket (`/dev/null`, `/dev/stdout` on a pipe, a named pipe) is written in place: renaming
    a file over it would replace the node itself, `/dev/null` for every process when run as
    root (issue 32).
    """
    try:
        status = path.stat()
    except FileNotFoundError:  # a new file (or a link to none): created by the rename
        status = None
    if status is not None and not stat.S_ISREG(status.st_mode):
        yield Destination(path, "w")
        return
    target = path if status is None else Path(os.path.realpath(path))
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield Destination(temporary, "x")
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def require(fmt: str) -> None:
    """Raise MissingExtra now if `fmt` needs a dependency that is not installed (before a
    command spends minutes on work it could not write)."""
    if fmt == "parquet":
        from workers.formats.parquet import require_arrow

        require_arrow()


def _bar(desc: str | None, total: int, unit: str, wanted: bool) -> tqdm | None:
    if desc is None or not wanted:
        return None
    scale = unit == "B"
    return tqdm(total=total, unit=unit, unit_scale=scale, desc=desc, file=sys.stderr)


def _close(bar: tqdm | None) -> None:
    if bar is not None:
        bar.close()


def _lines(handle: BinaryIO, bar: tqdm | None) -> Iterable[bytes]:
    if bar is None:
        return handle
    return _counted_lines(handle, bar)


def _counted_lines(handle: BinaryIO, bar: tqdm) -> Iterator[bytes]:
    for line in handle:
        bar.update(len(line))
        yield line


def _counted(records: Iterator[SourceRecord], bar: tqdm | None) -> Iterator[SourceRecord]:
    if bar is None:
        yield from records
        return
    for record in records:
        bar.update(1)
        yield record
