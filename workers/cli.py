"""The `detok` console script.

Each subcommand's flags and exit codes live in its own module under `workers.commands` (the
library it calls has no argparse); this file only wires them into one argparse tree, so adding a
command is one line in `COMMAND_MODULES`. Modules are imported lazily at start-up so that a
command never pays for another's imports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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
    "workers.commands.dlq",
    "workers.commands.demo",
)
# Until `detok worker` moves to workers.commands.worker (done on another branch), it is found in
# its old module. To be removed at merge.
MOVED_FROM = {"workers.commands.worker": "workers.worker_command"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="detok", description="Kafka-based batch detokenization of LLM token ids."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        if importlib.util.find_spec(module_name) is None:
            module_name = MOVED_FROM[module_name]
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
