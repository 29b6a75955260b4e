"""The flags of a child `detok` command, rendered for the demo's worker and run processes.

Declared in `workers/commands/options.py`; rendered here, below the commands, so that the local
tooling does not import the command layer (tests/unit/test_command_options.py parses every
rendering with those declarations, so a spelling cannot drift).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from workers.kafka.topic_names import TopicNames


def topic_arguments(names: TopicNames) -> list[str]:
    """The `--{role}-topic` flags that name every topic of `names`, for a child command."""
    arguments = []
    for role, name in names.model_dump().items():
        arguments += [f"--{role.replace('_', '-')}-topic", name]
    return arguments


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
