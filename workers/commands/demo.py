"""`detok demo`: the whole pipeline on a generated sample, checked against `detok run`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.tokenizer_registry import TokenizerSpecError, parse_vocab_size_specs
from workers.commands import failures
from workers.commands.options import (
    add_connection_options,
    add_tokenizer_options,
    connection_from,
    kafka_config_arguments,
    positive_int,
)
from workers.local.demo import (
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SHARED_DIR,
    DemoError,
    DemoOptions,
    local_broker,
    run,
    tokenizer_paths,
)
from workers.runtime.prometheus import DEFAULT_METRICS_PORT


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on a sample (broker, 2 workers, metrics) and check it",
        description="Start the local broker (unless --bootstrap-servers), replay a generated "
        "sample of logged generations through two workers, and check the completions against "
        "`detok run`. Exit 0 only if every check passes. --bootstrap-servers defaults to "
        "$KAFKA_BOOTSTRAP_SERVERS; without either, the local `detok broker` is started or reused.",
    )
    add_connection_options(parser)
    parser.add_argument(
        "--shared-dir",
        type=Path,
        default=Path(os.environ.get("DETOK_SHARED_DIR", DEFAULT_SHARED_DIR)),
        help="folder holding tokenizers/{gpt2,qwen2-from-tiktoken}/tokenizer.json",
    )
    add_tokenizer_options(parser, required=False)
    parser.add_argument(
        "--requests", type=positive_int, default=1500, metavar="N", help="generations per model"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help=f"first worker's metrics port, the next one's +1 (default {DEFAULT_METRICS_PORT} "
        "if free, else any free ports)",
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="after the checks, keep the workers (and their metrics) up until Ctrl-C",
    )
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    try:
        vocab_sizes = parse_vocab_size_specs(args.model_vocab_sizes)
    except TokenizerSpecError as error:
        print(f"detok demo: {error}", file=sys.stderr)
        return 2
    try:
        tokenizer_paths(args.shared_dir, args.tokenizers)  # before a broker is started for it
        connection = connection_from(args, fallback=local_broker)
    except DemoError as error:
        print(f"detok demo: {error}", file=sys.stderr)
        return 2
    except failures.KAFKA_FAILURES as error:
        return failures.report("demo", error)
    options = DemoOptions(
        connection=connection,
        kafka_config_flags=kafka_config_arguments(args),
        shared_dir=args.shared_dir,
        tokenizer_overrides=args.tokenizers,
        model_vocab_sizes=vocab_sizes,
        requests=args.requests,
        metrics_port=args.metrics_port,
        output_dir=args.output_dir,
        keep_running=args.keep_running,
    )
    try:
        return run(options)
    except failures.KAFKA_FAILURES as error:
        return failures.report("demo", error, connection)
