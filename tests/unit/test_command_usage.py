"""Bad flags are usage errors (exit 2, argparse's message), never tracebacks (issue 16 #20).

Each fails before any Kafka client is made, so no broker is needed: the address below is never
dialled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.cli import main

NOWHERE = ["--bootstrap-servers", "127.0.0.1:9"]


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        (["replay", *NOWHERE, "--input", "/missing/generations.jsonl"], "no such file"),
        (["replay", *NOWHERE, "--input", "{file}", "--chunk-size", "0"], "at least 1"),
        (["replay", *NOWHERE, "--input", "{file}", "--rate", "0"], "greater than 0"),
        (["topics", "ensure", *NOWHERE, "--partitions", "0"], "at least 1"),
        (["topics", "ensure", *NOWHERE, "--replication-factor", "-1"], "at least 1"),
        (["collect", *NOWHERE, "--output", "{file}", "--expect", "zero"], "expected an integer"),
        (["dlq", "redrive", *NOWHERE, "--reason", "no_such_reason"], "invalid choice"),
        (["run", "--tokenizer", "m=x", "--input", "{file}", "--output", "o", "--chunk-size",
          "0"], "at least 1"),
    ],
)  # fmt: skip
def test_bad_flags_are_usage_errors(
    tmp_path: Path, arguments: list[str], complaint: str, capsys
) -> None:
    existing = tmp_path / "generations.jsonl"
    existing.write_text("")
    argv = [str(existing) if argument == "{file}" else argument for argument in arguments]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert complaint in err and "Traceback" not in err


def test_topics_ensure_refuses_an_illegal_topic_name(capsys) -> None:
    assert main(["topics", "ensure", *NOWHERE, "--input-topic", "no spaces allowed"]) == 2
    assert "input" in capsys.readouterr().err
