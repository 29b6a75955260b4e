"""`detok run`: decode a JSONL file of logged generations offline, with the worker's processor.

The decoding is `pipeline.offline.run_generations`; this module owns the files. Two rules keep a
run from destroying data:

- The input, the output and the dead-letter file must be three different files (compared as
  resolved paths and, when they exist, as the same inode). Writing one path that is also read
  would truncate the input before it is read; two outputs on one path would interleave or lose
  records. Such a run is refused as a usage error before anything is opened.
- Outputs are written to temporary files beside their targets and renamed over them only once the
  whole input is decoded, so an interrupted run leaves every existing file as it was.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO

from tqdm import tqdm

from pipeline.generations import DEFAULT_CHUNK_SIZE
from pipeline.offline import LineOutcome, run_generations
from pipeline.tokenizer_registry import TokenizerSpecError
from schemas.events import DeadLetterRecord
from workers.commands.options import (
    add_tokenizer_options,
    positive_int,
    readable_file,
    registry_from,
)

# Inputs smaller than this finish before a progress bar would tell anyone anything.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024
DEAD_LETTER_SUFFIX = ".dead-letters.jsonl"


class PathConflict(ValueError):
    """Two of a run's files are one file."""


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="decode logged generations from a JSONL file (no Kafka)",
        description="Decode logged generations (one JSON object per line: request_id, model, "
        "prompt_token_ids, output_token_ids, optional skip_special_tokens and finish_reason) "
        "into completions, one per request, in input order.",
    )
    add_tokenizer_options(parser)
    parser.add_argument(
        "--input", required=True, type=readable_file, help="logged generations (JSONL)"
    )
    parser.add_argument("--output", required=True, type=Path, help="completions (JSONL)")
    parser.add_argument(
        "--chunk-size",
        type=positive_int,
        default=DEFAULT_CHUNK_SIZE,
        metavar="N",
        help="generated ids per decode step, as a worker would receive them",
    )
    parser.add_argument(
        "--dead-letter",
        type=Path,
        metavar="FILE",
        help=f"where rejected lines go (default: OUTPUT with {DEAD_LETTER_SUFFIX})",
    )
    parser.set_defaults(func=run)


def check_distinct(input_path: Path, output: Path, dead_letter: Path) -> None:
    """Raise PathConflict if any two of the run's files are the same file, or an output is a
    directory (found now, not when the finished output is renamed)."""
    for role, path in (("--output", output), ("--dead-letter", dead_letter)):
        if path.is_dir():
            raise PathConflict(f"{role} {path} is a directory")
    roles = {"--input": input_path, "--output": output, "--dead-letter": dead_letter}
    items = list(roles.items())
    for index, (role, path) in enumerate(items):
        for other_role, other in items[index + 1 :]:
            if _same_file(path, other):
                raise PathConflict(
                    f"{role} and {other_role} are the same file ({path}); "
                    "each needs its own path (writing one would destroy the other)"
                )


def _same_file(first: Path, second: Path) -> bool:
    if first.resolve() == second.resolve():
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist yet: then they differ
        return False


def run(args: argparse.Namespace) -> int:
    try:
        registry = registry_from(args)
    except TokenizerSpecError as error:
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    dead_letter_path = args.dead_letter or args.output.with_suffix(DEAD_LETTER_SUFFIX)
    try:
        check_distinct(args.input, args.output, dead_letter_path)
    except PathConflict as error:
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    try:
        size = args.input.stat().st_size
        with (
            args.input.open("rb") as source,
            _replacing(args.output) as output,
            _replacing(dead_letter_path) as dead_letters,
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
    reasons = ", ".join(f"{k[3:]}={v}" for k, v in sorted(totals.items()) if k.startswith("dl:"))
    print(
        f"detok run: {totals['completions']} completions ({totals['failed']} failed), "
        f"{totals['dead_letters']} dead letters{' (' + reasons + ')' if reasons else ''} "
        f"-> {args.output}, {dead_letter_path}",
        file=sys.stderr,
    )
    if totals["completions"] == 0 and totals["dead_letters"] > 0:
        # Every line was rejected. Exit 0 would let a script go on as if something had been
        # decoded; when no line even parsed, the file is most likely not JSONL at all (Parquet).
        unparsed = totals["dl:malformed_json"] + totals["dl:schema_violation"]
        hint = (
            "; is it a JSONL file of logged generations?"
            if unparsed == totals["dead_letters"]
            else ""
        )
        print(f"detok run: no line of {args.input} gave a completion{hint}", file=sys.stderr)
        return 1
    return 0


@contextmanager
def _replacing(path: Path) -> Iterator[TextIO]:
    """A text file that replaces `path` when the block ends cleanly and vanishes on an error.

    The temporary file sits beside `path` (so the rename is atomic on one file system) and is
    created exclusively, with the permissions a plain `open` would give.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("x", encoding="utf-8") as handle:
            yield handle
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _lines(handle: BinaryIO, progress: tqdm | None) -> Iterator[bytes]:
    for line in handle:
        if progress is not None:
            progress.update(len(line))
        yield line


def _write(outcomes: Iterator[LineOutcome], output: TextIO, dead_letters: TextIO) -> Counter:
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
