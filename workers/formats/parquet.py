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
from schemas.validation import MAX_MESSAGE_CHARS, Rejection, classify
from workers.formats.base import FormatError, MissingExtra, RequestFailure

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
    parquet = _open(path)
    fields = set(LoggedGeneration.model_fields)
    columns = [name for name in parquet.schema_arrow.names if name in fields]
    row = 0
    for group in range(parquet.num_row_groups):
        for batch in parquet.iter_batches(
            batch_size=batch_rows, row_groups=[group], columns=columns
        ):
            yield from _batch_records(batch, row, group)
            row += batch.num_rows


class BadRow(FormatError):
    """A row that cannot be a logged generation (named in its dead letter as error class)."""


def _batch_records(batch: Any, first_row: int, group: int) -> Iterator[SourceRecord]:
    names = batch.schema.names
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    ids = [_IdColumn(name, batch.column(name)) for name in ID_COLUMNS if name in names]
    others = {name: batch.column(name).to_pylist() for name in names if name not in ID_COLUMNS}
    for index in range(batch.num_rows):
        position = Position(row=first_row + index, row_group=group)
        if missing:
            problem = (DeadLetterReason.SCHEMA_VIOLATION, f"no column {', '.join(missing)}")
        else:
            problem = next((p for p in (c.problem(index) for c in ids) if p is not None), None)
        if problem is not None:
            yield _rejected(batch, index, position, *problem)
            continue
        # A null in an optional column means "not given": the model's default applies.
        fields = {name: values[index] for name, values in others.items()}
        fields = {name: value for name, value in fields.items() if value is not None}
        try:
            generation = _generation(fields, {column.name: column.ids(index) for column in ids})
        except ValidationError as error:
            message = str(error)[:MAX_MESSAGE_CHARS]
            yield _rejected(batch, index, position, classify(error), message)
            continue
        yield SourceRecord(position, generation)


def _generation(fields: dict[str, Any], ids: dict[str, list[int]]) -> LoggedGeneration:
    """The row's generation, its ids already checked by `_IdColumn`.

    Without logprobs, the model checks every field but the ids: validating them again element by
    element, as Python ints, cost more than parsing the same row from JSON. Logprobs are checked
    against the ids (one entry per id), so a row with them is validated whole.
    """
    if "output_logprobs" in fields or "output_top_logprobs" in fields:
        if "output_top_logprobs" in fields:
            fields["output_top_logprobs"] = _pairs(fields["output_top_logprobs"])
        return LoggedGeneration.model_validate({**fields, **ids})
    return LoggedGeneration.model_validate({**fields, **NO_IDS}).model_copy(update=ids)


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
        self.any_problem = self.null_rows | self.null_id_rows | self.bad_id_rows

    def problem(self, index: int) -> tuple[DeadLetterReason, str] | None:
        if self.type_error is not None:
            return DeadLetterReason.SCHEMA_VIOLATION, self.type_error
        if not self.any_problem[index]:
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
        return self.flat[self.offsets[index] : self.offsets[index + 1]].tolist()


def _rows_with(flags: Any, offsets: Any, np: Any) -> Any:
    """Per row, whether any of its elements is flagged (offsets[i]..offsets[i+1])."""
    running = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    return running[offsets[1:]] - running[offsets[:-1]] > 0


def _rejected(
    batch: Any, index: int, position: Position, reason: DeadLetterReason, message: str
) -> SourceRecord:
    row = batch.slice(index, 1).to_pylist()[0]
    raw = json.dumps(row, ensure_ascii=False, default=repr).encode()
    return SourceRecord(position, Rejection(reason, BadRow.__name__, message), raw)


def _completion_schema() -> Any:
    """`Completion`'s fields as typed columns; logprobs nest as OpenAI's `content` list."""
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
    return pa.schema(
        [
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
    )


class ParquetCompletions:
    """Completions as Parquet rows, one per request, written a row group at a time as they
    arrive: the columns are `Completion`'s fields (all but the constant `type`)."""

    def __init__(self, path: Path) -> None:
        _, pq, _ = _arrow()
        self._schema = _completion_schema()
        self._writer = pq.ParquetWriter(path, self._schema)
        self._rows: list[dict[str, Any]] = []

    def write(self, completion: Completion | None, failure: RequestFailure | None) -> None:
        if completion is not None:
            self._rows.append(completion.model_dump(exclude={"type"}))
            if len(self._rows) >= WRITE_ROW_GROUP_ROWS:
                self._flush()

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def _flush(self) -> None:
        if self._rows:
            pa, _, _ = _arrow()
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []


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
