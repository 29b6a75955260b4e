"""Settings and failures a careless operator meets end with one line naming the cause (issue 32
#12, #13): a usage error (exit 2) for a setting in the wrong form, the real cause for `acls grant`
with no broker. No broker is needed: nothing listens on the address given."""

from __future__ import annotations

import pytest

from tests.integration.conftest import free_port_pair
from workers.cli import main

NOWHERE = ["--bootstrap-servers", "127.0.0.1:9"]
WORKER = ["worker", *NOWHERE, "--tokenizer", "m=/not/loaded"]


@pytest.mark.parametrize(
    ("variable", "value", "takes"),
    [
        ("DETOK_TOKENIZERS", "gpt2=/models/gpt2", "a JSON list of strings"),
        ("DETOK_KAFKA_OVERRIDES", "acks=all", "a JSON list of strings"),
        ("DETOK_MODEL_VOCAB_SIZES", "olmo2=100352", "a JSON list of strings"),
        ("DETOK_TOPICS", "tokens", "a JSON object"),
    ],
)
def test_a_variable_that_is_not_json_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    takes: str,
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["worker", *NOWHERE]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"detok worker: {variable} is not valid: it takes {takes}")


def test_a_setting_out_of_range_is_one_line_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DETOK_COMMIT_INTERVAL_MS", "soon")
    assert main(WORKER) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("detok worker: commit_interval_ms (DETOK_COMMIT_INTERVAL_MS): ")
    assert "soon" not in err  # pydantic quotes the input; a value may be a secret


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*WORKER, "--log-level", "BOGUS"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "detok worker: error: argument --log-level: expected one of DEBUG, INFO, WARNING, "
        "ERROR, CRITICAL, got 'BOGUS'"
    )


def test_acls_grant_with_no_broker_names_the_cause(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["acls", "grant", "--principal", "User:x", "--role", "reader", "--timeout", "2"]
    assert main([*arguments, "--bootstrap-servers", f"127.0.0.1:{free_port_pair()}"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    # was "creating TOPIC 'detok.deltas': " and nothing after the colon, after 30 s
    assert last.startswith("detok acls grant: no Kafka broker answered within 2 s (")
    assert last.endswith("Broker transport failure)")
