"""A Parquet file of a million requests streams through `detok run` in bounded memory.

The bound is what the readers and writers promise: the input is read a record batch at a time and
the output written a row group at a time, so peak memory is the interpreter, the tokenizer, one
batch, one decode window and the set of request ids seen (kept to refuse duplicates, ~100 bytes a
request) — not the file. 1 GB is far above that and far below a million requests held at once.
The run's time is printed, never asserted; `bench/bench_formats.py` measures throughput.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.peak_rss import run_with_peak_rss
from tests.conftest import REPO_ROOT
from tests.unit.parquet_workloads import write_many_generations
from tests.unit.small_tokenizers import byte_level

REQUESTS = 1_000_000
RSS_BOUND_BYTES = 1024**3


@pytest.mark.slow
def test_a_million_request_parquet_file_streams_through_detok_run_under_1_gb(
    tmp_path: Path,
) -> None:
    source = write_many_generations(tmp_path / "million.parquet", REQUESTS, prompt_ids=4,
                                    output_ids=8)  # fmt: skip
    tokenizer = tmp_path / "bytes.json"
    byte_level().save(str(tokenizer))
    output, log = tmp_path / "out.parquet", tmp_path / "run.log"
    started = time.monotonic()
    code, peak = run_with_peak_rss(
        [sys.executable, "-m", "workers.cli", "run", "--tokenizer", f"bytes={tokenizer}",
         "--input", str(source), "--output", str(output)],
        cwd=REPO_ROOT, log=log,
    )  # fmt: skip
    stderr = log.read_text(errors="replace")
    print(
        f"\n{REQUESTS:,} requests from Parquet: peak RSS {peak / 2**20:.0f} MiB, "
        f"{time.monotonic() - started:.0f} s"
    )
    assert code == 0, stderr[-2000:]
    assert f"{REQUESTS} completions (0 failed), 0 dead letters" in stderr
    assert pq.ParquetFile(output).metadata.num_rows == REQUESTS
    assert peak < RSS_BOUND_BYTES
