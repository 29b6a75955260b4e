"""`detok follow REQUEST_ID`: one request's text, live, as the workers commit it."""

from __future__ import annotations

import argparse
import json
import sys

from workers.commands import failures
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    positive_float,
    topic_names_from,
)
from workers.io.follow import follow


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "follow",
        help="print one request's text live as workers commit it, until its completion",
        description="Read the deltas and completions topics (read_committed) from their start "
        "and print the request's text as it is committed, each delta placed by its offset (a "
        "replayed delta never shows twice). Exits 0 at an ok completion, 1 at a failed one "
        "(its error on stderr), at --timeout, or on a Kafka error.",
    )
    add_connection_options(parser)
    add_topic_options(parser, ("deltas", "completions"))
    parser.add_argument("request_id", metavar="REQUEST_ID")
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object a line: {"request_id", "text_offset", "text"} per update, the '
        'last with "completion"',
    )
    parser.add_argument(
        "--timeout", type=positive_float, metavar="S",
        help="give up after this many seconds without a record on either topic (default: wait)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        updates = follow(
            connection_from(args),
            topic_names_from(args),
            args.request_id,
            idle_timeout_s=args.timeout,
        )
        for update in updates:
            if args.json:
                line = {"request_id": update.request_id, "text_offset": update.text_offset,
                        "text": update.text}  # fmt: skip
                if update.completion is not None:
                    line["completion"] = json.loads(update.completion.model_dump_json())
                print(json.dumps(line, ensure_ascii=False), flush=True)
            else:
                print(update.text, end="", flush=True)
            if update.completion is not None:
                return _ended(args, update.completion.status, update.completion.error)
    except failures.KAFKA_FAILURES as error:
        return failures.report("follow", error)
    print(f"detok follow: no completion of {args.request_id!r} before --timeout", file=sys.stderr)
    return 1


def _ended(args: argparse.Namespace, status: str, error: str | None) -> int:
    if not args.json:
        print(flush=True)
    if status != "ok":
        print(f"detok follow: request {args.request_id!r} failed: {error}", file=sys.stderr)
        return 1
    return 0
