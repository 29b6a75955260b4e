"""`detok collect`: completions from Kafka into a file, in `detok run`'s output formats."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from workers.commands import failures
from workers.commands.format_options import add_format_options
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    positive_float,
    positive_int,
    topic_names_from,
)
from workers.formats import OUTPUT_FORMATS, format_of, require
from workers.formats.base import FormatError
from workers.io.replay import collect, write_completions


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "collect",
        help="read completions into a file (the formats of detok run), by request id",
    )
    add_connection_options(parser)
    add_topic_options(parser, ("completions",), topic_alias=True)
    parser.add_argument("--output", required=True, type=Path, help="completions (.jsonl, .parquet)")
    add_format_options(parser, output_formats=OUTPUT_FORMATS)
    parser.add_argument("--expect", type=positive_int, help="stop after this many completions")
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=10.0,
        help="stop after this many seconds without a new completion",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    topic = topic_names_from(args).completions
    fmt = format_of(args.output, args.output_format)
    try:
        require(fmt)
    except FormatError as error:
        print(f"detok collect: {error}", file=sys.stderr)
        return 2
    connection = None
    try:
        connection = connection_from(args)
        collected = collect(connection, topic, expect=args.expect, idle_timeout_s=args.timeout)
    except failures.KAFKA_FAILURES as error:
        return failures.report("collect", error, connection)
    try:
        refused = write_completions(
            args.output, collected.completions, fmt, created=int(time.time())
        )
    except (OSError, FormatError) as error:
        print(f"detok collect: {error}", file=sys.stderr)
        return 2
    for failure in refused:
        print(f"detok collect: request {failure.request_id}: {failure.message}", file=sys.stderr)
    written = len(collected.completions) - len(refused)
    skipped = [
        f"{count} {what}"
        for count, what in (
            (collected.tombstones, "tombstones"),
            (collected.invalid, "records that are not completions"),
            (len(refused), f"completions {fmt} cannot hold"),
        )
        if count
    ]
    print(
        f"collected {written} completions -> {args.output}"
        + (f" (skipped {', '.join(skipped)})" if skipped else "")
    )
    if args.expect is not None and written < args.expect:
        print(f"detok collect: expected {args.expect}", file=sys.stderr)
        return 1
    return 0
