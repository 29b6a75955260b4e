"""Formats benchmark: Parquet against JSONL on the same logged generations, in one run.

Two figures per format, both over the same workload (real-tokenizer generations from
`bench.workload`), written once as JSONL and once as Parquet:
  (read) the reader alone, records/s and ids/s: file -> `SourceRecord`s, what the format costs;
  (run)  `detok run` end to end in a subprocess: wall time, requests/s and peak RSS.
Repeats rotate the order and report medians; ratios are medians of per-repeat ratios, so both
sides of a ratio ran under the same load. No timing is asserted anywhere.

`--compare-with TREE` also runs (run) on the JSONL file with another checkout's code (e.g. a
`git worktree add /tmp/base <commit>` from before the formats seam): before/after in one run.

    python -m bench.bench_formats [--shared-dir ../shared] [--tokenizer gpt2] [--requests 2000]
                                  [--repeats 3] [--compare-with /tmp/base] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.peak_rss import run_with_peak_rss
from bench.workload import generations
from pipeline.records import SourceRecord
from workers.formats.jsonl import jsonl_records
from workers.formats.parquet import parquet_records, write_generations

REPO = Path(__file__).resolve().parents[1]


def read_all(records: Callable[[], Iterator[SourceRecord]]) -> tuple[float, int]:
    """Seconds to read every record, and the ids they hold."""
    started = time.perf_counter()
    ids = 0
    for record in records():
        parsed = record.parsed
        ids += len(parsed.prompt_token_ids) + len(parsed.output_token_ids)  # type: ignore[union-attr]
    return time.perf_counter() - started, ids


def detok_run(tree: Path, spec: str, source: Path, output: Path) -> tuple[float, int]:
    """Seconds and peak RSS (bytes) of `detok run` from `tree`'s code."""
    started = time.perf_counter()
    code, peak = run_with_peak_rss(
        [sys.executable, "-m", "workers.cli", "run", "--tokenizer", spec,
         "--input", str(source), "--output", str(output)],
        cwd=tree, log=output.with_suffix(".log"), env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    if code != 0:
        raise SystemExit(f"detok run from {tree} on {source} failed")
    return time.perf_counter() - started, peak


def check_tree(tree: Path) -> None:
    """The subprocess really runs `tree`'s code, not this checkout's editable install."""
    found = subprocess.run(
        [sys.executable, "-c", "import workers; print(workers.__file__)"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"--compare-with {tree}: its workers package was not the one loaded")


def check_equal(outputs: list[Path]) -> None:
    """Every run gave the same completions (on the fields they all write: another tree's
    Completion may have fewer)."""
    parsed = [[json.loads(line) for line in path.read_text().splitlines()] for path in outputs]
    for rows in zip(*parsed, strict=True):
        shared = set.intersection(*(set(row) for row in rows))
        if len({json.dumps({k: row[k] for k in sorted(shared)}) for row in rows}) != 1:
            raise SystemExit(f"the runs' completions differ for {rows[0]['request_id']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared-dir", type=Path, default=REPO.parent / "shared", help="real tokenizers' home"
    )
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-with", type=Path, metavar="TREE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tokenizer_path = args.shared_dir / "tokenizers" / args.tokenizer / "tokenizer.json"
    spec = f"{args.tokenizer}={tokenizer_path}"
    rows = generations(Tokenizer.from_file(str(tokenizer_path)), model=args.tokenizer,
                       requests=args.requests)  # fmt: skip
    if args.compare_with is not None:
        check_tree(args.compare_with)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        jsonl, parquet = work / "in.jsonl", work / "in.parquet"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        write_generations(parquet, iter(rows))
        readers: dict[str, Callable[[], Iterator[SourceRecord]]] = {
            "jsonl": lambda: jsonl_records(jsonl.open("rb")),
            "parquet": lambda: parquet_records(parquet),
        }
        runs = {"jsonl": (REPO, jsonl), "parquet": (REPO, parquet)}
        if args.compare_with is not None:
            runs["jsonl@base"] = (args.compare_with, jsonl)
        for records in readers.values():  # imports and first-touch outside the timings
            read_all(records)
        read_s: dict[str, list[float]] = {name: [] for name in readers}
        run_s: dict[str, list[float]] = {name: [] for name in runs}
        rss: dict[str, list[int]] = {name: [] for name in runs}
        ids = 0
        for repeat in range(args.repeats):
            order = list(readers)[repeat % 2 :] + list(readers)[: repeat % 2]
            for name in order:
                seconds, ids = read_all(readers[name])
                read_s[name].append(seconds)
            names = list(runs)
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                tree, source = runs[name]
                seconds, peak = detok_run(tree, spec, source, work / f"out-{name}.jsonl")
                run_s[name].append(seconds)
                rss[name].append(peak)
        check_equal([work / f"out-{name}.jsonl" for name in runs])
        sizes = {"jsonl": jsonl.stat().st_size, "parquet": parquet.stat().st_size}
    report = summarize(args, ids, sizes, read_s, run_s, rss)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


def ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def summarize(
    args: argparse.Namespace,
    ids: int,
    sizes: dict[str, int],
    read_s: dict[str, list[float]],
    run_s: dict[str, list[float]],
    rss: dict[str, list[int]],
) -> dict[str, Any]:
    return {
        "tokenizer": args.tokenizer,
        "requests": args.requests,
        "ids": ids,
        "file_bytes": sizes,
        "read": {
            name: {
                "seconds": statistics.median(times),
                "records_per_s": args.requests / statistics.median(times),
                "ids_per_s": ids / statistics.median(times),
            }
            for name, times in read_s.items()
        },
        "run": {
            name: {
                "seconds": statistics.median(times),
                "requests_per_s": args.requests / statistics.median(times),
                "peak_rss_mib": max(rss[name]) / 2**20,
            }
            for name, times in run_s.items()
        },
        # > 1: Parquet is faster (median of per-repeat JSONL time / Parquet time).
        "parquet_speedup_read": ratio(read_s["jsonl"], read_s["parquet"]),
        "parquet_speedup_run": ratio(run_s["jsonl"], run_s["parquet"]),
        **(
            {"jsonl_speedup_vs_base": ratio(run_s["jsonl@base"], run_s["jsonl"])}
            if "jsonl@base" in run_s
            else {}
        ),
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['tokenizer']}: {report['requests']} requests, {report['ids']:,} ids; "
        f"files: JSONL {report['file_bytes']['jsonl'] / 2**20:.1f} MiB, "
        f"Parquet {report['file_bytes']['parquet'] / 2**20:.1f} MiB"
    )
    for name, figures in report["read"].items():
        print(
            f"  read {name:<8} {figures['records_per_s']:>10,.0f} records/s "
            f"{figures['ids_per_s'] / 1e6:>7.2f} M ids/s"
        )
    for name, figures in report["run"].items():
        print(
            f"  run  {name:<10} {figures['seconds']:>6.2f} s {figures['requests_per_s']:>8,.0f} "
            f"requests/s  peak RSS {figures['peak_rss_mib']:.0f} MiB"
        )
    print(
        f"  Parquet vs JSONL (time ratio, > 1 = Parquet faster): read "
        f"{report['parquet_speedup_read']:.2f}x, detok run {report['parquet_speedup_run']:.2f}x"
    )
    if "jsonl_speedup_vs_base" in report:
        print(
            f"  JSONL detok run, this tree vs --compare-with (> 1 = faster): "
            f"{report['jsonl_speedup_vs_base']:.2f}x"
        )


if __name__ == "__main__":
    main()
