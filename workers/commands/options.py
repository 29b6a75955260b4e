"""Flags shared by several commands, declared once: connection, topics, tokenizers, counts.

Each `add_*` function declares a group of flags; its partner (`connection_from`,
`topic_names_from`, `registry_from`) turns the parsed flags into the library object. The demo and
bench start `detok worker` processes with the same flags, rendered by `topic_arguments` and
`tokenizer_arguments`, so a flag's spelling lives only here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pipeline.tokenizer_registry import TokenizerRegistry, parse_vocab_size_specs
from workers.kafka_clients import KafkaConnection
from workers.topic_names import TopicNames

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
ROLES = tuple(TopicNames.model_fields)
# Spellings accepted besides `--{role}-topic`, because earlier releases documented them.
TOPIC_FLAG_ALIASES = {"dead_letters": ("--dead-letter-topic",)}


def add_connection_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """`--bootstrap-servers`, defaulting to $KAFKA_BOOTSTRAP_SERVERS.

    When required and that is unset, a missing address is argparse's clear usage error (exit 2),
    not a hang on connect.
    """
    default = os.environ.get(BOOTSTRAP_ENV)
    parser.add_argument(
        "--bootstrap-servers",
        default=default,
        required=required and default is None,
        metavar="HOST:PORT",
        help=f"Kafka bootstrap servers (default: ${BOOTSTRAP_ENV})",
    )


def connection_from(args: argparse.Namespace) -> KafkaConnection:
    return KafkaConnection(args.bootstrap_servers)


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


def topic_arguments(names: TopicNames) -> list[str]:
    """The `--{role}-topic` flags that name every topic of `names`, for a child command."""
    arguments = []
    for role, name in names.model_dump().items():
        arguments += [f"--{role.replace('_', '-')}-topic", name]
    return arguments


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


def tokenizer_arguments(
    paths: Mapping[str, Path], model_vocab_sizes: Mapping[str, int] | None = None
) -> list[str]:
    """The `--tokenizer` and `--model-vocab-size` flags for a child command."""
    arguments = []
    for model, path in paths.items():
        arguments += ["--tokenizer", f"{model}={path}"]
    for model, size in (model_vocab_sizes or {}).items():
        arguments += ["--model-vocab-size", f"{model}={size}"]
    return arguments


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
