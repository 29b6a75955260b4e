"""Stop strings at the documented bounds: the stop path's CPU against the no-stop path's.

Issue 32 (item 7): 64 stop strings of up to 1,024 characters cost a `detok run --chunk-size 1`
of 2,000 tokens 38-46 s against 0.4-0.5 s without them. The requests here go through the whole
`RequestProcessor` (sequencing, decode, deltas encoded as the worker writes them, completions)
one id per event, as that run and a worker streaming token by token feed it, with and without
the stop list; no stop ever completes, so both give the same completions (checked):

  grouped   63 strings of 1,024 characters in two groups sharing a 1,023-character run of one
            letter (each group's strings end differently), and one of one character. The text
            is runs of 1,022 of each letter in turn, so the held-back tail stays near 1,022
            characters and is a prefix of 32 strings: the case that was quadratic (a search of
            `held + new` compared every string at every position of the tail), the short string
            keeping a search from skipping texts shorter than every string.
  distinct  64 strings of 1,024 random letters and digits with different first characters
            (no shared prefix at all); the text follows one string for 1,000 characters, then
            another: a long tail throughout.

Rows: one request of `--tokens` tokens, and `--streams` concurrent requests of
`--stream-tokens` each (one event of every stream per processor batch). Figures are CPU seconds
(`time.process_time`, gc off), medians of `--repeats` in rotating order; the ratio is stops to
no stops, paired per repeat (target: at most 2). Each stop list's matcher is built before the
timings (once per list, cached across requests) and its build timed on its own.
`--compare-with TREE` also times the stop rows on another checkout's `pipeline` (e.g. main
before the change) once each: before/after in one run. No timing is asserted anywhere.

    python -m bench.bench_stops [--shared-dir ../shared] [--compare-with /work/main] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.bench_core import load_pipeline, method_processor, paired_ratio, processor_rounds, timed
from pipeline.stop_strings import StopMatcher, matcher_for
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import MAX_STOP_CHARS, MAX_STOP_STRINGS

TARGET_RATIO = 2.0


def grouped_workload() -> tuple[list[str], str]:
    """Two groups of stops sharing a long run, one short stop; runs that never complete one."""
    group = MAX_STOP_STRINGS // 2
    ends = (string.ascii_lowercase + string.digits)[:group]
    stops = ["Z"] + [letter * (MAX_STOP_CHARS - 1) + end for letter in "AB" for end in ends][
        : MAX_STOP_STRINGS - 1
    ]
    text = "".join(letter * (MAX_STOP_CHARS - 2) for letter in "AB" * 32)
    return stops, text


def distinct_workload() -> tuple[list[str], str]:
    """Stops with different first characters; a text that follows one, then another."""
    rng = random.Random(32)
    alphabet = string.ascii_letters + string.digits + "!?"
    stops = [
        first + "".join(rng.choice(alphabet) for _ in range(MAX_STOP_CHARS - 1))
        for first in alphabet[:MAX_STOP_STRINGS]
    ]
    text = "".join(rng.choice(stops)[:1000] for _ in range(64))
    return stops, text


WORKLOADS: dict[str, Callable[[], tuple[list[str], str]]] = {
    "grouped": grouped_workload,
    "distinct": distinct_workload,
}


def requests_of(tok: Tokenizer, text: str, count: int, tokens: int) -> list[dict[str, Any]]:
    ids = tok.encode(text).ids[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the workload text has {len(ids)} tokens, fewer than {tokens}")
    prompt = tok.encode("Repeat after me:").ids
    return [
        {"prompt_token_ids": prompt, "output_token_ids": ids, "skip_special_tokens": True}
        for _ in range(count)
    ]


def bench_workload(
    registry: TokenizerRegistry,
    tok: Tokenizer,
    name: str,
    args: argparse.Namespace,
    base_processor: Any,
) -> list[dict[str, Any]]:
    stops, text = WORKLOADS[name]()
    # A stop list's matcher is built once for all its requests (and cached): built here, outside
    # the timings, and its build timed on its own.
    build, _ = timed(lambda: [StopMatcher(stops)], time.process_time)
    matcher_for(stops)
    if base_processor is not None:
        base_processor.__init__.__globals__["matcher_for"](stops)
    rows = []
    for count, tokens in ((1, args.tokens), (args.streams, args.stream_tokens)):
        reqs = requests_of(tok, text, count, tokens)
        plain = processor_rounds(reqs, count, None, False, chunk=1)
        stopped = processor_rounds(reqs, count, stops, False, chunk=1)
        methods = {
            "plain": lambda p=plain, n=count: method_processor(registry, p, n),
            "stops": lambda s=stopped, n=count: method_processor(registry, s, n),
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        outputs: dict[str, list[str]] = {}
        order = list(methods)
        for rep in range(args.repeats):
            for key in order[rep % 2 :] + order[: rep % 2]:
                seconds, outputs[key] = timed(methods[key], time.process_time)
                times[key].append(seconds)
        row = {
            "workload": name,
            "matcher_build_cpu_s": build,
            "requests": count,
            "tokens_each": tokens,
            "plain_cpu_s": statistics.median(times["plain"]),
            "stops_cpu_s": statistics.median(times["stops"]),
            "ratio": paired_ratio(times["stops"], times["plain"]),
            "mismatches": sum(
                x != y for x, y in zip(outputs["plain"], outputs["stops"], strict=True)
            ),
        }
        if base_processor is not None:
            seconds, before = timed(
                lambda s=stopped, n=count: method_processor(registry, s, n, base_processor),
                time.process_time,
            )
            row["before_stops_cpu_s"] = seconds
            row["mismatches_before"] = sum(
                x != y for x, y in zip(before, outputs["stops"], strict=True)
            )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared-dir", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared"
    )
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="TREE",
        help="another checkout whose processor's stop rows are timed once in the same run",
    )
    args = parser.parse_args()
    path = args.shared_dir / "tokenizers" / args.tokenizer / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    registry = TokenizerRegistry()
    registry.register("m", path)
    base = None if args.compare_with is None else load_pipeline(args.compare_with)[2]
    rows = [
        row
        for name in args.workloads.split(",")
        for row in bench_workload(registry, tok, name, args, base)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{args.tokenizer}, one id per event, CPU seconds (median of {args.repeats}); "
        f"{MAX_STOP_STRINGS} stop strings of up to {MAX_STOP_CHARS:,} characters"
    )
    before = " | stops, --compare-with tree (1 run)" if base is not None else ""
    print(f"| workload | requests x tokens | no stops | stops | stops / no stops{before} |")
    print("|---|---|---:|---:|---:|" + ("---:|" if base is not None else ""))
    for row in rows:
        line = (
            f"| {row['workload']} | {row['requests']} x {row['tokens_each']:,} | "
            f"{row['plain_cpu_s']:.3f} | {row['stops_cpu_s']:.3f} | {row['ratio']:.2f} |"
        )
        if "before_stops_cpu_s" in row:
            line += f" {row['before_stops_cpu_s']:.3f} |"
        print(line)
    builds = {row["workload"]: row["matcher_build_cpu_s"] for row in rows}
    print(
        "matcher builds (once per stop list, outside the rows): "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in builds.items())
    )
    worst = max(row["ratio"] for row in rows)
    mismatches = sum(row["mismatches"] + row.get("mismatches_before", 0) for row in rows)
    print(
        f"worst stops / no stops {worst:.2f} (target <= {TARGET_RATIO}: "
        f"{'met' if worst <= TARGET_RATIO else 'NOT met'}); completion mismatches: {mismatches}"
    )


if __name__ == "__main__":
    main()
