"""`detok run`: decode a file of logged generations offline, with the worker's processor.

The decoding is `pipeline.offline.run_generations`, the formats `workers.formats`; this module
owns the files. Two rules keep a run from destroying data:

- The input, the output and the dead-letter file must be three different files (compared as
  resolved paths and, when they exist, as the same inode). Writing one path that is also read
  would truncate the input before it is read; two outputs on one path would interleave or lose
  records. Such a run is refused as a usage error before anything is opened.
- Outputs are written to temporary files beside their targets and renamed over them only once the
  whole input is decoded, so an interrupted run leaves every existing file as it was. An output
  that is not a regular file (`/dev/null`, `/dev/stdout` on a pipe, a FIFO) is written in place:
  a rename would replace the device node or the FIFO itself.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pipeline.generations import DEFAULT_CHUNK_SIZE
from pipeline.offline import Outcome, run_generations
from pipeline.tokenizer_registry import TokenizerSpecError
from schemas.events import DeadLetterReason, DeadLetterRecord
from workers.commands.format_options import add_format_options
from workers.commands.options import (
    add_chat_parser_options,
    add_tokenizer_options,
    chat_parsers_from,
    positive_int,
    readable_file,
    registry_from,
)
from workers.formats import (
    INPUT_FORMATS,
    OUTPUT_FORMATS,
    completion_writer,
    format_of,
    reading,
    replacing,
)
from workers.formats.base import CompletionWriter, FormatError, RequestFailure

DEAD_LETTER_SUFFIX = ".dead-letters.jsonl"


class PathConflict(ValueError):
    """Two of a run's files are one file, or a file the run needs has no place."""


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="decode logged generations from a JSONL or Parquet file (no Kafka)",
        description="Decode logged generations (request_id, model, prompt_token_ids, "
        "output_token_ids, optional skip_special_tokens and finish_reason: one JSON object per "
        "line, or one Parquet row) into completions, one per request, in input order.",
    )
    add_tokenizer_options(parser)
    add_chat_parser_options(parser)
    parser.add_argument(
        "--input", required=True, type=readable_file, help="logged generations (.jsonl, .parquet)"
    )
    parser.add_argument("--output", required=True, type=Path, help="completions (.jsonl, .parquet)")
    add_format_options(parser, input_formats=INPUT_FORMATS, output_formats=OUTPUT_FORMATS)
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
        help=f"where rejected records go, as JSONL (default: OUTPUT with {DEAD_LETTER_SUFFIX})",
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


def default_dead_letter(output: Path) -> Path:
    """The dead-letter file beside a file output. A device or a FIFO has no "beside" (the file
    would go into /dev, or fail there): such a run must name its dead-letter file."""
    if _kind(output) not in (None, stat.S_IFREG, stat.S_IFDIR):
        raise PathConflict(
            f"--output {output} is not a regular file: name the dead-letter file with "
            "--dead-letter FILE (/dev/null discards them)"
        )
    return output.with_suffix(DEAD_LETTER_SUFFIX)


def _kind(path: Path) -> int | None:
    """The file type of an existing path (`stat.S_IFMT`), None when there is none."""
    try:
        return stat.S_IFMT(path.stat().st_mode)
    except OSError:
        return None


def _same_file(first: Path, second: Path) -> bool:
    if _kind(first) == _kind(second) == stat.S_IFCHR:
        # /dev/null for both outputs, or the terminal: nothing is truncated or read back.
        return False
    if first.resolve() == second.resolve():
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist yet: then they differ
        return False


def run(args: argparse.Namespace) -> int:
    try:
        # Before the tokenizers load: an unknown parser or model costs no loading time.
        chat_parsers = chat_parsers_from(args.reasoning_parsers, args.tool_parsers, args.tokenizers)
        registry = registry_from(args)
    except (ValueError, TokenizerSpecError) as error:  # UnknownParserError is a ValueError
        print(f"detok run: {error}", file=sys.stderr)
        return 2
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    try:
        dead_letter_path = args.dead_letter or default_dead_letter(args.output)
        check_distinct(args.input, args.output, dead_letter_path)
    except PathConflict as error:
        print(f"detok run: {error}", file=sys.stderr)
        return 2
    input_format = format_of(args.input, args.input_format)
    output_format = format_of(args.output, args.output_format)
    try:
        with (
            reading(args.input, input_format, progress="detok run") as records,
            replacing(args.output) as output_file,
            replacing(dead_letter_path) as dead_letter_file,
            dead_letter_file.open_text() as dead_letters,
        ):
            outcomes = run_generations(
                records,
                registry,
                source=str(args.input),
                chunk_size=args.chunk_size,
                chat_parsers=chat_parsers,
            )
            output = completion_writer(
                output_file, output_format, created=int(time.time()), chat=bool(chat_parsers)
            )
            try:
                totals = _write(outcomes, output, dead_letters)
            finally:
                output.close()
            _refused(output.refused, totals, dead_letters)
    except (OSError, FormatError) as error:
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
        # Every record was rejected. Exit 0 would let a script go on as if something had been
        # decoded; when no record even parsed, the file is most likely in another format.
        unparsed = totals["dl:malformed_json"] + totals["dl:schema_violation"]
        hint = (
            f"; is it a {input_format} file of logged generations (--input-format)?"
            if unparsed == totals["dead_letters"]
            else ""
        )
        print(f"detok run: no record of {args.input} gave a completion{hint}", file=sys.stderr)
        return 1
    return 0


def _write(outcomes: Iterator[Outcome], output: CompletionWriter, dead_letters: TextIO) -> Counter:
    totals: Counter = Counter(completions=0, failed=0, dead_letters=0)
    for outcome in outcomes:
        completion, letter = outcome.completion, outcome.dead_letter
        if completion is not None:
            totals["completions"] += 1
            totals["failed"] += completion.status == "failed"
        failure = None
        if letter is not None:
            record = DeadLetterRecord(
                reason=letter.reason,
                error_class=letter.error_class,
                error=letter.message,
                line=outcome.position.line,
                row=outcome.position.row,
                request_id=letter.request_id,
                seq=letter.seq,
                original=(letter.value or b"").decode("utf-8", errors="replace"),
            )
            dead_letters.write(record.model_dump_json() + "\n")
            totals["dead_letters"] += 1
            totals[f"dl:{letter.reason.value}"] += 1
            if letter.request_id is not None:
                failure = RequestFailure(letter.request_id, letter.reason.value, letter.message)
        output.write(completion, failure)
    return totals


def _refused(refused: list[RequestFailure], totals: Counter, dead_letters: TextIO) -> None:
    """A completion the output format could not hold is a dead letter naming its request, not
    a completion: no request is left out of both files."""
    for failure in refused:
        record = DeadLetterRecord(
            reason=DeadLetterReason(failure.code),
            error_class="UnwritableCompletion",
            error=failure.message,
            request_id=failure.request_id,
            original="",
        )
        dead_letters.write(record.model_dump_json() + "\n")
        totals["completions"] -= 1
        totals["dead_letters"] += 1
        totals[f"dl:{failure.code}"] += 1
