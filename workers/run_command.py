"""`detok run`: decode a JSONL file of logged generations offline, with the worker's processor."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from pipeline.generations import DEFAULT_CHUNK_SIZE
from pipeline.offline import LineOutcome, run_generations
from pipeline.tokenizer_registry import (
    TokenizerRegistry,
    TokenizerSpecError,
    parse_vocab_size_specs,
)
from schemas.events import DeadLetterRecord

# Inputs smaller than this finish before a progress bar would tell anyone anything.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--tokenizer MODEL=PATH` options shared by every command that decodes."""
    parser.add_argument(
        "--tokenizer",
        action="append",
        required=True,
        metavar="MODEL=PATH",
        help="a model name and its tokenizer.json or model folder (repeatable)",
    )
    parser.add_argument(
        "--model-vocab-size",
        action="append",
        default=[],
        metavar="MODEL=N",
        help="the model's embedding size when larger than the tokenizer's vocabulary "
        "(prompt ids below it are tolerated; ids at or above it are out of range)",
    )


def registry_from_args(args: argparse.Namespace) -> TokenizerRegistry:
    return TokenizerRegistry.from_specs(
        args.tokenizer, parse_vocab_size_specs(args.model_vocab_size)
    )


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="decode logged generations from a JSONL file (no Kafka)",
        description="Decode logged generations (one JSON object per line: request_id, model, "
        "prompt_token_ids, output_token_ids, optional skip_special_tokens and finish_reason) "
        "into completions, one per request, in input order.",
    )
    add_tokenizer_arguments(parser)
    parser.add_argument("--input", required=True, type=Path, help="logged generations (JSONL)")
    parser.add_argument("--output", required=True, type=Path, help="completions (JSONL)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        metavar="N",
        help="generated ids per decode step, as a worker would receive them",
    )
    parser.add_argument(
        "--dead-letter",
        type=Path,
        metavar="FILE",
        help="where rejected lines go (default: OUTPUT with .dead-letters.jsonl)",
    )
    parser.set_defaults(func=run)


def _lines(handle: BinaryIO, progress: tqdm | None) -> Iterator[bytes]:
    for line in handle:
        if progress is not None:
            progress.update(len(line))
        yield line


def run(args: argparse.Namespace) -> int:
    if args.chunk_size < 1:
        print("detok run: --chunk-size must be >= 1", file=sys.stderr)
        return 2
    try:
        registry = registry_from_args(args)
    except TokenizerSpecError as error:
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    dead_letter_path = args.dead_letter or args.output.with_suffix(".dead-letters.jsonl")
    try:
        size = args.input.stat().st_size
        with (
            args.input.open("rb") as source,
            args.output.open("w", encoding="utf-8") as output,
            dead_letter_path.open("w", encoding="utf-8") as dead_letters,
        ):
            progress = (
                tqdm(total=size, unit="B", unit_scale=True, desc="detok run", file=sys.stderr)
                if size >= PROGRESS_MIN_BYTES
                else None
            )
            outcomes = run_generations(
                _lines(source, progress),
                registry,
                source=str(args.input),
                chunk_size=args.chunk_size,
            )
            totals = _write(outcomes, output, dead_letters)
            if progress is not None:
                progress.close()
    except OSError as error:
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(totals.items()) if k.startswith("dl:"))
    print(
        f"detok run: {totals['completions']} completions ({totals['failed']} failed), "
        f"{totals['dead_letters']} dead letters{' (' + reasons + ')' if reasons else ''} "
        f"-> {args.output}, {dead_letter_path}",
        file=sys.stderr,
    )
    return 0


def _write(outcomes: Iterator[LineOutcome], output, dead_letters) -> Counter:
    totals: Counter = Counter(completions=0, failed=0, dead_letters=0)
    for outcome in outcomes:
        if outcome.completion is not None:
            output.write(outcome.completion.model_dump_json() + "\n")
            totals["completions"] += 1
            totals["failed"] += outcome.completion.status == "failed"
        letter = outcome.dead_letter
        if letter is not None:
            record = DeadLetterRecord(
                reason=letter.reason,
                error_class=letter.error_class,
                error=letter.message,
                line=outcome.line,
                request_id=letter.request_id,
                seq=letter.seq,
                original=letter.value.decode("utf-8", errors="replace"),
            )
            dead_letters.write(record.model_dump_json() + "\n")
            totals["dead_letters"] += 1
            totals[f"dl:{letter.reason.value}"] += 1
    return totals
