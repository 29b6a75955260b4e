"""The pipeline's Kafka topics: their names, their required shape, and `detok topics ensure`.

Why explicit: the local broker has `auto.create.topics.enable=false`, and a production cluster
usually does too, so every topic is created here with the shape the pipeline relies on:

- `completions` and `changelog` are compacted: only the latest record per key matters, and a
  compacted log stays bounded while still rebuilding state from the beginning.
- `changelog` has exactly the input's partition count: worker state for input partition p is
  written to changelog partition p, so a differing count would restore the wrong state after a
  rebalance. Such a topic is refused, never "fixed": Kafka cannot shrink a topic, and growing one
  would re-map existing keys.

`ensure_topics` is idempotent: it creates what is missing and validates what exists.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Annotated

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType
from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.kafka_options import add_bootstrap_servers

# Kafka's own topic-name rule: legal characters, at most 249 of them.
TopicName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9._-]{1,249}$")]
# Admin requests on a healthy cluster take milliseconds; 30 s covers a broker that is still
# electing leaders for freshly created topics, without letting the CLI hang forever.
ADMIN_TIMEOUT_S = 30.0
DEFAULT_PARTITIONS = 4
COMPACTED_CONFIG = {"cleanup.policy": "compact"}


class TopicNames(BaseModel):
    """The six topic names of one pipeline deployment."""

    model_config = ConfigDict(frozen=True)

    input: TopicName = "detok.tokens"
    deltas: TopicName = "detok.deltas"
    completions: TopicName = "detok.completions"
    metrics: TopicName = "detok.metrics"
    dead_letters: TopicName = "detok.dead-letters"
    changelog: TopicName = "detok.state-changelog"

    @model_validator(mode="after")
    def _names_are_distinct(self) -> TopicNames:
        # Two roles on one topic (say changelog == input) would feed state records to the
        # decoder; refuse such a configuration before anything is created.
        names = list(self.model_dump().values())
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"each topic role needs its own topic; shared: {duplicates}")
        return self

    @classmethod
    def with_prefix(cls, prefix: str) -> TopicNames:
        """One deployment's own set (`PREFIX.tokens`, ...), e.g. a demo run's or a test's."""
        return cls(
            input=f"{prefix}.tokens",
            deltas=f"{prefix}.deltas",
            completions=f"{prefix}.completions",
            metrics=f"{prefix}.metrics",
            dead_letters=f"{prefix}.dead-letters",
            changelog=f"{prefix}.state-changelog",
        )

    @property
    def compacted(self) -> tuple[str, ...]:
        return (self.completions, self.changelog)


class TopicConfigurationMismatch(Exception):
    """An existing topic's shape contradicts what the pipeline needs; it is not changed."""


@dataclass(frozen=True)
class EnsuredTopics:
    """What `ensure_topics` did: topics it created, and existing topics it validated."""

    created: tuple[str, ...]
    validated: tuple[str, ...]


def ensure_topics(
    bootstrap_servers: str,
    names: TopicNames,
    partitions: int = DEFAULT_PARTITIONS,
    replication_factor: int = 1,
) -> EnsuredTopics:
    """Create the pipeline's missing topics and validate the existing ones.

    Every topic gets `partitions` partitions; the changelog must match the input's actual count.
    Raises TopicConfigurationMismatch, listing every problem at once, if an existing topic has a
    different partition count or a compacted topic lacks `cleanup.policy=compact`.
    """
    if partitions < 1 or replication_factor < 1:
        raise ValueError("partitions and replication_factor must be at least 1")
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    wanted = list(names.model_dump().values())
    existing = _partition_counts(admin, wanted)
    # Validate before creating, so a refused run leaves the cluster as it found it.
    _validate(admin, names, partitions, existing)
    missing = [name for name in wanted if name not in existing]
    if missing:
        new_topics = [
            NewTopic(
                name,
                num_partitions=partitions,
                replication_factor=replication_factor,
                config=COMPACTED_CONFIG if name in names.compacted else {},
            )
            for name in missing
        ]
        futures = admin.create_topics(new_topics, operation_timeout=ADMIN_TIMEOUT_S)
        for future in futures.values():
            try:
                future.result(timeout=ADMIN_TIMEOUT_S)
            except KafkaException as error:
                # A concurrent `ensure` created it first; the re-validation below checks it.
                if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        _validate(admin, names, partitions, _partition_counts(admin, wanted))
    return EnsuredTopics(
        created=tuple(missing), validated=tuple(name for name in wanted if name in existing)
    )


def delete_topics(bootstrap_servers: str, topics: list[str], timeout_s: float = 60.0) -> list[str]:
    """Delete throwaway topics (a demo's, a benchmark run's); returns what could not be deleted.

    Runs that make fresh topics must drop them: a local broker left with thousands of partitions
    spends its CPU on their background upkeep, which showed up as stalled transaction commits.
    Never raises: a leftover topic only costs disk, so callers report it and go on.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    failed = []
    for topic, future in admin.delete_topics(topics).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException:
            failed.append(topic)
    return failed


def _validate(
    admin: AdminClient, names: TopicNames, partitions: int, existing: dict[str, int]
) -> None:
    """Raise TopicConfigurationMismatch listing every way `existing` topics differ from the need.

    A topic not yet in `existing` will be created with `partitions`, so the changelog is compared
    with the input's existing count if there is one, else with `partitions`.
    """
    problems = []
    for name, count in existing.items():
        if name != names.changelog and count != partitions:
            problems.append(f"{name} has {count} partitions, expected {partitions}")
    input_count = existing.get(names.input, partitions)
    changelog_count = existing.get(names.changelog, input_count)
    if changelog_count != input_count:
        problems.append(
            f"changelog {names.changelog} has {changelog_count} partitions but input "
            f"{names.input} has {input_count}; they must be equal (state of input partition p "
            "lives in changelog partition p)"
        )
    compacted_existing = tuple(name for name in names.compacted if name in existing)
    for name, policy in _cleanup_policies(admin, compacted_existing).items():
        if "compact" not in policy.split(","):
            problems.append(f"{name} must be compacted (cleanup.policy=compact), has {policy!r}")
    if problems:
        raise TopicConfigurationMismatch("; ".join(problems))


def _partition_counts(admin: AdminClient, topics: list[str]) -> dict[str, int]:
    """Partition counts of those of `topics` that exist."""
    metadata = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
    return {
        name: len(metadata.topics[name].partitions) for name in topics if name in metadata.topics
    }


def _cleanup_policies(admin: AdminClient, topics: tuple[str, ...]) -> dict[str, str]:
    if not topics:
        return {}  # describe_configs refuses an empty request
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in topics]
    futures = admin.describe_configs(resources, request_timeout=ADMIN_TIMEOUT_S)
    return {
        resource.name: future.result(timeout=ADMIN_TIMEOUT_S)["cleanup.policy"].value
        for resource, future in futures.items()
    }


# --- CLI -----------------------------------------------------------------------------------------


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("topics", help="manage the pipeline's Kafka topics")
    actions = parser.add_subparsers(dest="topics_action", required=True, metavar="ACTION")
    ensure = actions.add_parser(
        "ensure",
        help="create missing topics, validate existing ones (idempotent)",
        description=(
            "Create the pipeline's topics and validate existing ones: partition counts, "
            "compaction of completions and changelog, changelog partitions == input partitions."
        ),
    )
    add_bootstrap_servers(ensure)
    ensure.add_argument(
        "--partitions", type=int, default=DEFAULT_PARTITIONS, help="partitions per topic"
    )
    ensure.add_argument("--replication-factor", type=int, default=1)
    for role, field in TopicNames.model_fields.items():
        ensure.add_argument(
            f"--{role.replace('_', '-')}-topic", dest=f"{role}_topic", default=field.default
        )
    ensure.set_defaults(func=_cli_ensure)


def _cli_ensure(args: argparse.Namespace) -> int:
    names = TopicNames(**{role: getattr(args, f"{role}_topic") for role in TopicNames.model_fields})
    try:
        result = ensure_topics(
            args.bootstrap_servers, names, args.partitions, args.replication_factor
        )
    except TopicConfigurationMismatch as error:
        print(f"detok topics ensure: refused: {error}", file=sys.stderr)
        return 1
    except KafkaException as error:
        print(f"detok topics ensure: Kafka error: {error}", file=sys.stderr)
        return 1
    for name in result.created:
        print(f"created   {name}")
    for name in result.validated:
        print(f"validated {name}")
    return 0
