"""Typed worker settings: from `detok worker` flags, else `DETOK_*` environment variables.

One pydantic-settings model so that a container deploy (env vars) and a shell (flags) configure
the same thing, validated the same way, and the bounds below are documented once.
"""

from __future__ import annotations

import re
import uuid
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from pipeline.chat.config import ChatParsers
from workers.kafka.clients import KafkaConnection, configured_connection
from workers.kafka.topic_names import TopicNames

Guarantee = Literal["exactly-once", "at-least-once"]
ENV_PREFIX = "DETOK_"
# What a list setting's variable holds, shown when it is not JSON (a usage error, not a traceback).
ENV_LIST_EXAMPLES = {
    "tokenizers": '["gpt2=/models/gpt2/tokenizer.json"]',
    "model_vocab_sizes": '["olmo2=100352"]',
    "kafka_overrides": '["linger.ms=5", "compression.type=lz4"]',
    "reasoning_parsers": '["qwen3=qwen3"]',
    "tool_parsers": '["qwen3=hermes"]',
}


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", frozen=True)

    # Else `bootstrap.servers` of the Kafka config, else $KAFKA_BOOTSTRAP_SERVERS (`connection`).
    bootstrap_servers: str | None = None
    # `MODEL=PATH` specs, as for `detok run`; `MODEL=N` for models whose embedding is larger.
    tokenizers: list[str] = Field(min_length=1)
    model_vocab_sizes: list[str] = []
    # `MODEL=NAME` specs of the chat outputs' parsers (docs/chat-outputs.md); a model in neither
    # list is not parsed, and pays nothing for the feature.
    reasoning_parsers: list[str] = []
    tool_parsers: list[str] = []
    group: str = "detok-workers"
    topics: TopicNames = TopicNames()
    guarantee: Guarantee = "exactly-once"
    # Deltas become visible to read_committed readers at each commit, so this is the latency
    # floor under exactly-once; 250 ms keeps transactions (a few broker round trips each) well
    # under 10% of the time while a reader still sees text within a quarter second.
    commit_interval_ms: int = Field(250, ge=10, le=60_000)
    # Stop once every assigned partition is at its end and nothing arrived for this long.
    exit_when_idle_s: float | None = Field(None, gt=0)
    # Identifies this worker instance across restarts. A stable id lets a restarted worker fence
    # its crashed predecessor at once (init_transactions aborts the open transaction); a random
    # one is always safe but leaves that transaction open until the transaction timeout.
    instance_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    # How long a silent member (a killed worker) keeps its partitions before the group moves
    # them. librdkafka's 45 s default is tuned for JVM pauses; a Python worker that heartbeats
    # from librdkafka's own thread is never silent that long unless dead, and 10 s bounds the
    # stall a kill -9 causes.
    session_timeout_ms: int = Field(10_000, ge=1000, le=300_000)
    # Static group membership (KIP-345): the consumer joins as `group.instance.id` =
    # `instance_id`. A member that restarts with the same id within the session timeout gets its
    # partitions back without a rebalance (no revoke, no restore elsewhere, the other members
    # never pause); the price is that a member that is gone for good (or only stopping: a static
    # member does not leave the group on close) holds its partitions, unconsumed, until the
    # session timeout ends. Worth it with a stable `instance_id` per replica (a StatefulSet's pod
    # name) and restarts faster than the session timeout; pointless with a random id.
    static_membership: bool = False
    # Upper bound on records per consume call: big enough to amortise the per-batch decode round
    # and Python overhead, small enough that one batch takes milliseconds.
    max_batch: int = Field(2000, ge=1, le=100_000)
    request_ttl_s: float = Field(3600.0, gt=0)
    finished_retention_s: float = Field(600.0, gt=0)
    unknown_generated_ids: Literal["error", "skip"] = "error"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # All interfaces, so Prometheus can scrape a container; 127.0.0.1 on a shared machine.
    metrics_host: str = "0.0.0.0"
    # How long start-up waits for the broker to describe the pipeline's topics; a broker that
    # does not answer by then (or a missing topic) ends the worker with a message, not a hang.
    startup_timeout_s: float = Field(30.0, gt=0, le=3600)
    # Once stopping (SIGTERM), the worker is gone within this long even if the broker is away:
    # the final commit and the leave are cut short. Under a container's usual 30 s grace period,
    # so the orchestrator never has to SIGKILL a worker mid-commit.
    shutdown_timeout_s: float = Field(20.0, gt=0, le=600)
    # Client settings for every Kafka client (TLS, SASL, tuning): a librdkafka properties file
    # (`--kafka-config`, DETOK_KAFKA_CONFIG_FILE) and `-X key=value` over it; see
    # workers/kafka/config.py. Read when `connection` is first asked for, outside pydantic's
    # validation, whose errors would quote the values (passwords included).
    kafka_config_file: Path | None = None
    kafka_overrides: list[str] = []

    @cached_property
    def connection(self) -> KafkaConnection:
        """Raises KafkaConfigError for a config detok refuses or no bootstrap address
        (DETOK_BOOTSTRAP_SERVERS and --bootstrap-servers set `bootstrap_servers`)."""
        return configured_connection(
            self.bootstrap_servers, self.kafka_config_file, self.kafka_overrides
        )

    @cached_property
    def chat_parsers(self) -> ChatParsers:
        """The chat outputs' parsers per model. Raises ValueError (exit 2: the command asks
        before it contacts the cluster) for an unknown parser name, naming the valid ones, and
        for a model no tokenizer spec names (its requests would silently go unparsed)."""
        parsers = ChatParsers.from_specs(self.reasoning_parsers, self.tool_parsers)
        if parsers:
            parsers.check_models(spec.partition("=")[0] for spec in self.tokenizers)
        return parsers

    @property
    def transactional_id(self) -> str:
        return f"detok-{self.group}-{self.instance_id}"


def settings_problem(error: ValidationError | SettingsError) -> str:
    """One line for a worker setting refused at start-up (a usage error, exit 2): which setting
    (flag name and DETOK_* variable) and what it takes. pydantic's own text is several lines, and
    quotes the input, which may be a secret (`kafka_overrides`); this line never does."""
    if isinstance(error, SettingsError):
        return _unparsed_variable(str(error))
    problems = []
    for detail in error.errors(include_input=False, include_url=False):
        names = [str(part) for part in detail["loc"] if isinstance(part, str)]
        where = ".".join(str(part) for part in detail["loc"])
        if error.title == WorkerSettings.__name__ and names:
            where += f" ({_variable('__'.join(names))})"
        problems.append(f"{where}: {detail['msg']}")
    return "; ".join(problems)


def _unparsed_variable(text: str) -> str:
    """pydantic-settings parses a list or model variable as JSON and names only the field."""
    match = re.search(r'field "(\w+)"', text)
    field = match[1] if match else ""
    if field not in WorkerSettings.model_fields:
        return text
    annotation = WorkerSettings.model_fields[field].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        nested = next(iter(annotation.model_fields))
        takes = (
            f'a JSON object (e.g. {{"{nested}": "NAME"}}), or one variable per field '
            f"({_variable(field)}__{nested.upper()}=NAME)"
        )
    else:
        example = ENV_LIST_EXAMPLES.get(field, '["VALUE"]')
        takes = f"a JSON list of strings, e.g. {_variable(field)}='{example}'"
    return f"{_variable(field)} is not valid: it takes {takes}"


def _variable(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"
