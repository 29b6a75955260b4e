"""`detok dlq redrive`: dead letters back to the input topic, original key, value and headers."""

from __future__ import annotations

import argparse

from schemas.events import DeadLetterReason
from workers.commands import failures
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    topic_names_from,
)
from workers.kafka.dead_letters import redrive


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dlq", help="inspect and redrive dead letters")
    actions = parser.add_subparsers(dest="dlq_action", required=True, metavar="ACTION")
    redrive_parser = actions.add_parser(
        "redrive",
        help="re-produce dead letters to the input topic (original key and value)",
        description="Re-produce the dead letters present when the command starts (records "
        "dead-lettered again meanwhile are left for a later redrive). Exits 1, with a count, "
        "if any record was not delivered.",
    )
    add_connection_options(redrive_parser)
    add_topic_options(redrive_parser, ("input", "dead_letters"))
    redrive_parser.add_argument(
        "--reason",
        choices=[reason.value for reason in DeadLetterReason],
        metavar="REASON",
        help="only dead letters of this reason",
    )
    redrive_parser.set_defaults(func=run_redrive)


def run_redrive(args: argparse.Namespace) -> int:
    names = topic_names_from(args)
    connection = None
    try:
        connection = connection_from(args)
        sent = redrive(connection, names, reason=args.reason)
    except failures.KAFKA_FAILURES as error:
        return failures.report("dlq redrive", error, connection)
    print(f"redriven {sent} dead letters to {names.input}")
    return 0
