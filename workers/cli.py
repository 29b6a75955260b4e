"""The `detok` console script.

Each subcommand lives in the module that owns its behaviour; this file only wires them into one
argparse tree, so adding a command is one line in `COMMAND_MODULES`. Modules are imported lazily
at start-up so that a command never pays for another's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `add_command(subparsers)`, which registers a parser whose `func(args)`
# returns the process exit code.
COMMAND_MODULES = (
    "workers.run_command",
    "workers.broker",
    "workers.topics",
    "workers.worker_command",
    "workers.replay",
    "workers.dead_letters",
    "workers.demo",
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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
