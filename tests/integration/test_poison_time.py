"""Issue 16 items 9 and 10: the request TTL and the finished-request retention.

- A backlog never expires requests whose events are waiting in it (item 9): the TTL measures how
  long a request's *input* was silent, not how long the worker was away.
- A late duplicate prompt cannot reopen a finished request and replace its `ok` completion with
  a failed one (item 10).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.poison_harness import (
    Record,
    assert_good_requests_completed,
    completions,
    expected_completions,
    generation_values,
    new_pipeline,
    produce,
    prompt,
    read_records,
    run_worker_until_idle,
    started_worker,
    wait_for_keys,
)
from tests.integration.worker_harness import make_generations

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL_S = 20


def test_item9_backlog_behind_an_outage_longer_than_the_ttl_still_completes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """200 requests open (prompt and first chunk) and are snapshotted by a first worker; the
    rest of their events are produced on time, but the next worker starts only after more than
    the TTL: every request must complete `ok` from the backlog."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    generations = make_generations(200, seed=909)
    expected = expected_completions(generations, tmp_path)
    opened, rest = [], []
    for generation in generations:
        key, values = generation["request_id"].encode(), generation_values(generation)
        split = 2 if len(values) > 2 else 1  # prompt and first chunk; never the finish
        opened += [Record(key, value) for value in values[:split]]
        rest += [Record(key, value) for value in values[split:]]

    opened_at = time.monotonic()
    produce(kafka_bootstrap, pipeline.names.input, opened)
    first = run_worker_until_idle(
        pipeline, "--request-ttl", str(TTL_S), idle_s=1, instance_id="before-outage"
    )
    assert first.process.returncode == 0, first.tail()
    assert time.monotonic() - opened_at < TTL_S, (
        "setup too slow: the first worker must stop before the requests' TTL passes"
    )
    produce(kafka_bootstrap, pipeline.names.input, rest)  # upstream is on time

    # The outage: no worker runs for longer than the TTL.
    time.sleep(max(0.0, opened_at + TTL_S + 8 - time.monotonic()))

    second = run_worker_until_idle(
        pipeline, "--request-ttl", str(TTL_S), idle_s=3, instance_id="after-outage"
    )
    assert second.process.returncode == 0, second.tail()
    published = completions(pipeline)
    failed = sorted(rid for rid, c in published.items() if c["status"] != "ok")
    assert not failed, f"{len(failed)} of {len(expected)} requests failed: {failed[:5]}"
    assert_good_requests_completed(pipeline, expected)


def test_item10_late_duplicate_prompt_after_retention_keeps_the_ok_completion(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """With a 2 s finished-request retention (DETOK_FINISHED_RETENTION_S) and a 4 s TTL, a
    duplicate prompt arriving 5 s after the finish must not reopen the request: the compacted
    completions topic's latest record for it stays the `ok` one."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    generation = make_generations(2, seed=1010)[1]
    request_id = generation["request_id"]
    key = request_id.encode()
    expected = expected_completions([generation], tmp_path)
    values = generation_values(generation)
    produce(kafka_bootstrap, pipeline.names.input, [Record(key, value) for value in values])

    with started_worker(
        pipeline,
        "--request-ttl", "4",
        "--exit-when-idle", "12",  # outlives the TTL after the duplicate arrives
        env={"DETOK_FINISHED_RETENTION_S": "2"},
    ) as worker:  # fmt: skip
        wait_for_keys(kafka_bootstrap, pipeline.names.completions, {key})
        assert completions(pipeline)[request_id] == expected[request_id]
        time.sleep(5)  # the finished-request marker is past its retention
        duplicate = prompt(request_id, generation["model"], generation["prompt_token_ids"])
        produce(kafka_bootstrap, pipeline.names.input, [Record(key, duplicate)])
        code = worker.wait()
        assert code == 0, worker.tail()

    history = [
        record.value
        for record in read_records(kafka_bootstrap, pipeline.names.completions)
        if record.key == key
    ]
    assert completions(pipeline)[request_id] == expected[request_id], (
        f"the ok completion was replaced ({len(history)} completions for {request_id})"
    )
