"""Client configuration in the forms Kafka users already know, checked and kept out of logs.

Every managed Kafka (Confluent Cloud, MSK, Aiven, Strimzi with TLS) hands its users a librdkafka
properties file or a list of `key=value` settings, so detok reads exactly those, as kcat does:

- `--kafka-config FILE` (or `$DETOK_KAFKA_CONFIG_FILE`): `key=value` lines, `#` comments, the
  file `kcat -F` reads;
- `-X key=value`, repeatable, over the file;
- detok's own settings for each client (a consumer group, a transactional id, tuning) under both.

Some settings carry detok's guarantees rather than tune them: a worker reading uncommitted input
would emit text an aborted transaction never wrote; auto-commit would move the input past records
whose output is not yet committed; a second transactional id would fence nothing. Those are
refused, naming the key, before any client connects (`check_protected`). Every other librdkafka
property passes through, later sources winning.

Secrets (passwords, private keys, OAuth client secrets) reach librdkafka and nothing else:
`redacted` is what any message or log that shows a configuration prints, and `KafkaConnection`'s
repr uses it. A secret is a key on the known list, or one whose name looks like a secret's
(`*password*`, `*secret*`, `*token*`, `*.pem`, a misspelling such as `sasl.pasword`), so a typo
never puts a password in a log. librdkafka's own messages can echo a secret, whole or in part
("Unrecognized sasl.oauthbearer.config beginning at: <the rest of the value>"), so every text
from the client library that detok prints or logs goes through `redact_text` (commands' error
lines, `RedactingFilter` on the worker's log).

OAUTHBEARER token providers are Python callables; a properties file can only name one, so
`oauth_cb=package.module:function` is imported and passed to librdkafka as the callback.
"""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

CONFIG_FILE_ENV = "DETOK_KAFKA_CONFIG_FILE"
# The worker's earlier form: a JSON object of client settings. Still read (between the file and
# `-X`), so existing deployments keep working; docs/security.md documents the file form instead.
LEGACY_JSON_ENV = "DETOK_KAFKA_CONFIG"
REDACTED = "[redacted]"
OAUTH_CALLBACK = "oauth_cb"

# Keys whose values are secrets whatever their name says; besides these, any key that looks like
# one (`looks_secret`) is one.
SECRET_KEYS = frozenset(
    {
        "sasl.password",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl_key",
        "ssl.keystore.password",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.config",
        "sasl.jaas.config",
    }
)
# A key containing one of these is a secret (sasl.oauthbearer.client.secret, ssl.keystore.password,
# sasl.oauthbearer.token.endpoint.url: a URL may carry credentials). "pass" and "pwd" catch
# `passwd`, `sasl.pasword` and the like.
SECRET_WORDS = (
    "password",
    "secret",
    "token",
    "passphrase",
    "private.key",
    "oauthbearer.config",
    "jaas",
    "pass",
    "pwd",
)
# A key one of whose dot-separated words is this close to one of these (difflib's ratio) is a
# misspelled secret: `sasl.pssword`, `sasl.secert`. 0.8 keeps every librdkafka property that is not
# a secret out (tests/unit/test_redaction.py checks the list).
SECRET_SPELLINGS = ("password", "secret", "token")
MISSPELLING_RATIO = 0.8
# Parts of a secret value shorter than this are not replaced in messages (a whole value always
# is): "principal=bob" would otherwise turn every "bob" and "=" in a message into [redacted].
MIN_FRAGMENT_CHARS = 4
# A quoted or terminated value inside a compound secret (a JAAS line's password="x";).
FRAGMENT_PUNCTUATION = "\"';,"

# Settings detok's guarantees depend on: key -> the values a user may state (None: detok alone
# sets it). The reason is part of the refusal, so an operator knows what they would lose.
PROTECTED: Mapping[str, tuple[frozenset[str] | None, str]] = {
    "isolation.level": (
        frozenset({"read_committed"}),
        "readers must not see records of aborted transactions",
    ),
    "enable.auto.commit": (
        None,
        "the worker commits input offsets with its output, never on a timer",
    ),
    "enable.auto.offset.store": (None, "offsets are stored only with the output they produced"),
    "transactional.id": (None, "the worker derives it from --group and --instance-id"),
    "group.id": (None, "the worker's group is --group; other commands use private groups"),
    "group.instance.id": (None, "static membership derives it from --instance-id"),
    "enable.idempotence": (
        frozenset({"true"}),
        "transactions and per-partition order across retries need the idempotent producer",
    ),
    "acks": (frozenset({"all", "-1"}), "the idempotent producer needs every in-sync replica"),
    "partitioner": (
        frozenset({"murmur2_random"}),
        "a request's records must land where Java producers put the same key",
    ),
    "auto.offset.reset": (
        frozenset({"earliest"}),
        "a new group must read the input from the start, not skip it",
    ),
    "enable.partition.eof": (None, "the worker relies on end-of-partition events"),
    "partition.assignment.strategy": (
        frozenset({"cooperative-sticky"}),
        "the worker restores and releases partitions incrementally",
    ),
    "message.max.bytes": (
        None,
        "detok sizes producers from the topics' max.message.bytes",
    ),
}


class KafkaConfigError(ValueError):
    """A client configuration detok will not use: unreadable, malformed, or unsafe. Its message
    never contains a secret value."""


class ProtectedSetting(KafkaConfigError):
    """A setting detok's guarantees depend on was given an unsafe value."""


def is_secret(key: str) -> bool:
    """Whether `key`'s value is a secret: on the list, or named like one (see SECRET_WORDS)."""
    lowered = key.lower()
    if lowered in SECRET_KEYS or lowered.endswith(".pem"):
        return True
    if any(word in lowered for word in SECRET_WORDS):
        return True
    return any(
        difflib.SequenceMatcher(None, part, spelling).ratio() >= MISSPELLING_RATIO
        for part in re.split(r"[._-]", lowered)
        for spelling in SECRET_SPELLINGS
    )


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` fit to print: secret values replaced, callables shown by name."""
    shown: dict[str, Any] = {}
    for key, value in config.items():
        if is_secret(key):
            shown[key] = REDACTED
        elif callable(value):
            shown[key] = f"<{getattr(value, '__module__', '?')}.{_name(value)}>"
        else:
            shown[key] = value
    return shown


def secret_fragments(config: Mapping[str, Any]) -> frozenset[str]:
    """Every text of `config`'s secret values a message may echo: each whole value, and of a
    compound one (`principal=bob lifeSeconds=...`, a JAAS line) every suffix from a word on, every
    word, and every word's value after `=`, quoted or not (librdkafka quotes a value from the
    offending word to the end, or one word's value). Parts shorter than MIN_FRAGMENT_CHARS are
    left out, whole values never are."""
    whole: set[str] = set()
    parts: set[str] = set()
    for key, value in config.items():
        if not is_secret(key) or callable(value):
            continue
        text = _as_property(value)
        if text.strip():
            whole.add(text)
        for word in re.finditer(r"\S+", text):
            _, _, assigned = word.group().partition("=")
            for part in (text[word.start() :], word.group(), assigned):
                parts.update((part, part.strip(FRAGMENT_PUNCTUATION)))
    return frozenset(whole | {part for part in parts if len(part) >= MIN_FRAGMENT_CHARS})


def redact_text(text: str, config: Mapping[str, Any]) -> str:
    """`text` (an error or log message, possibly librdkafka's) with every secret value of
    `config`, or any part of one `secret_fragments` names, replaced by REDACTED."""
    return _redact(text, secrets_pattern(config))


def secrets_pattern(config: Mapping[str, Any]) -> re.Pattern[str] | None:
    """One pattern matching any of `config`'s secret fragments, the longest where several start
    at one place; None when the config holds no secret."""
    fragments = sorted(secret_fragments(config), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, fragments))) if fragments else None


def _redact(text: str, pattern: re.Pattern[str] | None) -> str:
    return pattern.sub(REDACTED, text) if pattern is not None else text


class RedactingFilter(logging.Filter):
    """A log handler's filter that passes every record with `redact_text` applied to its message
    (arguments merged in) and its traceback: the worker logs librdkafka's error texts."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.pattern = secrets_pattern(config)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern is None:
            return True
        record.msg, record.args = _redact(record.getMessage(), self.pattern), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _redact(record.exc_text, self.pattern)
        return True


def redact_logs(config: Mapping[str, Any]) -> None:
    """Put a RedactingFilter for `config` on every handler of the root logger (call it after
    `logging.basicConfig`), so nothing any module logs shows one of `config`'s secrets."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter(config))


def parse_properties(text: str, source: str) -> dict[str, str]:
    """A librdkafka properties file: `key=value` per line, `#` comments and blank lines ignored.

    Whitespace around keys and values is dropped (as librdkafka's own file reader does); a value
    keeps any further `=` (a JAAS line, a base64 secret). `source` names the file in errors.
    """
    properties: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            # The line itself is not shown: it may be a secret missing its `key=`.
            raise KafkaConfigError(f"{source}, line {number}: expected key=value")
        properties[key.strip()] = value.strip()
    return properties


def read_properties_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise KafkaConfigError(f"cannot read Kafka config file {path}: {error.strerror}") from None
    return parse_properties(text, str(path))


def parse_override(text: str) -> tuple[str, str]:
    """One `-X key=value`."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise KafkaConfigError("-X expects key=value (a librdkafka property)")
    return key.strip(), value.strip()


def legacy_json_config(environ: Mapping[str, str]) -> dict[str, str]:
    """`DETOK_KAFKA_CONFIG` (a JSON object), the worker's earlier form; errors show no value."""
    text = environ.get(LEGACY_JSON_ENV)
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError:
        loaded = None
    if not isinstance(loaded, dict):
        raise KafkaConfigError(
            f"${LEGACY_JSON_ENV} must be a JSON object of librdkafka settings; prefer a "
            f"properties file in ${CONFIG_FILE_ENV} (or --kafka-config FILE, -X key=value)"
        )
    return {str(key): _as_property(value) for key, value in loaded.items()}


def check_protected(properties: Mapping[str, Any]) -> None:
    """Refuse (ProtectedSetting, naming the key) a setting detok's guarantees depend on.

    Stating the value detok itself uses is allowed (a shared properties file may say
    `isolation.level=read_committed`); any other value, and any value of a key only detok sets,
    is refused. Callback keys other than `oauth_cb` are detok's own (delivery reports, stats).
    """
    for key, value in properties.items():
        if key.endswith("_cb") and key != OAUTH_CALLBACK or key == "on_delivery":
            raise ProtectedSetting(f"{key} cannot be set: detok installs its own callback")
        if key not in PROTECTED:
            continue
        allowed, reason = PROTECTED[key]
        if allowed is None or _as_property(value).lower() not in allowed:
            accepted = f" (accepted: {', '.join(sorted(allowed))})" if allowed else ""
            raise ProtectedSetting(f"{key} cannot be overridden{accepted}: {reason}")


def resolve_oauth_callback(properties: dict[str, Any]) -> dict[str, Any]:
    """`oauth_cb=module:function` replaced by the function itself (librdkafka needs a callable)."""
    spec = properties.get(OAUTH_CALLBACK)
    if spec is None or callable(spec):
        return properties
    module_name, sep, attribute = str(spec).partition(":")
    if not sep or not module_name or not attribute:
        raise KafkaConfigError(f"{OAUTH_CALLBACK} must be module:function, got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise KafkaConfigError(f"{OAUTH_CALLBACK}={spec}: cannot import it ({error})") from None
    if not callable(function):
        raise KafkaConfigError(f"{OAUTH_CALLBACK}={spec} is not callable")
    return {**properties, OAUTH_CALLBACK: function}


def client_properties(
    config_file: Path | None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The merged, checked client properties: `-X` over `DETOK_KAFKA_CONFIG` over the file
    (`config_file`, else `$DETOK_KAFKA_CONFIG_FILE`).

    Raises KafkaConfigError before any client exists, so nothing connects with a config detok
    would refuse.
    """
    environ = os.environ if environ is None else environ
    if config_file is None and environ.get(CONFIG_FILE_ENV):
        config_file = Path(environ[CONFIG_FILE_ENV])
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(read_properties_file(config_file))
    merged.update(legacy_json_config(environ))
    merged.update(parse_override(override) for override in overrides)
    check_protected(merged)
    return resolve_oauth_callback(merged)


def _as_property(value: Any) -> str:
    """A JSON value as librdkafka reads it (`true`, not Python's `True`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _name(value: Callable[..., Any]) -> str:
    return getattr(value, "__qualname__", type(value).__name__)
