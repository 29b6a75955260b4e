"""Static group membership: a worker restarted under its instance id gets its partitions back
without a rebalance, and the output stays exactly once (issue 15 item 5)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    assert_deltas_cover_exactly_once,
    completions_on,
    make_generations,
    models,
    offline_completions,
    paced_replay,
    pipeline_topics,
    start_worker,
    stop,
    wait_exit,
    write_jsonl,
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


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_BOUND_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_static_member_restarted_in_its_session_keeps_its_partitions_without_a_rebalance(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    source = write_jsonl(tmp_path / "generations.jsonl", make_generations(120, seed=41))
    expected = offline_completions(source, models().registry())
    names = pipeline_topics(kafka_bootstrap)
    group = unique_name("g")
    producer = paced_replay(kafka_bootstrap, source, names.input, rate=60.0)
    steady_dir, first_dir, again_dir = (tmp_path / d for d in ("steady", "first", "again"))
    for directory in (steady_dir, first_dir, again_dir):
        directory.mkdir()
    steady = start_worker(
        kafka_bootstrap, names, group, instance_id="steady", extra=STATIC, log_dir=steady_dir
    )
    steady_log = lambda: next(steady_dir.iterdir())  # noqa: E731
    wait_for(lambda: "restored" in steady_log().read_text(), "the first worker's restore")
    first = start_worker(
        kafka_bootstrap, names, group, instance_id="member-b", extra=STATIC, log_dir=first_dir
    )
    first_log = lambda: next(first_dir.iterdir())  # noqa: E731
    wait_for(lambda: "restored" in first_log().read_text(), "the second worker's restore")
    before = steady_log().read_text()

    first.send_signal(signal.SIGKILL)
    first.wait()
    again = start_worker(
        kafka_bootstrap,
        names,
        group,
        instance_id="member-b",
        extra=[*STATIC, "--exit-when-idle", "4"],
        log_dir=again_dir,
    )
    again_log = lambda: next(again_dir.iterdir())  # noqa: E731
    wait_for(lambda: assignments(again_log()), "the restarted worker's assignment")
    producer.join()
    assert wait_exit(again) == 0
    assert stop(steady) == 0

    # Its own partitions back, at once, and the other member never noticed: no revoke, no new
    # assignment between the kill and its own stop.
    assert assignments(again_log())[0] == assignments(first_log())[-1]
    during = steady_log().read_text()[len(before) :].split("signal 15")[0]
    assert "revoked partitions" not in during and "assigned partitions" not in during
    assert completions_on(kafka_bootstrap, names) == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
