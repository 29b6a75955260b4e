"""The worker's timeline: phases per process and per assignment, as the run summary reports
them (bench_e2e prints them for a worker joining a group)."""

from __future__ import annotations

import time

from workers.runtime.timeline import Timeline, process_started_at


def test_process_start_is_before_now_and_after_boot() -> None:
    started = process_started_at()
    assert started <= time.time()
    assert started > time.time() - 24 * 3600 * 365  # a wall-clock time, not ticks since boot


def test_each_assignment_keeps_the_first_time_each_phase_is_reached() -> None:
    timeline = Timeline(started_at=time.time() - 2.0)
    timeline.mark("subscribed")
    timeline.assigned([])  # a cooperative rebalance's first round: the join, nothing assigned
    timeline.assigned([3, 2])
    timeline.mark_partitions("restored", [2, 3])
    timeline.mark_partitions("first records", [9])  # not ours: nothing recorded
    timeline.mark_partitions("first records", [3])
    first_commit_at = time.time()
    timeline.mark_partitions("first commit", [3], at=first_commit_at)
    timeline.mark_partitions("first commit", [2], at=first_commit_at + 5)  # not the first
    timeline.assigned([5])
    timeline.mark_partitions("first records", [3, 5])

    summary = timeline.summary()
    assert set(summary["since_start_s"]) == {"subscribed", "joined"}
    assert summary["since_start_s"]["joined"] >= 2.0
    first, second = summary["assignments"]
    assert first["partitions"] == [2, 3] and second["partitions"] == [5]
    assert list(first["since_assignment_s"]) == ["restored", "first records", "first commit"]
    phases = first["since_assignment_s"]
    assert 0 <= phases["restored"] <= phases["first records"] <= phases["first commit"]
    assert phases["first commit"] < 5
    assert list(second["since_assignment_s"]) == ["first records"]
