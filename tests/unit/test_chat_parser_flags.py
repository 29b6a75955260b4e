"""`--reasoning-parser MODEL=NAME` and `--tool-parser MODEL=NAME` (issue 30): on `detok worker`
(and as DETOK_REASONING_PARSERS / DETOK_TOOL_PARSERS) and `detok run`, refused at start-up
with one line naming the valid choices, and handed to the request processor. No broker: nothing
listens on the address given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import pipeline.offline
import workers.runtime.worker
from pipeline.chat.config import ChatParsers
from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_run_command import detok_run, generation
from workers.cli import build_parser, main
from workers.commands.worker import settings_from_args
from workers.kafka.topic_names import TopicNames
from workers.runtime.output_limits import OutputLimits
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.settings import WorkerSettings
from workers.runtime.worker import Worker

NOWHERE = ["--bootstrap-servers", "127.0.0.1:9"]


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


def worker_settings(*argv: str) -> WorkerSettings:
    return settings_from_args(build_parser().parse_args(["worker", *NOWHERE, *argv]))


def one_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    """The command's only stderr line that is not a log line (the worker logs its connection)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def test_flags_are_repeatable_and_build_the_parsers() -> None:
    settings = worker_settings(
        "--tokenizer", "qwen=/q", "--tokenizer", "ds=/d",
        "--reasoning-parser", "qwen=qwen3", "--reasoning-parser", "ds=deepseek_r1",
        "--tool-parser", "qwen=hermes",
    )  # fmt: skip
    assert settings.chat_parsers == ChatParsers.from_specs(
        ["qwen=qwen3", "ds=deepseek_r1"], ["qwen=hermes"]
    )
    assert dict(settings.chat_parsers.tools) == {"qwen": "hermes"}


def test_environment_variables_configure_the_parsers_and_flags_override_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DETOK_TOKENIZERS", '["qwen=/q", "llama=/l"]')
    monkeypatch.setenv("DETOK_REASONING_PARSERS", '["qwen=qwen3"]')
    monkeypatch.setenv("DETOK_TOOL_PARSERS", '["qwen=hermes", "llama=llama3_json"]')
    settings = worker_settings()
    assert dict(settings.chat_parsers.reasoning) == {"qwen": "qwen3"}
    assert dict(settings.chat_parsers.tools) == {"qwen": "hermes", "llama": "llama3_json"}
    overridden = worker_settings("--tool-parser", "llama=mistral")
    assert dict(overridden.chat_parsers.tools) == {"llama": "mistral"}
    assert dict(overridden.chat_parsers.reasoning) == {"qwen": "qwen3"}


def test_without_flags_there_are_no_parsers() -> None:
    assert not worker_settings("--tokenizer", "m=/p").chat_parsers


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reasoning-parser", "m=qwen4"],
         "unknown reasoning parser 'qwen4'; valid: deepseek_r1, qwen3"),
        (["--tool-parser", "m=json"],
         "unknown tool parser 'json'; valid: hermes, llama3_json, mistral"),
        (["--tool-parser", "other=hermes"],
         "--tool-parser other=hermes: no tokenizer is configured for model 'other'; "
         "configured: m"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser 'qwen3': expected MODEL=NAME"),
    ],
)  # fmt: skip
def test_the_worker_refuses_a_bad_parser_with_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    # The tokenizer path is never loaded: the parsers are checked before the cluster and the
    # tokenizers, so the refusal is immediate.
    assert main(["worker", *NOWHERE, "--tokenizer", "m=/not/loaded", *flags]) == 2
    assert one_line(capsys, "detok worker:") == f"detok worker: {message}"


def test_the_worker_refuses_a_bad_parser_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DETOK_REASONING_PARSERS", '["m=r1"]')
    assert main(["worker", *NOWHERE, "--tokenizer", "m=/not/loaded"]) == 2
    assert one_line(capsys, "detok worker:").endswith("valid: deepseek_r1, qwen3")
    monkeypatch.setenv("DETOK_REASONING_PARSERS", "m=qwen3")  # not JSON
    assert main(["worker", *NOWHERE, "--tokenizer", "m=/not/loaded"]) == 2
    assert one_line(capsys, "detok worker:") == (
        "detok worker: DETOK_REASONING_PARSERS is not valid: it takes a JSON list of strings, "
        """e.g. DETOK_REASONING_PARSERS='["qwen3=qwen3"]'"""
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reasoning-parser", "bytes=deepseek"],
         "unknown reasoning parser 'deepseek'; valid: deepseek_r1, qwen3"),
        (["--tool-parser", "gpt2=hermes"],
         "--tool-parser gpt2=hermes: no tokenizer is configured for model 'gpt2'; "
         "configured: bytes"),
    ],
)  # fmt: skip
def test_detok_run_refuses_a_bad_parser_with_one_line(
    tmp_path: Path,
    tokenizer_file: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(generation("a", "x", "y") + "\n")
    output = tmp_path / "out.jsonl"
    assert detok_run(f"bytes={tokenizer_file}", source, output, *flags) == 2
    assert capsys.readouterr().err == f"detok run: {message}\n"
    assert not output.exists()


class RecordingProcessor(RequestProcessor):
    """The processor, recording the chat parsers it was built with."""

    built: list[ChatParsers] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        RecordingProcessor.built.append(kwargs["chat_parsers"])
        super().__init__(*args, **kwargs)


def test_detok_run_hands_the_parsers_to_its_processor(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipeline.offline, "RequestProcessor", RecordingProcessor)
    RecordingProcessor.built.clear()
    source = tmp_path / "in.jsonl"
    source.write_text(generation("a", "x", "y") + "\n")
    output = tmp_path / "out.jsonl"
    flags = ["--reasoning-parser", "bytes=qwen3", "--tool-parser", "bytes=hermes"]
    assert detok_run(f"bytes={tokenizer_file}", source, output, *flags) == 0
    assert RecordingProcessor.built == [ChatParsers.from_specs(["bytes=qwen3"], ["bytes=hermes"])]
    [line] = output.read_text().splitlines()
    assert json.loads(line)["request_id"] == "a"


def test_the_worker_hands_the_parsers_to_its_processor(
    tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers.runtime.worker, "RequestProcessor", RecordingProcessor)
    RecordingProcessor.built.clear()
    registry = TokenizerRegistry()
    registry.register("bytes", tokenizer_file)
    settings = WorkerSettings(
        bootstrap_servers="127.0.0.1:9",  # nothing listens there; the test never waits on it
        tokenizers=[f"bytes={tokenizer_file}"],
        reasoning_parsers=["bytes=deepseek_r1"],
        tool_parsers=["bytes=llama3_json"],
    )
    limits = OutputLimits({name: 1_048_588 for name in TopicNames().model_dump().values()})
    worker = Worker(settings, registry, PrometheusMetrics(["bytes"], registry=None), limits)
    try:
        assert RecordingProcessor.built == [
            ChatParsers.from_specs(["bytes=deepseek_r1"], ["bytes=llama3_json"])
        ]
    finally:
        worker.consumer.close()
