"""How a worker fails: a fenced (zombie) worker stops with a non-zero exit and loses nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.conftest import unique_name
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
    source = write_jsonl(tmp_path / "generations.jsonl", make_generations(160, seed=31))
    expected = offline_completions(source, models().registry())
    names = pipeline_topics(kafka_bootstrap)
    group = unique_name("g")
    producer = paced_replay(kafka_bootstrap, source, names.input, rate=60.0)
    zombie = start_worker(kafka_bootstrap, names, group, instance_id="same", log_dir=tmp_path)
    time.sleep(5)
    # Same instance id, so the same transactional id: the newcomer's init_transactions fences
    # the first worker, whose next commit fails fatally.
    successor = start_worker(
        kafka_bootstrap,
        names,
        group,
        instance_id="same",
        extra=["--exit-when-idle", "4"],
        log_dir=tmp_path,
    )
    assert wait_exit(zombie) != 0
    producer.join()
    assert wait_exit(successor) == 0
    assert completions_on(kafka_bootstrap, names) == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
