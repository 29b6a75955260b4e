"""`detok acls grant`: the least-privilege ACLs of one role (see `workers.kafka.acls`)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from workers.commands import failures
from workers.commands.options import (
    add_connection_options,
    add_topic_options,
    connection_from,
    positive_float,
    topic_names_from,
)
from workers.kafka.acls import ADMIN_TIMEOUT_S, DEFAULT_GROUPS, ROLES, AclError, grant, role_grants


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("acls", help="grant the ACLs a detok role needs")
    actions = parser.add_subparsers(dest="acls_action", required=True, metavar="ACTION")
    grant_parser = actions.add_parser(
        "grant",
        help="create exactly the ACLs of a role (worker, reader, producer) for a principal",
        description="Create, through the AdminClient, the least-privilege ACLs of one role for "
        "the pipeline topics the flags name. Run it as a principal allowed to create ACLs "
        "(e.g. --kafka-config admin.properties). Idempotent.",
    )
    add_connection_options(grant_parser)
    grant_parser.add_argument(
        "--principal", required=True, metavar="User:NAME", help="e.g. User:worker"
    )
    grant_parser.add_argument("--role", required=True, choices=ROLES)
    grant_parser.add_argument(
        "--group",
        metavar="G",
        help=f"worker: its consumer group (default {DEFAULT_GROUPS['worker']}); reader, producer: "
        f"their group-id prefix (default {DEFAULT_GROUPS['reader']}, {DEFAULT_GROUPS['producer']})",
    )
    add_topic_options(grant_parser)
    grant_parser.add_argument(
        "--dry-run", action="store_true", help="print the ACLs instead of creating them"
    )
    grant_parser.add_argument(
        "--timeout",
        type=positive_float,
        default=ADMIN_TIMEOUT_S,
        metavar="S",
        help=f"give up (exit 1, naming the cause) if the cluster has not answered within S s "
        f"(default {ADMIN_TIMEOUT_S:.0f})",
    )
    grant_parser.set_defaults(func=run_grant)


def run_grant(args: argparse.Namespace) -> int:
    if not args.principal.startswith("User:") or len(args.principal) <= len("User:"):
        print("detok acls grant: --principal must look like User:NAME", file=sys.stderr)
        return 2
    try:
        grants = role_grants(args.role, topic_names_from(args), args.group)
    except ValidationError as error:
        print(f"detok acls grant: {error}", file=sys.stderr)
        return 2
    for one in grants:
        print(one.describe(args.principal))
    if args.dry_run:
        return 0
    connection = None
    try:
        connection = connection_from(args)
        grant(connection, args.principal, grants, args.timeout)
    except (AclError, *failures.KAFKA_FAILURES) as error:
        return failures.report("acls grant", error, connection)
    print(f"granted {len(grants)} ACLs to {args.principal} ({args.role})")
    return 0
