"""Static group membership: a worker restarted under its instance id gets its partitions back
without a rebalance, and the output stays exactly once (issue 15 item 5)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    stop,
    wait_exit,
    wait_until,
)

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
