"""Static group membership: a worker restarted under its instance id gets its partitions back
without a rebalance, and the output stays exactly once (issue 15 item 5)."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.integration.conftest import consumer_config, poll_until, unique_name
from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    stop,
    wait_exit,
    wait_until,
)
from workers.runtime.checkpointing import same_member_next_generation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ASSIGNED = re.compile(r"assigned partitions \[(\d[\d, ]*)\]")
# Longer than the kill and restart take (tokenizers load in seconds): the restarted worker is
# back before the group would give its partitions away.
STATIC = ["--static-membership", "--session-timeout-ms", "60000"]


def assignments(log: Path) -> list[list[int]]:
    """The non-empty assignments a worker logged, in order."""
    return [
        sorted(int(p) for p in m.group(1).split(",")) for m in ASSIGNED.finditer(log.read_text())
    ]


def settled_after_a_revoke(log: Path) -> bool:
    """True once a member that gave partitions away has had the rebalance's last callback.

    Under cooperative-sticky a join is two rounds: the member first revokes what moves, then gets
    its (here empty) incremental assignment. The joiner logs "restored" after its own round two,
    which can come before the steady member's round-two callback is logged, so a test reading the
    steady log must wait for that callback first."""
    text = log.read_text()
    revoked = text.rfind("revoked partitions")
    return revoked != -1 and text.rfind("assigned partitions") > revoked


def test_a_static_member_restarted_in_its_session_keeps_its_partitions_without_a_rebalance(
    pipeline_run: NewPipelineRun,
) -> None:
    run = pipeline_run(make_generations(120, seed=41))
    producer = run.paced_replay(rate=60.0)
    steady = run.start_worker("steady", extra=STATIC)
    run.wait_for_log(steady, "restored")
    first = run.start_worker("member-b", extra=STATIC)
    run.wait_for_log(first, "restored")
    steady_log, first_log = run.log_of(steady), run.log_of(first)
    wait_until(lambda: settled_after_a_revoke(steady_log), "the steady member's rebalance")
    before = steady_log.read_text()

    first.send_signal(signal.SIGKILL)
    first.wait()
    again = run.start_worker("member-b", extra=[*STATIC, "--exit-when-idle", "4"])
    again_log = run.log_of(again)
    wait_until(lambda: bool(assignments(again_log)), "the restarted worker's assignment")
    producer.join()
    assert wait_exit(again) == 0
    assert stop(steady) == 0

    # Its own partitions back, at once, and the other member never noticed: no revoke, no new
    # assignment between the kill and its own stop.
    assert assignments(again_log)[0] == assignments(first_log)[-1]
    during = steady_log.read_text()[len(before) :].split("signal 15")[0]
    assert "revoked partitions" not in during and "assigned partitions" not in during
    run.assert_exactly_once()


def test_group_metadata_names_the_same_member_under_each_new_generation(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    """What the exactly-once strategy relies on to commit a transaction again after the group
    refused it as sent under an old generation (workers/runtime/checkpointing.py,
    RECOMMIT_ATTEMPTS): librdkafka's serialised group metadata of a member that stays in the group
    through a rebalance differs from its earlier one in the generation alone, while a different
    member's never passes as the same member."""
    topic = create_topic("cgmd", partitions=2)
    group = unique_name("cgmd")
    config = {"partition.assignment.strategy": "cooperative-sticky"}
    first = Consumer(consumer_config(kafka_bootstrap, group, **config))
    second = Consumer(consumer_config(kafka_bootstrap, group, **config))
    assigned: dict[str, int] = {"first": 0, "second": 0}

    def counting(name: str) -> Callable[[Consumer, list[TopicPartition]], None]:
        def on_assign(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            consumer.incremental_assign(partitions)
            assigned[name] += len(partitions)

        return on_assign

    try:
        first.subscribe([topic], on_assign=counting("first"))
        poll_until([first], lambda: assigned["first"] == 2, lambda c, m: None)
        before = first.consumer_group_metadata()
        second.subscribe([topic], on_assign=counting("second"))
        poll_until([first, second], lambda: assigned["second"] == 1, lambda c, m: None)
        after = first.consumer_group_metadata()
        assert same_member_next_generation(before, after)
        assert not same_member_next_generation(before, second.consumer_group_metadata())
        assert not same_member_next_generation(before, before)
    finally:
        first.close()
        second.close()
