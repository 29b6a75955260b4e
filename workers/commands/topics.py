"""`detok topics ensure`: create the pipeline's missing topics, validate the existing ones."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from workers.commands import failures
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    positive_int,
    topic_names_from,
)
from workers.kafka.topics import DEFAULT_PARTITIONS, TopicConfigurationMismatch, ensure_topics


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topics", help="manage the pipeline's Kafka topics")
    actions = parser.add_subparsers(dest="topics_action", required=True, metavar="ACTION")
    ensure = actions.add_parser(
        "ensure",
        help="create missing topics, validate existing ones (idempotent)",
        description=(
            "Create the pipeline's topics and validate existing ones: partition counts, "
            "compaction of completions and changelog. A topic with fewer partitions than "
            "--partitions is grown (the changelog before the input; see "
            "docs/growing-partitions.md); one with more is refused. "
            "Sets max.message.bytes on the output, changelog and dead-letter topics (and raises "
            "a lower existing one) so that no output the worker writes is refused."
        ),
    )
    add_connection_options(ensure)
    ensure.add_argument(
        "--partitions",
        type=positive_int,
        help="partitions per topic (default: the input's count if it exists, else "
        f"{DEFAULT_PARTITIONS}); topics with fewer are grown to it",
    )
    ensure.add_argument(
        "--replication-factor",
        type=positive_int,
        help="replicas per topic (default: min(3, brokers in the cluster); "
        "min.insync.replicas=2 where it is 3)",
    )
    add_topic_options(ensure)
    ensure.set_defaults(func=run_ensure)


def run_ensure(args: argparse.Namespace) -> int:
    try:
        names = topic_names_from(args)
    except ValidationError as error:
        print(f"detok topics ensure: {error}", file=sys.stderr)
        return 2
    connection = None
    try:
        connection = connection_from(args)
        result = ensure_topics(connection, names, args.partitions, args.replication_factor)
    except TopicConfigurationMismatch as error:
        print(f"detok topics ensure: refused: {error}", file=sys.stderr)
        return 1
    except failures.KAFKA_FAILURES as error:
        return failures.report("topics ensure", error, connection)
    for name in result.created:
        print(f"created   {name}")
    for name in result.validated:
        print(f"validated {name}")
    for name in result.grown:
        print(f"grew      {name} to {result.partitions} partitions")
    if names.input in result.grown:
        print(
            "detok topics ensure: the input grew, so request ids map to new partitions: a "
            "request in flight may lose its later events (see docs/growing-partitions.md)",
            file=sys.stderr,
        )
    for name in result.raised_limits:
        print(f"raised    {name} max.message.bytes")
    return 0
