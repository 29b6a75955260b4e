"""Secrets of the client configuration never leave the process in a message (issue 32 #5).

librdkafka's error texts echo parts of a malformed secret (the texts below are its own, as
librdkafka 2.16 words them); a key that only looks like a secret's (a misspelling) is one too.
The real errors, from every command against a real broker, are in
tests/integration/test_secret_redaction.py.
"""

from __future__ import annotations

import io
import logging

import pytest
from confluent_kafka import KafkaError, KafkaException

from workers.commands import failures
from workers.kafka.clients import KafkaConnection, RefusalWatch, kafka_error_text
from workers.kafka.config import REDACTED, RedactingFilter, is_secret, redact_text, redacted

OAUTH_CONFIG = "principal=bob lifeSeconds=x9Secret7 scope=s3cr3tScope"
# librdkafka properties that are not secrets: none may be hidden from the connection line.
PLAIN_PROPERTIES = (
    "bootstrap.servers",
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.oauthbearer.method",
    "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.client.credentials.client.id",
    "sasl.oauthbearer.scope",
    "sasl.oauthbearer.extensions",
    "enable.sasl.oauthbearer.unsecure.jwt",
    "sasl.kerberos.keytab",
    "ssl.key.location",
    "ssl.keystore.location",
    "ssl.ca.location",
    "ssl.endpoint.identification.algorithm",
    "session.timeout.ms",
    "socket.nagle.disable",
    "linger.ms",
    "compression.type",
    "client.id",
    "statistics.interval.ms",
    "transaction.timeout.ms",
    "message.send.max.retries",
)


@pytest.mark.parametrize(
    "key",
    [
        # the known list is tests/unit/test_kafka_config.py's; these are named like secrets
        "sasl.oauthbearer.token.endpoint.url",
        "ssl.certificate.pem",
        "sasl.pasword",
        "sasl.pssword",
        "sasl.passwd",
        "sasl.secert",
        "my.api.tokn",
        "oauthbearer.config.extra",
    ],
)
def test_keys_named_like_secrets_are_secrets(key: str) -> None:
    assert is_secret(key)


def test_ordinary_properties_stay_visible() -> None:
    """The guard on the name patterns: a connection line that hides everything helps nobody."""
    assert [key for key in PLAIN_PROPERTIES if is_secret(key)] == []


def test_a_misspelled_password_key_is_redacted_in_the_connection_line() -> None:
    connection = KafkaConnection("b:9092", {"sasl.pasword": "hunter2-typo", "sasl.username": "u"})
    assert "hunter2-typo" not in repr(connection)
    assert redacted(connection.properties) == {"sasl.pasword": REDACTED, "sasl.username": "u"}


@pytest.mark.parametrize(
    "librdkafka_text",
    [
        # where parsing stopped, to the end of the value
        "Unrecognized sasl.oauthbearer.config beginning at: lifeSeconds=x9Secret7 "
        "scope=s3cr3tScope",
        # one key's value
        "Invalid sasl.oauthbearer.config: non-integral 'lifeSeconds=': x9Secret7",
        # a word of the value
        "Invalid sasl.oauthbearer.config: '\"' cannot appear in scope: s3cr3tScope",
        # the whole value
        f"config was: {OAUTH_CONFIG!r}",
    ],
)
def test_any_part_of_a_secret_value_is_redacted_from_a_message(librdkafka_text: str) -> None:
    config = {"sasl.oauthbearer.config": OAUTH_CONFIG, "sasl.username": "bob-user"}
    shown = redact_text(librdkafka_text, config)
    assert "x9Secret7" not in shown and "s3cr3tScope" not in shown
    assert REDACTED in shown
    assert shown.split(":")[0] == librdkafka_text.split(":")[0]  # the message itself stays


def test_jaas_and_password_values_are_redacted_quoted_or_bare() -> None:
    config = {
        "sasl.jaas.config": 'PlainLoginModule required username="u" password="pw-Quoted-1";',
        "sasl.pasword": "pw-Bare-2",
    }
    text = "login failed for pw-Quoted-1 and pw-Bare-2"
    assert redact_text(text, config) == f"login failed for {REDACTED} and {REDACTED}"


def test_short_parts_stay_but_a_short_whole_secret_does_not() -> None:
    config = {"sasl.oauthbearer.config": "principal=bob", "sasl.password": "pw"}
    # "bob" (a part, 3 characters) would turn every "bob" of any message into [redacted]
    assert redact_text("bob: pw", config) == f"bob: {REDACTED}"


def test_values_of_ordinary_keys_and_callables_are_left_alone() -> None:
    config = {"sasl.username": "alice", "oauth_cb": print, "client.id": "detok-worker"}
    text = "alice of detok-worker: <built-in function print>"
    assert redact_text(text, config) == text


def test_log_records_are_redacted_arguments_and_tracebacks_included() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter({"sasl.password": "pw-in-Log-3"}))
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("consumer error: %s", "auth failed for pw-in-Log-3")
        try:
            raise RuntimeError("pw-in-Log-3 refused")
        except RuntimeError:
            logger.exception("it failed")
    finally:
        logger.removeHandler(handler)
    logged = stream.getvalue()
    assert "pw-in-Log-3" not in logged
    assert "consumer error: auth failed for" in logged and "RuntimeError" in logged


def test_a_refusal_is_raised_without_the_secret_librdkafka_echoed() -> None:
    watch = RefusalWatch("b:9092", {"sasl.oauthbearer.config": OAUTH_CONFIG})
    echo = KafkaError(
        KafkaError._AUTHENTICATION,
        "Failed to acquire SASL OAUTHBEARER token: Unrecognized sasl.oauthbearer.config "
        "beginning at: lifeSeconds=x9Secret7 scope=s3cr3tScope",
    )
    with pytest.raises(KafkaException) as raised:
        watch(echo)
    assert raised.value.args[0].code() == KafkaError._AUTHENTICATION
    assert "x9Secret7" not in raised.value.args[0].str()
    assert raised.value.args[0].str().startswith("Failed to acquire SASL OAUTHBEARER token")


def test_a_command_prints_kafka_errors_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    connection = KafkaConnection("b:9092", {"sasl.password": "pw-Printed-4"})
    error = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker said pw-Printed-4"))
    assert failures.report("topics ensure", error, connection) == 1
    assert capsys.readouterr().err == f"detok topics ensure: Kafka error: broker said {REDACTED}\n"


def test_a_kafka_error_with_no_message_is_named() -> None:
    assert kafka_error_text(KafkaException(KafkaError(KafkaError._TIMED_OUT, ""))) == "_TIMED_OUT"
