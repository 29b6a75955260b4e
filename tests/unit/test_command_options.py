"""The shared flags of `workers.commands.options`: declared once, parsed back to the same
objects, and rendered for child commands in the spelling the parser reads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from workers.commands.options import (
    add_tokenizer_options,
    add_topic_options,
    topic_names_from,
)
from workers.kafka.topic_names import TopicNames
from workers.local.child_flags import tokenizer_arguments, topic_arguments


def parser_with(*adders) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    for add in adders:
        add(parser)
    return parser


def test_topic_flags_rendered_for_a_child_parse_back_to_the_same_names() -> None:
    names = TopicNames.with_prefix("demo-1")
    args = parser_with(add_topic_options).parse_args(topic_arguments(names))
    assert topic_names_from(args) == names


def test_flags_left_out_fall_back_to_the_defaults() -> None:
    args = parser_with(add_topic_options).parse_args(["--deltas-topic", "my.deltas"])
    assert topic_names_from(args) == TopicNames(deltas="my.deltas")


def test_a_single_topic_command_also_takes_plain_topic_and_the_old_dead_letter_spelling() -> None:
    single = parser_with(lambda p: add_topic_options(p, ("input",), topic_alias=True))
    assert topic_names_from(single.parse_args(["--topic", "in"])).input == "in"
    both = parser_with(lambda p: add_topic_options(p, ("input", "dead_letters")))
    args = both.parse_args(["--dead-letter-topic", "dlq"])
    assert topic_names_from(args).dead_letters == "dlq"
    with pytest.raises(SystemExit):  # --topic is only for single-topic commands
        both.parse_args(["--topic", "x"])


def test_tokenizer_flags_rendered_for_a_child_parse_back() -> None:
    paths = {"gpt2": Path("/t/gpt2"), "qwen2": Path("/t/qwen2")}
    rendered = tokenizer_arguments(paths, {"qwen2": 151_936})
    args = parser_with(add_tokenizer_options).parse_args(rendered)
    assert args.tokenizers == ["gpt2=/t/gpt2", "qwen2=/t/qwen2"]
    assert args.model_vocab_sizes == ["qwen2=151936"]
