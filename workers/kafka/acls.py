"""The least-privilege ACLs of each detok role, created through the AdminClient.

A cluster that enforces ACLs (StandardAuthorizer with `allow.everyone.if.no.acl.found=false`,
Confluent Cloud, Strimzi's simple authorization) lets a principal do only what an ACL grants.
Each role holds what its commands were seen to need on the secured local broker (Kafka 4.4;
tests/integration/test_secured_pipeline.py runs the pipeline with exactly these):

- worker: READ the input; READ+WRITE the changelog; WRITE deltas, completions, metrics, dead
  letters and control (stop signals); DESCRIBE_CONFIGS on all seven topics (start-up reads each
  topic's max.message.bytes to size what it writes: refused without it); READ its consumer
  group `G` (refused without it) and `G-restore` (the changelog restore assigns partitions and
  commits nothing, but its client still looks up the group's coordinator, which needs
  DESCRIBE, implied by READ); WRITE its transactional ids (prefix `detok-G-`;
  init_transactions is refused without it).
- reader: READ deltas, completions and metrics, and groups with prefix `detok-collect-` (the
  private group id `detok collect` reads under; it too only looks up the coordinator).
- producer: WRITE and DESCRIBE_CONFIGS the input (replay sizes records by the input's limit);
  READ the dead letters and groups with prefix `detok-redrive-`, for `detok dlq redrive`; READ
  the control topic and groups with prefix `detok-stop-signals-`, for an engine's
  `workers.io.publish.StopSignals` (it assigns partitions and commits nothing, but looks up its
  group's coordinator like the restore above).

Kafka implies DESCRIBE from READ or WRITE, and DESCRIBE on a transactional id from WRITE, so no
DESCRIBE ACL is listed; IdempotentWrite on the cluster is not needed since Kafka 3.0 (KIP-679):
the pipeline runs without either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from workers.kafka.clients import KafkaConnection, cluster_metadata, kafka_error_text, make_admin
from workers.kafka.topic_names import TopicNames

Role = Literal["worker", "reader", "producer"]
ROLES: tuple[Role, ...] = ("worker", "reader", "producer")
DEFAULT_GROUPS: dict[Role, str] = {
    "worker": "detok-workers",
    "reader": "detok-collect-",
    "producer": "detok-redrive-",
}
# The private group ids `workers.io.publish.StopSignals` reads under (the producer role: the
# engine that publishes also receives its stop signals). Defined here, below the library.
STOP_SIGNALS_GROUP_PREFIX = "detok-stop-signals-"
# Creating a handful of ACLs takes milliseconds on a live cluster; 30 s covers a controller that
# is still starting without letting the command hang.
ADMIN_TIMEOUT_S = 30.0
# The wait for each answer outlasts the request's own timeout by this much, so a request that
# timed out says so (librdkafka's error) instead of the wait ending first with no cause at all.
ANSWER_MARGIN_S = 5.0

READ, WRITE = AclOperation.READ, AclOperation.WRITE
DESCRIBE_CONFIGS = AclOperation.DESCRIBE_CONFIGS


class AclError(Exception):
    """The cluster refused or failed to create an ACL."""


@dataclass(frozen=True)
class Grant:
    """One ACL: `principal` may do `operation` on a resource (by name or name prefix)."""

    resource: ResourceType
    name: str
    operation: AclOperation
    prefixed: bool = False

    def binding(self, principal: str) -> AclBinding:
        pattern = ResourcePatternType.PREFIXED if self.prefixed else ResourcePatternType.LITERAL
        return AclBinding(
            self.resource, self.name, pattern, principal, "*", self.operation,
            AclPermissionType.ALLOW,
        )  # fmt: skip

    def describe(self, principal: str) -> str:
        pattern = "prefix" if self.prefixed else "name"
        return (
            f"ALLOW {principal} {self.operation.name} on {self.resource.name} "
            f"{pattern} {self.name!r}"
        )


def _topics(names: Iterable[str], *operations: AclOperation) -> list[Grant]:
    return [Grant(ResourceType.TOPIC, name, op) for name in names for op in operations]


def role_grants(role: Role, names: TopicNames, group: str | None = None) -> list[Grant]:
    """The ACLs of `role` for the pipeline topics `names` (see the module docstring).

    `group` is the worker's consumer group (literal), or the reader's / producer's group prefix.
    """
    group = group or DEFAULT_GROUPS[role]
    if role == "worker":
        return [
            *_topics([names.input], READ),
            *_topics([names.changelog], READ, WRITE),
            *_topics(
                [names.deltas, names.completions, names.metrics, names.dead_letters, names.control],
                WRITE,
            ),
            *_topics(names.model_dump().values(), DESCRIBE_CONFIGS),
            Grant(ResourceType.GROUP, group, READ),
            Grant(ResourceType.GROUP, f"{group}-restore", READ),
            Grant(ResourceType.TRANSACTIONAL_ID, f"detok-{group}-", WRITE, prefixed=True),
        ]
    if role == "reader":
        return [
            *_topics([names.deltas, names.completions, names.metrics], READ),
            Grant(ResourceType.GROUP, group, READ, prefixed=True),
        ]
    return [
        *_topics([names.input], WRITE, DESCRIBE_CONFIGS),
        *_topics([names.dead_letters, names.control], READ),
        Grant(ResourceType.GROUP, group, READ, prefixed=True),
        Grant(ResourceType.GROUP, STOP_SIGNALS_GROUP_PREFIX, READ, prefixed=True),
    ]


def grant(
    connection: KafkaConnection,
    principal: str,
    grants: list[Grant],
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> None:
    """Create `grants` for `principal` (idempotent: an existing ACL is not duplicated).

    The cluster is asked for its metadata first, so no broker (KafkaUnavailable) and a refused
    login (KafkaException, from `RefusalWatch`) are named within `timeout_s` instead of as an
    ACL request that timed out without a cause.
    """
    admin = make_admin(connection)
    cluster_metadata(admin, timeout_s)
    futures = admin.create_acls([g.binding(principal) for g in grants], request_timeout=timeout_s)
    for binding, future in futures.items():
        what = f"creating {binding.restype.name} {binding.name!r}"
        try:
            future.result(timeout=timeout_s + ANSWER_MARGIN_S)
        except KafkaException as error:
            raise AclError(f"{what}: {kafka_error_text(error)}") from None
        except TimeoutError:
            raise AclError(
                f"{what}: the cluster at {connection.bootstrap_servers} did not answer within "
                f"{timeout_s + ANSWER_MARGIN_S:.0f} s"
            ) from None
