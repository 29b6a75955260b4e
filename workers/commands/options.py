"""Flags shared by several commands, declared once: connection, topics, tokenizers, counts.

Each `add_*` function declares a group of flags; its partner (`connection_from`,
`topic_names_from`, `registry_from`) turns the parsed flags into the library object. The demo starts
`detok worker` and `detok run` processes with these flags, rendered by
`workers/local/child_flags.py` (tests/unit/test_command_options.py parses its renderings with
the declarations here, so the two cannot drift).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

from pipeline.chat.config import ChatParsers
from pipeline.chat.formats import REASONING_FORMATS, TOOL_FORMATS
from pipeline.tokenizer_registry import TokenizerRegistry, parse_vocab_size_specs
from workers.kafka.clients import BOOTSTRAP_ENV, KafkaConnection, configured_connection
from workers.kafka.config import CONFIG_FILE_ENV
from workers.kafka.topic_names import TopicNames

ROLES = tuple(TopicNames.model_fields)
# Spellings accepted besides `--{role}-topic`, because earlier releases documented them.
TOPIC_FLAG_ALIASES = {"dead_letters": ("--dead-letter-topic",)}


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """`--bootstrap-servers`, `--kafka-config FILE` and repeatable `-X key=value`.

    The bootstrap address is the flag, else `bootstrap.servers` from the config (file or `-X`),
    else $KAFKA_BOOTSTRAP_SERVERS; with none, `connection_from` raises a KafkaConfigError (a
    clear message, exit 2) instead of a hang on connect.
    """
    parser.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT",
        help=f"Kafka bootstrap servers (default: bootstrap.servers of the config, else "
        f"${BOOTSTRAP_ENV})",
    )
    parser.add_argument(
        "--kafka-config",
        type=Path,
        dest="kafka_config_file",
        metavar="FILE",
        help="librdkafka properties file (key=value lines, # comments; the file kcat -F reads) "
        f"for TLS, SASL and other client settings (default: ${CONFIG_FILE_ENV})",
    )
    parser.add_argument(
        "-X",
        action="append",
        dest="kafka_overrides",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka property, over the config file (repeatable)",
    )


def connection_from(
    args: argparse.Namespace, fallback: Callable[[], str] | None = None
) -> KafkaConnection:
    """The connection the flags, the config file and the environment describe (`fallback()`
    gives the address when none of them does).

    Raises KafkaConfigError (which never quotes a secret) for an unreadable or malformed file,
    a protected setting, or no bootstrap address at all.
    """
    return configured_connection(
        args.bootstrap_servers, args.kafka_config_file, args.kafka_overrides, fallback
    )


def kafka_config_arguments(args: argparse.Namespace) -> list[str]:
    """The `--kafka-config` and `-X` flags given to this command, for a child command (the
    demo's workers), which gets the resolved address as `--bootstrap-servers`."""
    arguments = []
    if args.kafka_config_file:
        arguments += ["--kafka-config", str(args.kafka_config_file)]
    for override in args.kafka_overrides:
        arguments += ["-X", override]
    return arguments


def add_topic_options(
    parser: argparse.ArgumentParser,
    roles: Iterable[str] = ROLES,
    *,
    topic_alias: bool = False,
) -> None:
    """`--{role}-topic NAME` for each of `roles` (default: all six).

    Flags left out stay None, so `topic_names_from` (or the worker's DETOK_* settings) supplies
    the default. `topic_alias` also accepts plain `--topic` for a command that uses one topic.
    """
    defaults = TopicNames()
    roles = tuple(roles)
    for role in roles:
        flags = [f"--{role.replace('_', '-')}-topic", *TOPIC_FLAG_ALIASES.get(role, ())]
        if topic_alias and len(roles) == 1:
            flags.append("--topic")
        parser.add_argument(
            *flags,
            dest=f"{role}_topic",
            metavar="NAME",
            help=f"the {role.replace('_', ' ')} topic (default: {getattr(defaults, role)})",
        )


def topic_names_from(args: argparse.Namespace) -> TopicNames:
    """The names given by flags over the defaults; raises pydantic's ValidationError for an
    illegal or shared name."""
    given = {role: getattr(args, f"{role}_topic", None) for role in ROLES}
    return TopicNames(**{role: name for role, name in given.items() if name is not None})


def add_tokenizer_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """`--tokenizer MODEL=PATH` and `--model-vocab-size MODEL=N`, repeatable."""
    parser.add_argument(
        "--tokenizer",
        action="append",
        dest="tokenizers",
        required=required,
        default=None if required else [],
        metavar="MODEL=PATH",
        help="a model name and its tokenizer.json or model folder (repeatable)",
    )
    parser.add_argument(
        "--model-vocab-size",
        action="append",
        dest="model_vocab_sizes",
        default=[],
        metavar="MODEL=N",
        help="the model's embedding size when larger than the tokenizer's vocabulary "
        "(prompt ids below it are tolerated; ids at or above it are out of range)",
    )


def registry_from(args: argparse.Namespace) -> TokenizerRegistry:
    """Load the tokenizers named by the flags; raises TokenizerSpecError."""
    return TokenizerRegistry.from_specs(
        args.tokenizers, parse_vocab_size_specs(args.model_vocab_sizes)
    )


def add_chat_parser_options(parser: argparse.ArgumentParser) -> None:
    """`--reasoning-parser MODEL=NAME` and `--tool-parser MODEL=NAME`, repeatable: the chat
    outputs' parsers of each model (docs/chat-outputs.md), named as vLLM's flags name them."""
    parser.add_argument(
        "--reasoning-parser",
        action="append",
        dest="reasoning_parsers",
        default=[],
        metavar="MODEL=NAME",
        help=f"split MODEL's reasoning out of its text with parser NAME: "
        f"{', '.join(sorted(REASONING_FORMATS))} (repeatable)",
    )
    parser.add_argument(
        "--tool-parser",
        action="append",
        dest="tool_parsers",
        default=[],
        metavar="MODEL=NAME",
        help=f"parse MODEL's tool calls, for requests that offer tools, with parser NAME: "
        f"{', '.join(sorted(TOOL_FORMATS))} (repeatable)",
    )


def chat_parsers_from(
    reasoning: Iterable[str], tools: Iterable[str], tokenizer_specs: Iterable[str]
) -> ChatParsers:
    """The parsers the flags name, checked against the models of the `MODEL=PATH` tokenizer
    specs (before any tokenizer is loaded, so a typo costs no loading time). Raises ValueError
    (UnknownParserError among them) with a one-line message naming the valid choices."""
    parsers = ChatParsers.from_specs(reasoning, tools)
    if parsers:
        parsers.check_models(spec.partition("=")[0] for spec in tokenizer_specs)
    return parsers


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of partitions, ids per chunk, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (a rate, a timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {value}")
    return value


def readable_file(text: str) -> Path:
    """An argparse type: an existing regular file, so a typo is a usage error, not a traceback."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return path
