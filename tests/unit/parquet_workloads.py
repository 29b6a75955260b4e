"""Large Parquet inputs built column-wise, fast: a million rows in a few seconds, without Python
lists of ids (the test measures `detok run`'s memory, not the fixture's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Printable ASCII: every id decodes to one character under the byte-level test tokenizer.
FIRST_ID, LAST_ID = 32, 126


def write_many_generations(
    path: Path,
    requests: int,
    *,
    model: str = "bytes",
    prompt_ids: int = 8,
    output_ids: int = 24,
    rows_per_group: int = 65_536,
    seed: int = 0,
) -> Path:
    """`requests` rows of `prompt_ids` + `output_ids` random printable byte ids each."""
    rng = np.random.default_rng(seed)
    with pq.ParquetWriter(path, _schema()) as writer:
        for start in range(0, requests, rows_per_group):
            count = min(rows_per_group, requests - start)
            writer.write_table(
                pa.table(
                    {
                        "request_id": pa.array([f"r{i:07d}" for i in range(start, start + count)]),
                        "model": pa.array([model] * count),
                        "prompt_token_ids": _lists(rng, count, prompt_ids),
                        "output_token_ids": _lists(rng, count, output_ids),
                    },
                    schema=_schema(),
                )
            )
    return path


def _schema() -> pa.Schema:
    return pa.schema(
        [
            ("request_id", pa.string()),
            ("model", pa.string()),
            ("prompt_token_ids", pa.list_(pa.uint32())),
            ("output_token_ids", pa.list_(pa.uint32())),
        ]
    )


def _lists(rng: np.random.Generator, count: int, length: int) -> pa.ListArray:
    values = rng.integers(FIRST_ID, LAST_ID + 1, size=count * length, dtype=np.uint32)
    offsets = np.arange(0, count * length + 1, length, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
