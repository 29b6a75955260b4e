"""The `detok` console script.

Each subcommand's flags and exit codes live in its own module under `workers.commands` (the
library it calls has no argparse); this file only wires them into one argparse tree, so adding a
command is one line in `COMMAND_MODULES`. Modules are imported lazily at start-up so that a
command never pays for another's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `add_command(subparsers)`, which registers a parser whose `func(args)`
# returns the process exit code.
COMMAND_MODULES = (
    "workers.commands.run",
    "workers.commands.broker",
    "workers.commands.topics",
    "workers.commands.worker",
    "workers.commands.replay",
    "workers.commands.collect",
    "workers.commands.follow",
    "workers.commands.dlq",
    "workers.commands.demo",
    "workers.commands.acls",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="detok", description="Kafka-based batch detokenization of LLM token ids."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_command(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. A usage error is argparse's message and code 2, returned
    rather than raised, so calling `main` in process behaves like the console script."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as usage_exit:
        return int(usage_exit.code or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
