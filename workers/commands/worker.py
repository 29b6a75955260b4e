"""`detok worker`: run one worker process of the consumer group.

The command sets up the process (logging, stop signals, the collector policy), checks the
cluster can hold what the worker writes, and only then builds the `Worker`: a library object
that changes no process-wide state and waits on nothing unbounded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from confluent_kafka import KafkaException
from pydantic import ValidationError
from pydantic_settings import SettingsError

from pipeline.tokenizer_registry import (
    TokenizerRegistry,
    TokenizerSpecError,
    parse_vocab_size_specs,
)
from workers.commands import failures
from workers.commands.options import (
    add_chat_parser_options,
    add_connection_options,
    add_tokenizer_options,
    add_topic_options,
    topic_names_from,
)
from workers.kafka.config import KafkaConfigError, redact_logs
from workers.kafka.topic_names import TopicNames
from workers.runtime.health import Health
from workers.runtime.output_limits import TopicLimitError, TopicsUnavailable, read_output_limits
from workers.runtime.process_policy import StopRequest, tune_garbage_collector
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.settings import WorkerSettings, settings_problem
from workers.runtime.worker import Worker

log = logging.getLogger(__name__)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="consume token-id events and produce text (one process of the group)",
        description="Every option can also be set as a DETOK_* environment variable "
        "(e.g. DETOK_BOOTSTRAP_SERVERS, DETOK_TOKENIZERS='[\"gpt2=/path\"]', DETOK_TOPICS__INPUT).",
    )
    # Not required here: each may come from a DETOK_* variable instead (see WorkerSettings).
    add_connection_options(parser)
    add_tokenizer_options(parser, required=False)
    add_chat_parser_options(parser)
    add_topic_options(parser)
    parser.add_argument("--group")
    parser.add_argument("--guarantee", choices=["exactly-once", "at-least-once"])
    parser.add_argument("--commit-interval-ms", type=int)
    parser.add_argument(
        "--exit-when-idle",
        type=float,
        dest="exit_when_idle_s",
        metavar="S",
        help="stop once every assigned partition is at its end and idle for S s",
    )
    parser.add_argument("--instance-id", help="stable id of this worker across restarts")
    parser.add_argument("--session-timeout-ms", type=int)
    parser.add_argument(
        "--static-membership",
        action="store_true",
        default=None,
        help="join the group as static member --instance-id: a restart within the session "
        "timeout keeps its partitions without a rebalance; a stopped member holds them until then",
    )
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--request-ttl", type=float, dest="request_ttl_s", metavar="S")
    parser.add_argument("--unknown-generated-ids", choices=["error", "skip"])
    parser.add_argument(
        "--startup-timeout",
        type=float,
        dest="startup_timeout_s",
        metavar="S",
        help="give up (exit 1) if the broker has not described the topics within S s",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        dest="shutdown_timeout_s",
        metavar="S",
        help="once stopping, exit within S s even if the broker is unreachable (default 20)",
    )
    parser.add_argument(
        "--metrics-port", type=int, help="serve /metrics, /healthz and /readyz on this port"
    )
    parser.add_argument("--metrics-host", help="interface /metrics listens on (default: all)")
    parser.add_argument(
        "--log-level", type=log_level, default="INFO", help=f"one of {', '.join(LOG_LEVELS)}"
    )
    parser.set_defaults(func=run)


def log_level(text: str) -> str:
    """An argparse type: a logging level name, any case (`logging` raises on any other)."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    """Flags that were given override DETOK_* variables; the rest come from the environment."""
    given = {
        key: value
        for key, value in vars(args).items()
        if value not in (None, []) and key in WorkerSettings.model_fields
    }
    if any(getattr(args, f"{role}_topic") for role in TopicNames.model_fields):
        given["topics"] = topic_names_from(args)
    return WorkerSettings(**given)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = settings_from_args(args)
        # Every log line from here on: librdkafka's error texts may echo a secret.
        redact_logs(settings.connection.properties)
        log.info("Kafka %r", settings.connection)  # redacted: see KafkaConnection
        vocab_sizes = parse_vocab_size_specs(settings.model_vocab_sizes)
        chat_parsers = settings.chat_parsers  # an unknown parser name is a usage error too
    except (ValidationError, SettingsError) as error:
        print(f"detok worker: {settings_problem(error)}", file=sys.stderr)
        return 2
    except (TokenizerSpecError, KafkaConfigError, ValueError) as error:
        print(f"detok worker: {error}", file=sys.stderr)
        return 2
    if chat_parsers:
        log.info(
            "chat parsers: reasoning %s, tools %s",
            dict(chat_parsers.reasoning),
            dict(chat_parsers.tools),
        )
    stop = StopRequest()
    stop.install()
    # The cluster first, the tokenizers (seconds of loading on a busy machine) after: a worker
    # the cluster refuses (a wrong password, a missing ACL) or cannot reach says so at once.
    try:
        limits = read_output_limits(
            settings.connection,
            settings.topics,
            settings.startup_timeout_s,
            lambda: stop.requested,
        )
        limits.check_dead_letters_hold_input(settings.topics)
        limits.check_changelog_covers_input(settings.topics)
    except (TopicsUnavailable, TopicLimitError) as error:
        if stop.requested:
            return 0
        return failures.report("worker", error, settings.connection)
    except KafkaException as error:  # a refused login or handshake (kafka_clients.RefusalWatch)
        return failures.report("worker", error, settings.connection)
    try:
        registry = TokenizerRegistry.from_specs(settings.tokenizers, vocab_sizes)
    except TokenizerSpecError as error:
        print(f"detok worker: {error}", file=sys.stderr)
        return 2
    metrics = PrometheusMetrics(registry.names, registry=None)
    health = Health()
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port, settings.metrics_host, health)
    worker = Worker(settings, registry, metrics, limits, stop, health)
    tune_garbage_collector()  # after the worker built its decode tables: see its docstring
    return worker.run()
