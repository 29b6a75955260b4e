"""How a worker fails: a fenced (zombie) worker stops with a non-zero exit and loses nothing."""

from __future__ import annotations

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
    wait_exit,
    write_jsonl,
)

pytestmark = pytest.mark.integration


def test_a_fenced_worker_exits_non_zero_and_its_successor_finishes_exactly(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    generations = make_generations(160, seed=31)
    source = write_jsonl(tmp_path / "generations.jsonl", generations)
    expected = offline_completions(source, models().registry())
    # The zombie learns it was fenced only when it next commits, so input must still arrive once
    # the successor has started: the second part is replayed only then. (Replayed on a timer, a
    # zombie that started slowly could finish the whole input first and idle, never fenced.)
    first_part = write_jsonl(tmp_path / "first.jsonl", generations[:100])
    second_part = write_jsonl(tmp_path / "second.jsonl", generations[100:])
    names = pipeline_topics(kafka_bootstrap)
    group = unique_name("g")
    producer = paced_replay(kafka_bootstrap, first_part, names.input, rate=60.0)
    zombie_dir, successor_dir = tmp_path / "zombie", tmp_path / "successor"
    zombie_dir.mkdir()
    successor_dir.mkdir()
    zombie = start_worker(kafka_bootstrap, names, group, instance_id="same", log_dir=zombie_dir)
    time.sleep(5)
    # Same instance id, so the same transactional id: the newcomer's init_transactions fences
    # the first worker, whose next commit fails fatally.
    successor = start_worker(
        kafka_bootstrap,
        names,
        group,
        instance_id="same",
        extra=["--exit-when-idle", "4"],
        log_dir=successor_dir,
    )
    _wait_for_log(successor_dir, "assigned partitions")  # it joined: its transactions began
    producer.join()
    paced_replay(kafka_bootstrap, second_part, names.input, rate=60.0).join()
    assert wait_exit(zombie) != 0
    assert wait_exit(successor) == 0
    assert completions_on(kafka_bootstrap, names) == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)


def _wait_for_log(log_dir: Path, text: str) -> None:
    deadline = time.monotonic() + WAIT_BOUND_S
    while not any(text in log.read_text() for log in log_dir.iterdir()):
        if time.monotonic() > deadline:
            pytest.fail(f"no worker logged {text!r} within the wait bound")
        time.sleep(0.1)
