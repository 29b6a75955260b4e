"""At-least-once after kill -9 (issue 16 item 11): replayed deltas repeat text, and a reader
that places each delta at its `text_offset` gets exactly the completion's text.

Deduplicating by (request_id, seq_end) does not work: a replay may coalesce seqs differently
(a request got deltas for seq 1..4, then 1..14), so the same text arrives under other ranges.
Text is a function of the ids, so overlapping deltas agree where they overlap; the offset says
where each belongs.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    read_topic,
    wait_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def reassemble(deltas: list[dict]) -> str:
    """A reader's dedup: each delta's text belongs at its `text_offset`; a repeat must agree
    with what is already there, and nothing may be missing in between."""
    text = ""
    for delta in sorted(deltas, key=lambda d: d["text_offset"]):
        offset, piece = delta["text_offset"], delta["text"]
        assert offset <= len(text), f"a gap before offset {offset}"
        overlap = text[offset : offset + len(piece)]
        assert piece.startswith(overlap), "a replayed delta disagrees with the first"
        text = text[:offset] + piece if offset + len(piece) > len(text) else text
    return text


def test_deltas_reassembled_by_offset_give_the_completion_after_kill_9(
    pipeline_run: NewPipelineRun,
) -> None:
    run = pipeline_run(make_generations(240, seed=17))
    alos = ["--guarantee", "at-least-once"]
    producer = run.paced_replay(rate=40.0)
    for _ in range(2):
        worker = run.start_worker("alos", extra=alos)
        run.wait_for_first_commit(worker, producer)  # joined, restored, committed some
        worker.kill()  # SIGKILL: outputs out, offsets maybe not: a replay follows
        worker.wait()
    producer.join()
    worker = run.start_worker("alos", extra=[*alos, "--exit-when-idle", "3"])
    assert wait_exit(worker) == 0

    completions = run.completions()
    assert completions == run.expected
    deltas: dict[str, list[dict]] = {}
    for _, value, _ in read_topic(run.bootstrap, run.names.deltas):
        delta = json.loads(value)
        deltas.setdefault(delta["request_id"], []).append(delta)
    for request_id, completion in completions.items():
        if completion["status"] == "ok":
            assert reassemble(deltas.get(request_id, [])) == completion["text"], request_id


def test_a_member_giving_partitions_to_a_joiner_commits_them_in_its_revoke_callback(
    pipeline_run: NewPipelineRun,
) -> None:
    """A rebalance under at-least-once: the member giving partitions up commits their offsets in
    its revoke callback, on the callback's thread. (Made from the bounded commit's own thread,
    that commit deadlocked until its 120 s budget ended, and the worker exited 1.)"""
    run = pipeline_run(make_generations(240, seed=23))
    alos = ["--guarantee", "at-least-once", "--exit-when-idle", "4"]
    producer = run.paced_replay(rate=40.0)
    # After its first commit (made at once for a new assignment) the first worker's next one is
    # a minute away, so the records it handles meanwhile are open when the joiner arrives: its
    # revoke callback has offsets to commit.
    first = run.start_worker("first", extra=[*alos, "--commit-interval-ms", "60000"])
    run.wait_for_first_commit(first, producer)
    joiner = run.start_worker("joiner", extra=alos)
    producer.join()
    codes = {"first": wait_exit(first), "joiner": wait_exit(joiner)}
    first_log = run.log_of(first).read_text()
    assert codes == {"first": 0, "joiner": 0}, first_log[-4000:]
    assert "revoked partitions [" in first_log  # the joiner took some
    assert "commit on revoke failed" not in first_log
    assert run.completions() == run.expected
