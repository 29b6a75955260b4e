"""Worker settings: flags override DETOK_* variables, which override defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.cli import build_parser
from workers.commands.worker import settings_from_args
from workers.kafka.config import KafkaConfigError


def parse(*argv: str):
    return settings_from_args(build_parser().parse_args(["worker", *argv]))


def test_environment_configures_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETOK_BOOTSTRAP_SERVERS", "kafka:9092")
    monkeypatch.setenv("DETOK_TOKENIZERS", '["gpt2=/models/gpt2"]')
    monkeypatch.setenv("DETOK_GUARANTEE", "at-least-once")
    monkeypatch.setenv("DETOK_TOPICS__INPUT", "tokens.v2")
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    settings = parse()
    assert settings.bootstrap_servers == "kafka:9092"
    assert settings.tokenizers == ["gpt2=/models/gpt2"]
    assert settings.guarantee == "at-least-once"
    assert settings.topics.input == "tokens.v2"
    assert settings.topics.completions == "detok.completions"
    assert settings.commit_interval_ms == 250


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETOK_BOOTSTRAP_SERVERS", "kafka:9092")
    monkeypatch.setenv("DETOK_COMMIT_INTERVAL_MS", "1000")
    settings = parse(
        "--bootstrap-servers",
        "localhost:1",
        "--tokenizer",
        "m=/p",
        "--commit-interval-ms",
        "50",
        "--completions-topic",
        "done",
    )
    assert (settings.bootstrap_servers, settings.commit_interval_ms) == ("localhost:1", 50)
    assert settings.topics.completions == "done" and settings.topics.input == "detok.tokens"


def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETOK_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    with pytest.raises(KafkaConfigError, match="no Kafka bootstrap servers"):
        _ = parse("--tokenizer", "m=/p").connection  # no bootstrap servers anywhere
    with pytest.raises(ValidationError):
        parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p", "--commit-interval-ms", "0")
    with pytest.raises(ValidationError):
        parse(
            "--bootstrap-servers",
            "b:1",
            "--tokenizer",
            "m=/p",
            "--input-topic",
            "x",
            "--deltas-topic",
            "x",
        )


def test_start_up_and_shutdown_are_bounded_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETOK_SHUTDOWN_TIMEOUT_S", raising=False)
    settings = parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p")
    assert settings.shutdown_timeout_s < 30, "under a container's usual grace period"
    assert settings.startup_timeout_s > 0
    settings = parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p", "--shutdown-timeout", "5")
    assert settings.shutdown_timeout_s == 5
    assert settings.connection.bootstrap_servers == "b:1"


def test_static_membership_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DETOK_STATIC_MEMBERSHIP", raising=False)
    assert not parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p").static_membership
    flagged = parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p", "--static-membership")
    assert flagged.static_membership
    monkeypatch.setenv("DETOK_STATIC_MEMBERSHIP", "true")
    assert parse("--bootstrap-servers", "b:1", "--tokenizer", "m=/p").static_membership
