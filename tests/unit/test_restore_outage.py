"""A restore that starts while no broker answers (every broker of a cluster restarting): its
metadata lookup fails, and the restore must still wait for the cluster or a stop, never end the
worker. A real client against a closed port stands in for the unreachable cluster."""

from __future__ import annotations

import pytest

from workers.kafka.clients import KafkaConnection
from workers.runtime import changelog
from workers.runtime.changelog import RestoreInterrupted, read_latest

NOTHING_LISTENS = KafkaConnection("127.0.0.1:9")


def test_a_restore_waits_for_an_unreachable_cluster_until_stopped(monkeypatch) -> None:
    """The metadata lookup before reading only saves librdkafka's slower schedule: when it
    fails the restore goes on waiting (and logs that it does), and a stop ends the wait."""
    monkeypatch.setattr(changelog, "METADATA_TIMEOUT_S", 0.2)
    asked: list[bool] = []

    def should_stop() -> bool:  # the stop arrives after a few polls of the reading loop
        asked.append(True)
        return len(asked) > 3

    with pytest.raises(RestoreInterrupted):
        read_latest(NOTHING_LISTENS, "g", "detok.state-changelog", [0, 1], should_stop)
    assert len(asked) == 4
