"""`detok acls grant`: each role's ACLs follow the topic and group flags; --dry-run connects to
nothing."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AclOperation, ResourcePatternType, ResourceType

from workers.cli import main
from workers.kafka.acls import role_grants
from workers.kafka.topic_names import TopicNames

NAMES = TopicNames.with_prefix("p")


def rights(role: str, group: str | None = None) -> set[tuple[str, str, str, bool]]:
    return {
        (g.resource.name, g.name, g.operation.name, g.prefixed)
        for g in role_grants(role, NAMES, group)
    }


def test_the_worker_reads_input_writes_outputs_and_owns_its_transactional_ids() -> None:
    granted = rights("worker", "g1")
    assert ("TOPIC", NAMES.input, "READ", False) in granted
    assert ("TOPIC", NAMES.input, "WRITE", False) not in granted
    assert {("TOPIC", NAMES.changelog, op, False) for op in ("READ", "WRITE")} <= granted
    for output in (NAMES.deltas, NAMES.completions, NAMES.metrics, NAMES.dead_letters):
        assert ("TOPIC", output, "WRITE", False) in granted
        assert ("TOPIC", output, "READ", False) not in granted
    assert ("GROUP", "g1", "READ", False) in granted
    assert ("TRANSACTIONAL_ID", "detok-g1-", "WRITE", True) in granted
    assert not any(op == "ALL" or res == "BROKER" for res, _, op, _ in granted)


def test_the_reader_only_reads_outputs_and_the_producer_only_writes_the_input() -> None:
    reader = rights("reader")
    assert {op for _, _, op, _ in reader} == {"READ"}
    assert NAMES.input not in {name for _, name, _, _ in reader}
    producer = rights("producer")
    assert ("TOPIC", NAMES.input, "WRITE", False) in producer
    assert ("TOPIC", NAMES.dead_letters, "READ", False) in producer
    assert not any(op == "WRITE" and name != NAMES.input for _, name, op, _ in producer)


def test_bindings_are_allow_acls_for_the_principal() -> None:
    binding = role_grants("worker", NAMES, "g1")[-1].binding("User:w")
    assert binding.principal == "User:w" and binding.host == "*"
    assert binding.restype == ResourceType.TRANSACTIONAL_ID
    assert binding.resource_pattern_type == ResourcePatternType.PREFIXED
    assert binding.operation == AclOperation.WRITE


def test_dry_run_prints_the_acls_and_connects_to_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["acls", "grant", "--principal", "User:w", "--role", "reader", "--dry-run",
                 "--bootstrap-servers", "127.0.0.1:9", "--completions-topic", "done"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "ALLOW User:w READ on TOPIC name 'done'" in out
    assert "granted" not in out


def test_a_principal_must_name_a_user(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["acls", "grant", "--principal", "worker", "--role", "worker", "--dry-run"]) == 2
    assert "User:NAME" in capsys.readouterr().err
