"""The `--bootstrap-servers` option every Kafka-facing command shares."""

from __future__ import annotations

import argparse
import os

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"


def add_bootstrap_servers(parser: argparse.ArgumentParser) -> None:
    """`--bootstrap-servers`, defaulting to $KAFKA_BOOTSTRAP_SERVERS; required when that is unset,
    so a missing address is argparse's clear usage error (exit 2), not a hang on connect."""
    default = os.environ.get(BOOTSTRAP_ENV)
    parser.add_argument(
        "--bootstrap-servers",
        default=default,
        required=default is None,
        help=f"Kafka bootstrap servers (default: ${BOOTSTRAP_ENV})",
    )
