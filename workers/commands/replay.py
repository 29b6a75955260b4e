"""`detok replay`: logged generations (the input of `detok run`, in any of its formats) as events
onto the input topic."""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.generations import DEFAULT_CHUNK_SIZE
from workers.commands import failures
from workers.commands.format_options import add_format_options
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    positive_float,
    positive_int,
    readable_file,
    topic_names_from,
)
from workers.formats import INPUT_FORMATS
from workers.formats.base import FormatError
from workers.io.replay import replay


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="produce logged generations (detok run input) as events to the input topic",
        description="Cut each logged generation into the events an inference server sends and "
        "produce them, keyed by request id. Exits 1, with a count, if any event was not "
        "delivered (a missing topic, a record over the topic's max.message.bytes).",
    )
    add_connection_options(parser)
    add_topic_options(parser, ("input",), topic_alias=True)
    parser.add_argument(
        "--input",
        required=True,
        type=readable_file,
        metavar="FILE",
        help="logged generations (.jsonl, .parquet, or an OpenAI batch output file with token "
        "ids: --input-format openai-batch)",
    )
    add_format_options(parser, input_formats=INPUT_FORMATS)
    parser.add_argument(
        "--chunk-size", type=positive_int, default=DEFAULT_CHUNK_SIZE, metavar="N",
        help="generated ids per tokens event",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=positive_float, help="events per second (default: as fast as possible)"
    )
    parser.add_argument(
        "--prompt-tail", type=positive_int, metavar="N",
        help="send only the last N prompt ids, with the full count in prompt_tokens (64 or "
        "more decodes exactly as the whole prompt; default: whole prompts, except one over "
        "the topic's max.message.bytes, sent as its last 64 ids)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Prompts sent as tails because they would pass the record limit are logged (stderr).
    logging.basicConfig(level=logging.INFO, format="detok replay: %(message)s")
    topic = topic_names_from(args).input
    connection = None
    try:
        connection = connection_from(args)
        totals = replay(
            connection,
            args.input,
            topic,
            input_format=args.input_format,
            chunk_size=args.chunk_size,
            rate=args.rate,
            progress=sys.stderr.isatty(),
            prompt_tail=args.prompt_tail,
        )
    except failures.KAFKA_FAILURES as error:
        return failures.report("replay", error, connection)
    except (OSError, FormatError) as error:
        print(f"detok replay: {error}", file=sys.stderr)
        return 2
    print(
        f"replayed {totals.requests} requests as {totals.events} events "
        f"({totals.invalid_records} invalid records passed through) to {topic}"
    )
    return 0
