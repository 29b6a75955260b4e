"""How a command that talks to Kafka reports a failure: one line on stderr and exit 1.

A traceback tells an operator nothing they can act on; these errors already say what went wrong
(no broker, no such topic, records not delivered), so every Kafka command ends with them alone.
"""

from __future__ import annotations

import sys

from confluent_kafka import KafkaException

from workers.kafka.clients import (
    KafkaConnection,
    KafkaUnavailable,
    NotAuthorized,
    UndeliveredRecords,
    UnknownTopic,
    kafka_error_text,
)
from workers.kafka.config import KafkaConfigError

KAFKA_FAILURES = (
    KafkaUnavailable,
    UnknownTopic,
    NotAuthorized,
    UndeliveredRecords,
    KafkaException,
    KafkaConfigError,
)


def report(command: str, error: Exception, connection: KafkaConnection | None = None) -> int:
    """Print `error` for `detok COMMAND` and return the exit code for it: 2 for a client
    configuration detok refuses (a usage error: nothing was tried), else 1.

    `connection` is the one the command used (None only if making it failed, before any client
    existed): librdkafka's text in the error may echo one of its secrets, which is replaced."""
    if isinstance(error, KafkaConfigError):
        print(f"detok {command}: {error}", file=sys.stderr)
        return 2
    if isinstance(error, KafkaException):
        message = f"Kafka error: {kafka_error_text(error)}"
    else:
        message = str(error)
    if connection is not None:
        message = connection.redact(message)
    print(f"detok {command}: {message}", file=sys.stderr)
    return 1
