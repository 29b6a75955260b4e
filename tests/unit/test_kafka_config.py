"""Kafka client configuration: the properties file and `-X` as kcat reads them, precedence,
refusal of settings detok's guarantees depend on, redaction of secrets, OAUTHBEARER callbacks."""

from __future__ import annotations

import json
import logging
import sys
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from bench import bench_e2e
from workers.cli import build_parser, main
from workers.commands.options import connection_from, kafka_config_arguments
from workers.kafka import msk_iam
from workers.kafka.clients import (
    PRODUCER_DEFAULTS,
    KafkaConnection,
    RefusalWatch,
    make_consumer,
    make_producer,
)
from workers.kafka.config import (
    CONFIG_FILE_ENV,
    LEGACY_JSON_ENV,
    PROTECTED,
    REDACTED,
    KafkaConfigError,
    ProtectedSetting,
    client_properties,
    parse_properties,
    redacted,
)
from workers.kafka.topic_names import TopicNames
from workers.runtime.checkpointing import AtLeastOnce, Deadline, ExactlyOnce

SECRET = "s3cr3t-Pa55word-never-printed"
NOWHERE = "127.0.0.1:9"  # nothing listens: a command that got as far as connecting would fail
KAFKA_COMMANDS = (
    ["worker"],
    ["topics", "ensure"],
    ["replay", "--input", __file__],
    ["collect", "--output", "/dev/null"],
    ["dlq", "redrive"],
    ["demo"],
    ["acls", "grant", "--principal", "User:x", "--role", "reader"],
)


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CONFIG_FILE_ENV, LEGACY_JSON_ENV, "KAFKA_BOOTSTRAP_SERVERS"):
        monkeypatch.delenv(name, raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.properties"
    path.write_text(text)
    return path


def test_a_kcat_properties_file_is_read_as_librdkafka_reads_it() -> None:
    text = (
        "# Confluent Cloud\n"
        "\n"
        "security.protocol=SASL_SSL\n"
        "  sasl.mechanisms = PLAIN  \n"
        "sasl.username=KEY\n"
        f"sasl.password={SECRET}==\n"  # base64 padding: only the first = splits
    )
    assert parse_properties(text, "f") == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "PLAIN",
        "sasl.username": "KEY",
        "sasl.password": f"{SECRET}==",
    }


def test_a_malformed_line_is_named_by_number_without_echoing_it() -> None:
    with pytest.raises(KafkaConfigError, match="f, line 2: expected key=value") as raised:
        parse_properties(f"a=b\n{SECRET}\n", "f")
    assert SECRET not in str(raised.value)


def test_dash_x_overrides_the_file_which_overrides_detok_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "linger.ms=5\nclient.id=from-file\ncompression.type=zstd\n")
    properties = client_properties(path, ["linger.ms=7", "acks=all"])
    connection = KafkaConnection("b:1", properties)
    config = connection.client_config({**PRODUCER_DEFAULTS, "linger.ms": 20, "batch.size": 10})
    assert config["linger.ms"] == "7"  # -X over the file over detok's 20
    assert config["client.id"] == "from-file"
    assert config["batch.size"] == 10  # detok's own where nobody overrides
    assert config["partitioner"] == "murmur2_random"


def test_the_file_comes_from_the_environment_when_no_flag_names_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV, str(write(tmp_path, "security.protocol=SSL\n")))
    assert client_properties(None) == {"security.protocol": "SSL"}
    other = tmp_path / "other.properties"
    other.write_text("security.protocol=SASL_SSL\n")
    assert client_properties(other) == {"security.protocol": "SASL_SSL"}


def test_the_old_json_variable_keeps_working_between_file_and_dash_x(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LEGACY_JSON_ENV, '{"client.id": "json", "socket.nagle.disable": true}')
    properties = client_properties(write(tmp_path, "client.id=file\n"), [])
    assert properties == {"client.id": "json", "socket.nagle.disable": "true"}
    assert client_properties(None, ["client.id=x"])["client.id"] == "x"
    monkeypatch.setenv(LEGACY_JSON_ENV, f'["{SECRET}"]')
    with pytest.raises(KafkaConfigError, match=CONFIG_FILE_ENV) as raised:
        client_properties(None)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize(
    "setting",
    [
        "isolation.level=read_uncommitted",
        "enable.auto.commit=true",
        "enable.auto.commit=false",
        "transactional.id=mine",
        "enable.idempotence=false",
        "group.id=other",
        "group.instance.id=pod-0",
        "partitioner=consistent_random",
        "acks=1",
        "auto.offset.reset=latest",
        "enable.partition.eof=false",
        "partition.assignment.strategy=range",
        "message.max.bytes=99999999",
        "stats_cb=x",
    ],
)
def test_settings_detok_depends_on_are_refused_naming_the_key(setting: str) -> None:
    key = setting.split("=")[0]
    with pytest.raises(ProtectedSetting, match=key):
        client_properties(None, [setting])
    with pytest.raises(ProtectedSetting, match=key):
        KafkaConnection("b:1", dict([setting.split("=")]))


def test_stating_the_value_detok_uses_is_allowed() -> None:
    safe = ["isolation.level=read_committed", "enable.idempotence=true", "acks=all"]
    assert client_properties(None, safe)["isolation.level"] == "read_committed"
    assert client_properties(None, ["bootstrap.servers=x:1"]) == {"bootstrap.servers": "x:1"}


def test_every_protected_key_has_a_reason() -> None:
    assert all(reason for _, reason in PROTECTED.values())


def test_secrets_are_redacted_wherever_a_connection_is_printed() -> None:
    properties = {
        "sasl.username": "worker",
        "sasl.password": SECRET,
        "ssl.key.password": SECRET,
        "ssl.key.pem": SECRET,
        "sasl.oauthbearer.client.secret": SECRET,
        "my.custom.secret.token": SECRET,
        "ssl.keystore.password": SECRET,
    }
    shown = redacted(properties)
    assert shown["sasl.username"] == "worker"
    assert all(value == REDACTED for key, value in shown.items() if key != "sasl.username")
    connection = KafkaConnection("b:1", properties)
    assert SECRET not in repr(connection) and SECRET not in str(connection)
    assert "worker" in repr(connection)


def test_oauth_cb_names_a_function_that_is_imported_and_passed_as_the_callback() -> None:
    properties = client_properties(None, ["oauth_cb=workers.kafka.msk_iam:oauth_cb"])
    assert properties["oauth_cb"] is msk_iam.oauth_cb
    assert "msk_iam" in redacted(properties)["oauth_cb"]
    for bad in (
        "oauth_cb=nope",
        "oauth_cb=no.such.module:f",
        "oauth_cb=workers.kafka.msk_iam:absent",
    ):
        with pytest.raises(KafkaConfigError, match="oauth_cb"):
            client_properties(None, [bad])


def test_the_msk_iam_callback_signs_for_the_configured_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def generate_auth_token(region: str) -> tuple[str, int]:
        calls.append(region)
        return "signed-token", 1_700_000_000_000

    provider = types.ModuleType("aws_msk_iam_sasl_signer.MSKAuthTokenProvider")
    provider.generate_auth_token = generate_auth_token
    package = types.ModuleType("aws_msk_iam_sasl_signer")
    package.MSKAuthTokenProvider = provider
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer", package)
    monkeypatch.setitem(sys.modules, "aws_msk_iam_sasl_signer.MSKAuthTokenProvider", provider)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)

    assert msk_iam.oauth_cb("region=eu-west-1") == ("signed-token", 1_700_000_000.0)
    monkeypatch.setenv("AWS_REGION", "us-east-2")
    assert msk_iam.oauth_cb("") == ("signed-token", 1_700_000_000.0)
    assert calls == ["eu-west-1", "us-east-2"]
    monkeypatch.delenv("AWS_REGION")
    with pytest.raises(msk_iam.MskIamConfigError, match="region"):
        msk_iam.oauth_cb(None)


@pytest.mark.parametrize("command", KAFKA_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_kafka_command_takes_the_same_client_configuration(
    command: list[str], tmp_path: Path
) -> None:
    path = write(tmp_path, f"bootstrap.servers={NOWHERE}\nsasl.password={SECRET}\n")
    args = build_parser().parse_args([*command, "--kafka-config", str(path), "-X", "a.b=c"])
    connection = connection_from(args)
    assert connection.bootstrap_servers == NOWHERE
    assert connection.properties == {"sasl.password": SECRET, "a.b": "c"}


@pytest.mark.parametrize("command", KAFKA_COMMANDS[1:], ids=lambda c: " ".join(c[:2]))
def test_a_refused_setting_ends_the_command_before_connecting(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [*command, "--bootstrap-servers", NOWHERE, "-X", f"sasl.password={SECRET}",
         "-X", "isolation.level=read_uncommitted"]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2
    assert "isolation.level cannot be overridden" in captured.err
    assert SECRET not in captured.out + captured.err


def test_the_worker_refuses_a_protected_setting_before_connecting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, f"sasl.password={SECRET}\ntransactional.id=stolen\n")
    code = main(["worker", "--bootstrap-servers", NOWHERE, "--tokenizer", "m=/nowhere",
                 "--kafka-config", str(path)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2 and "transactional.id cannot be overridden" in captured.err
    assert SECRET not in captured.out + captured.err


def test_a_missing_config_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["topics", "ensure", "--kafka-config", "/no/such/file.properties"])
    assert code == 2
    assert "cannot read Kafka config file /no/such/file.properties" in capsys.readouterr().err


def test_a_child_command_gets_the_same_config_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "security.protocol=SSL\n")
    flags = ["--kafka-config", str(path), "-X", "a=b", "-X", "c=d"]
    parent = build_parser().parse_args(["demo", *flags, "--bootstrap-servers", NOWHERE])
    rendered = kafka_config_arguments(parent)
    child = build_parser().parse_args(["worker", *rendered, "--bootstrap-servers", NOWHERE])
    assert connection_from(child) == connection_from(parent)


def test_the_bench_takes_the_same_client_configuration_and_hands_it_to_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_local_broker() -> None:
        raise AssertionError("a bench given a configuration must not start a broker")

    monkeypatch.setattr(bench_e2e, "start_broker", no_local_broker)
    path = write(tmp_path, f"bootstrap.servers={NOWHERE}\nsasl.password={SECRET}\n")
    args = bench_e2e.build_parser().parse_args(["--kafka-config", str(path), "-X", "a.b=c"])
    kafka = bench_e2e.kafka_from(args)
    assert kafka.connection == KafkaConnection(NOWHERE, {"sasl.password": SECRET, "a.b": "c"})
    command = bench_e2e.worker_command(kafka, TopicNames(), "group", ["m=/nowhere"])
    assert command[1:3] == ["-m", "workers.cli"]
    assert SECRET not in " ".join(command)
    worker = build_parser().parse_args(command[3:])
    assert connection_from(worker) == kafka.connection


@pytest.mark.parametrize("command", KAFKA_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_help_never_shows_a_secret_from_the_environment(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(CONFIG_FILE_ENV, str(write(tmp_path, f"sasl.password={SECRET}\n")))
    monkeypatch.setenv(LEGACY_JSON_ENV, json.dumps({"sasl.password": SECRET}))
    words = command[:2] if command[0] in ("topics", "dlq", "acls") else command[:1]
    assert main([*words, "--help"]) == 0
    assert SECRET not in capsys.readouterr().out


def test_a_refused_login_or_handshake_is_raised_and_a_stopped_broker_is_not() -> None:
    watch = RefusalWatch("b:1", {"security.protocol": "SASL_SSL"})
    for code in (KafkaError._AUTHENTICATION, KafkaError._SSL):
        with pytest.raises(KafkaException) as raised:
            watch(KafkaError(code, "refused"))
        assert raised.value.args[0].code() == code
    # A stopped broker refuses the connection first: "all brokers down" then means just that.
    stopped = RefusalWatch("b:1", {})
    stopped(KafkaError(KafkaError._TRANSPORT, "Connection refused"))
    stopped(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    # A broker that closes every connection unasked is a listener of another protocol.
    mismatched = RefusalWatch("b:1", {})
    with pytest.raises(KafkaException, match="this client uses PLAINTEXT"):
        mismatched(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))


def test_only_start_up_clients_get_the_refusal_watch() -> None:
    connection = KafkaConnection("b:1", {})
    assert "error_cb" not in connection.client_config({})
    assert isinstance(connection.client_config({}, start_up=True)["error_cb"], RefusalWatch)


def test_tls_connections_disable_nagle_unless_told_otherwise() -> None:
    assert "socket.nagle.disable" not in KafkaConnection("b:1", {}).client_config({})
    tls = KafkaConnection("b:1", {"security.protocol": "sasl_ssl"})
    assert tls.client_config({})["socket.nagle.disable"] is True
    told = KafkaConnection("b:1", {"security.protocol": "SSL", "socket.nagle.disable": "false"})
    assert told.client_config({})["socket.nagle.disable"] == "false"


def test_every_client_reconnects_sooner_unless_told_otherwise() -> None:
    """librdkafka holds a new client's second connection (to the broker its first metadata
    named) for half of `reconnect.backoff.ms`: 50 ms at its default, paid by every fresh client,
    the changelog restore's included (see CLIENT_DEFAULTS). Every client made here starts at
    10 ms, and a `-X reconnect.backoff.ms` still decides."""
    for settings in ({}, {"group.id": "g"}, PRODUCER_DEFAULTS):
        assert KafkaConnection("b:1", {}).client_config(settings)["reconnect.backoff.ms"] == 10
    told = KafkaConnection("b:1", {"reconnect.backoff.ms": "100"})
    assert told.client_config({}, start_up=True)["reconnect.backoff.ms"] == "100"


def client_settings(
    make: Callable[..., Any], connection: KafkaConnection, settings: dict[str, Any]
) -> str:
    """The configuration librdkafka itself reports for a client `make` creates (`debug=conf`
    logs every setting that differs from its default when the client is made; no broker needed)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(f"test.client-settings.{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    client = make(connection, {**settings, "debug": "conf", "logger": logger})
    (client.close if hasattr(client, "close") else client.flush)()
    return "\n".join(lines)


GROUP = {"group.id": "g"}


def test_every_consumer_fetches_again_soon_after_its_queue_drains_unless_told_otherwise() -> None:
    """librdkafka waits `fetch.queue.backoff.ms` (1 s by default) before it fetches again once
    its local queue reached `queued.min.messages`: a restore of a million changelog heads sat on
    an empty queue for half of its reading (see CONSUMER_DEFAULTS). Every consumer detok makes
    decides again after 10 ms, as librdkafka reports its own configuration; a
    `-X fetch.queue.backoff.ms` still decides, and producers (for which librdkafka ignores the
    setting, with a warning) are not given it."""
    plain = KafkaConnection("127.0.0.1:1", {})
    assert "fetch.queue.backoff.ms = 10\n" in client_settings(make_consumer, plain, GROUP) + "\n"
    told = KafkaConnection("127.0.0.1:1", {"fetch.queue.backoff.ms": "500"})
    assert "fetch.queue.backoff.ms = 500" in client_settings(make_consumer, told, GROUP)
    assert "fetch.queue.backoff.ms" not in client_settings(make_producer, plain, {})


def test_transactional_producers_retry_a_refused_transaction_sooner_unless_told_otherwise() -> None:
    """librdkafka's 100 ms retry backoff, doubling, stretched a send_offsets_to_transaction
    refused while the previous transaction's markers were written (see
    TRANSACTION_RETRY_BACKOFF_MS); an exactly-once worker's producer retries after 20 ms, and a
    `-X retry.backoff.ms` still decides."""
    settings = {**PRODUCER_DEFAULTS, **ExactlyOnce("detok-g-w0", Deadline()).producer_settings()}
    assert KafkaConnection("b:1", {}).client_config(settings)["retry.backoff.ms"] == 20
    told = KafkaConnection("b:1", {"retry.backoff.ms": "250"})
    assert told.client_config(settings)["retry.backoff.ms"] == "250"
    at_least_once = {**PRODUCER_DEFAULTS, **AtLeastOnce(Deadline()).producer_settings()}
    assert "retry.backoff.ms" not in KafkaConnection("b:1", {}).client_config(at_least_once)
