"""Parquet in and out: logged generations as columns, completions as typed columns.

pyarrow is the optional extra `detok[parquet]`, imported only when a Parquet file is read or
written, so JSONL users pay nothing for it and a missing install is one clear message.

Reading goes row group by row group, record batch by record batch, so memory holds one batch
(plus the row group pyarrow decodes it from), not the file. The id columns are the bulk of the
data, and converting them element by element would cost more than parsing JSON: each list column
is checked whole (nulls, range) with numpy, and a row's ids become a Python list in one
`tolist()` of its slice of the flat values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.records import Position, SourceRecord
from schemas.events import MAX_TOKEN_ID, Completion, DeadLetterReason, LoggedGeneration
from schemas.validation import MAX_MESSAGE_CHARS, Rejection, classify, is_row_fault
from workers.formats.base import Destination, FormatError, MissingExtra, RequestFailure

# Rows per record batch read. A batch's ids are held as numpy arrays and, row by row, as Python
# lists; 1024 rows of 2k-id generations is ~16 MB of numpy, which bounds read memory whatever
# the file size, and is enough rows per batch for the per-batch checks to cost nothing per row.
READ_BATCH_ROWS = 1024
# Completions buffered before they are written as one row group: large enough for Parquet's
# column compression and for readers to skip through few groups, small enough that buffered
# completions stay well under the read side's memory bound.
WRITE_ROW_GROUP_ROWS = 8192
ID_COLUMNS = ("prompt_token_ids", "output_token_ids")
REQUIRED_COLUMNS = ("request_id", "model", *ID_COLUMNS)
NO_IDS: dict[str, list[int]] = {name: [] for name in ID_COLUMNS}
LOGPROB_COLUMNS = frozenset({"output_logprobs", "output_top_logprobs"})
# OpenAI's `tools` list of a request, as its JSON text (a string column: a function's
# `parameters` is a free-form JSON Schema, which no fixed Parquet type holds) or as a nested
# list<struct<type, function>> column read as its values.
TOOLS_COLUMN = "tools"


def _arrow() -> tuple[Any, Any, Any]:
    try:
        import numpy
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        raise MissingExtra(
            f"Parquet needs pyarrow, which is not installed ({error}); "
            "install the extra: pip install 'detok[parquet]'"
        ) from error
    return pyarrow, pyarrow.parquet, numpy


def require_arrow() -> None:
    _arrow()


def _open(path: Path) -> Any:
    pa, pq, _ = _arrow()
    try:
        return pq.ParquetFile(path)
    except pa.ArrowInvalid as error:
        raise FormatError(f"{path} is not a Parquet file ({error})") from error


def parquet_rows(path: Path) -> int:
    """Rows in the file (from its footer): the progress bar's total."""
    return _open(path).metadata.num_rows


def parquet_records(path: Path, batch_rows: int = READ_BATCH_ROWS) -> Iterator[SourceRecord]:
    """One record per row, the row counted from 0 across the file.

    A column the generation needs but the file lacks, or a column of the wrong type, makes every
    row a dead letter that says so (the file is read to the end, as a file of bad lines is).
    """
    pa, _, _ = _arrow()
    parquet = _open(path)
    fields = set(LoggedGeneration.model_fields)
    columns = [name for name in parquet.schema_arrow.names if name in fields]
    row = 0
    for group in range(parquet.num_row_groups):
        batches = parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=columns)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as error:
                # A corrupt page: the rows past it cannot be told apart, so the run stops here
                # (its outputs are discarded) rather than guess.
                raise FormatError(f"{path}: row group {group} is unreadable ({error})") from error
            if batch is None:
                break
            yield from _batch_records(batch, row, group)
            row += batch.num_rows


class BadRow(FormatError):
    """A row that cannot be a logged generation (named in its dead letter as error class)."""


def _batch_records(batch: Any, first_row: int, group: int) -> Iterator[SourceRecord]:
    """The batch's records; an exception for one row dead-letters that row (issue 32), and one
    raised while reading the batch's columns as a whole is narrowed down row by row."""
    try:
        rows = _BatchRows(batch)
    except BaseException as error:
        if not is_row_fault(error):
            raise
        if batch.num_rows > 1:
            for index in range(batch.num_rows):
                yield from _batch_records(batch.slice(index, 1), first_row + index, group)
        else:
            yield _unexpected(batch, 0, Position(row=first_row, row_group=group), error)
        return
    for index in range(batch.num_rows):
        position = Position(row=first_row + index, row_group=group)
        try:
            yield rows.record(index, position)
        except BaseException as error:
            if not is_row_fault(error):
                raise
            yield _unexpected(batch, index, position, error)


class _BatchRows:
    """One batch's columns, checked whole, and each row's record from them."""

    def __init__(self, batch: Any) -> None:
        names = batch.schema.names
        self.batch = batch
        self.missing = [name for name in REQUIRED_COLUMNS if name not in names]
        self.ids = [_IdColumn(name, batch.column(name)) for name in ID_COLUMNS if name in names]
        self.others = [
            (name, batch.column(name).to_pylist()) for name in names if name not in ID_COLUMNS
        ]
        suspect = [bool(self.missing)] * batch.num_rows
        for column in self.ids:
            suspect = [a or b for a, b in zip(suspect, column.suspect, strict=True)]
        self.suspect = suspect
        self.whole = bool(LOGPROB_COLUMNS.intersection(names))
        self.tools_json = TOOLS_COLUMN in names and _is_text(batch.schema.field(TOOLS_COLUMN).type)

    def record(self, index: int, position: Position) -> SourceRecord:
        if self.suspect[index]:
            problem = (
                (DeadLetterReason.SCHEMA_VIOLATION, f"no column {', '.join(self.missing)}")
                if self.missing
                else next(p for p in (c.problem(index) for c in self.ids) if p is not None)
            )
            return _rejected(self.batch, index, position, *problem)
        # A null in an optional column means "not given": the model's default applies.
        fields = {name: values[index] for name, values in self.others if values[index] is not None}
        if self.tools_json and TOOLS_COLUMN in fields:
            try:
                fields[TOOLS_COLUMN] = json.loads(fields[TOOLS_COLUMN])
            except (ValueError, RecursionError) as error:
                message = f"{TOOLS_COLUMN} is not a JSON list of tools: {error}"[:MAX_MESSAGE_CHARS]
                return _rejected(
                    self.batch, index, position, DeadLetterReason.MALFORMED_JSON, message
                )
        row_ids = {column.name: column.ids(index) for column in self.ids}
        try:
            generation = _generation(fields, row_ids, self.whole)
        except ValidationError as error:
            message = str(error)[:MAX_MESSAGE_CHARS]
            return _rejected(self.batch, index, position, classify(error), message)
        return SourceRecord(position, generation)


def _is_text(kind: Any) -> bool:
    pa, _, _ = _arrow()
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def _generation(fields: dict[str, Any], ids: dict[str, list[int]], whole: bool) -> LoggedGeneration:
    """The row's generation, its ids already checked by `_IdColumn`.

    Without logprobs, the model checks every field but the ids: validating them again element by
    element, as Python ints, cost more than parsing the same row from JSON. The checked ids go
    straight into the new instance's fields (what `model_copy(update=...)` does, at a third of
    its cost); nothing else holds the instance yet. The rules that relate a field to the ids
    need the ids: logprobs are checked against them (one entry per id), so a file with those
    columns (`whole`) is validated whole, and so is a row with `prompt_tokens` (at least the ids
    sent; such a row's prompt is a tail of a few dozen ids, cheap to check again).
    """
    if whole or "prompt_tokens" in fields:
        if "output_top_logprobs" in fields:
            fields["output_top_logprobs"] = _pairs(fields["output_top_logprobs"])
        return LoggedGeneration.model_validate({**fields, **ids})
    generation = LoggedGeneration.model_validate({**fields, **NO_IDS})
    generation.__dict__.update(ids)
    return generation


def _pairs(positions: Any) -> Any:
    """Top logprobs as the model's (id, logprob) tuples, from a Parquet list of structs
    `{id, logprob}` or of two-element lists; anything else is left for the model to refuse."""
    if not isinstance(positions, list):
        return positions
    return [
        [
            (pair["id"], pair["logprob"])
            if isinstance(pair, dict) and pair.keys() == {"id", "logprob"}
            else tuple(pair)
            if isinstance(pair, list)
            else pair
            for pair in position
        ]
        if isinstance(position, list)
        else position
        for position in positions
    ]


class _IdColumn:
    """A list-of-integers column of one batch: per-row problems found once for the whole batch
    with numpy, and each row's ids as a Python list."""

    def __init__(self, name: str, column: Any) -> None:
        pa, _, np = _arrow()
        self.name = name
        kind = column.type
        self.type_error: str | None = None
        if not (
            (pa.types.is_list(kind) or pa.types.is_large_list(kind))
            and pa.types.is_integer(kind.value_type)
        ):
            self.type_error = f"column {name} has type {kind}, not a list of integers"
            self.suspect = [True] * len(column)
            return
        # `offsets` index `values`, the unsliced child array, whatever the batch's own offset.
        self.offsets = column.offsets.to_numpy()
        values = column.values
        self.flat = values.fill_null(0).to_numpy(zero_copy_only=False)
        low = self.flat < 0 if self.flat.dtype.kind == "i" else np.zeros(len(self.flat), bool)
        out_of_range = low | (self.flat > MAX_TOKEN_ID)
        self.null_rows = column.is_null().to_numpy(zero_copy_only=False)
        self.null_id_rows = _rows_with(
            values.is_null().to_numpy(zero_copy_only=False), self.offsets, np
        )
        self.bad_id_rows = _rows_with(out_of_range, self.offsets, np)
        # Rows with any problem, as Python bools: read once per row on the way through.
        self.suspect = (self.null_rows | self.null_id_rows | self.bad_id_rows).tolist()
        self.bounds = self.offsets.tolist()

    def problem(self, index: int) -> tuple[DeadLetterReason, str] | None:
        if self.type_error is not None:
            return DeadLetterReason.SCHEMA_VIOLATION, self.type_error
        if not self.suspect[index]:
            return None
        if self.null_rows[index]:
            return DeadLetterReason.SCHEMA_VIOLATION, f"{self.name} is null"
        if self.null_id_rows[index]:
            return DeadLetterReason.SCHEMA_VIOLATION, f"{self.name} holds a null id"
        return (
            DeadLetterReason.TOKEN_ID_OUT_OF_RANGE,
            f"{self.name} holds an id outside [0, {MAX_TOKEN_ID}]",
        )

    def ids(self, index: int) -> list[int]:
        return self.flat[self.bounds[index] : self.bounds[index + 1]].tolist()


def _rows_with(flags: Any, offsets: Any, np: Any) -> Any:
    """Per row, whether any of its elements is flagged (offsets[i]..offsets[i+1])."""
    running = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    return running[offsets[1:]] - running[offsets[:-1]] > 0


def _unexpected(batch: Any, index: int, position: Position, error: BaseException) -> SourceRecord:
    message = f"{type(error).__name__}: {error}"[:MAX_MESSAGE_CHARS]
    try:
        return _rejected(batch, index, position, DeadLetterReason.UNEXPECTED_ERROR, message)
    except Exception:  # the row cannot even be shown: its dead letter says where it was
        rejection = Rejection(DeadLetterReason.UNEXPECTED_ERROR, BadRow.__name__, message)
        return SourceRecord(position, rejection, b"")


def _rejected(
    batch: Any, index: int, position: Position, reason: DeadLetterReason, message: str
) -> SourceRecord:
    row = batch.slice(index, 1).to_pylist()[0]
    raw = json.dumps(row, ensure_ascii=False, default=repr).encode()
    return SourceRecord(position, Rejection(reason, BadRow.__name__, message), raw)


def _completion_schema(chat: bool) -> Any:
    """`Completion`'s fields as typed columns; logprobs nest as OpenAI's `content` list. The
    chat outputs' columns only with `chat`: three all-null columns cost a file without them
    about 15% more conversion time and 2% more bytes."""
    pa, _, _ = _arrow()
    top = pa.struct(
        [
            pa.field("id", pa.uint32(), nullable=False),
            pa.field("token", pa.string(), nullable=False),
            pa.field("bytes", pa.list_(pa.uint8()), nullable=False),
            pa.field("logprob", pa.float64(), nullable=False),
        ]
    )
    token = pa.struct(
        [
            pa.field("id", pa.uint32(), nullable=False),
            pa.field("token", pa.string(), nullable=False),
            pa.field("bytes", pa.list_(pa.uint8()), nullable=False),
            pa.field("text", pa.string(), nullable=False),
            pa.field("text_offset", pa.int64(), nullable=False),
            pa.field("logprob", pa.float64(), nullable=False),
            pa.field("top_logprobs", pa.list_(top), nullable=False),
        ]
    )
    function = pa.struct(
        [
            pa.field("name", pa.string(), nullable=False),
            pa.field("arguments", pa.string(), nullable=False),  # a JSON string, as OpenAI's
        ]
    )
    call = pa.struct(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("type", pa.string(), nullable=False),
            pa.field("function", function, nullable=False),
        ]
    )
    columns = [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64(), nullable=False),
        pa.field("generated_tokens", pa.int64(), nullable=False),
        pa.field("filtered_prompt_ids", pa.list_(pa.uint32()), nullable=False),
        pa.field("error", pa.string()),
        pa.field("stop_reason", pa.string()),
        pa.field("logprobs", pa.struct([pa.field("content", pa.list_(token))])),
    ]
    if chat:  # null for a request no chat parser read
        columns += [
            pa.field("reasoning", pa.string()),
            pa.field("tool_calls", pa.list_(call)),
            pa.field("reasoning_tokens", pa.int64()),
        ]
    return pa.schema(columns)


class ParquetCompletions:
    """Completions as Parquet rows, one per request, written a row group at a time as they
    arrive: the columns are `Completion`'s fields (all but the constant `type`, and the chat
    outputs' unless `chat`).

    A completion the columns cannot hold (a count past int64: one written to the completions
    topic before counts were bounded, issue 32) is left out and named in `refused`, and the
    rest of its row group is written; it must not fail every collect of the topic.
    """

    def __init__(self, destination: Destination, *, chat: bool = False) -> None:
        _, pq, _ = _arrow()
        self._schema = _completion_schema(chat)
        # Opened here, not by pyarrow: its own file seeks, which a FIFO or a pipe cannot.
        self._handle = destination.path.open(f"{destination.mode}b")
        self._writer = pq.ParquetWriter(self._handle, self._schema)
        self._rows: list[dict[str, Any]] = []
        self.refused: list[RequestFailure] = []

    def write(self, completion: Completion | None, failure: RequestFailure | None) -> None:
        if completion is not None:
            self._rows.append(completion.model_dump(exclude={"type"}))
            if len(self._rows) >= WRITE_ROW_GROUP_ROWS:
                self._flush()

    def close(self) -> None:
        try:
            self._flush()
            self._writer.close()
        finally:
            self._handle.close()

    def _flush(self) -> None:
        if self._rows:
            try:
                table = self._table(self._rows)
            except BaseException as error:
                if not is_row_fault(error):
                    raise
                table = self._writable(self._rows)
            self._writer.write_table(table)
            self._rows = []

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        pa, _, _ = _arrow()
        return pa.Table.from_pylist(rows, schema=self._schema)

    def _writable(self, rows: list[dict[str, Any]]) -> Any:
        """The rows the columns can hold, converted one by one (only after a group failed)."""
        pa, _, _ = _arrow()
        tables = []
        for row in rows:
            try:
                tables.append(self._table([row]))
            except BaseException as error:
                if not is_row_fault(error):
                    raise
                message = f"not writable as Parquet: {type(error).__name__}: {error}"
                code = DeadLetterReason.UNEXPECTED_ERROR.value
                self.refused.append(RequestFailure(row["request_id"], code, message))
        return pa.concat_tables(tables) if tables else self._table([])


def read_completions(path: Path) -> Iterator[Completion]:
    """The completions of a file `ParquetCompletions` wrote, batch by batch."""
    for batch in _open(path).iter_batches(batch_size=READ_BATCH_ROWS):
        for row in batch.to_pylist():
            # JSON mode: the column values are JSON's kinds (a nested struct is a dict).
            yield Completion.model_validate_json(json.dumps(row))


def write_generations(path: Path, generations: Iterator[dict[str, Any]], rows: int = 65536) -> None:
    """Logged generations (dicts of their fields) as a Parquet file, `rows` per row group, ids as
    list<uint32>: how a user's export looks, for the tests and benchmarks that read one."""
    pa, pq, _ = _arrow()
    schema = pa.schema(
        [
            pa.field("request_id", pa.string()),
            pa.field("model", pa.string()),
            pa.field("prompt_token_ids", pa.list_(pa.uint32())),
            pa.field("output_token_ids", pa.list_(pa.uint32())),
            pa.field("skip_special_tokens", pa.bool_()),
            pa.field("finish_reason", pa.string()),
        ]
    )
    with pq.ParquetWriter(path, schema) as writer:
        chunk: list[dict[str, Any]] = []
        for generation in generations:
            chunk.append(generation)
            if len(chunk) == rows:
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                chunk = []
        if chunk:
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
