"""The worker's commit bookkeeping, on a worker that never reaches a broker.

What a broker answers is covered by tests/integration; here only what the worker keeps for its
next commit when the group refuses one (a rebalance), which no broker produces on demand.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.small_tokenizers import byte_level
from workers.config import WorkerSettings
from workers.worker import Worker


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    settings = WorkerSettings(
        bootstrap_servers="127.0.0.1:9",  # nothing listens there; the test never waits on it
        tokenizers=[f"bytes={path}"],
        guarantee="at-least-once",
    )
    thresholds = gc.get_threshold()
    worker = Worker(settings, registry)
    yield worker
    gc.unfreeze()  # undo the worker's collector tuning for the rest of the test session
    gc.set_threshold(*thresholds)


def test_offsets_refused_by_a_rebalance_are_offered_again_for_kept_partitions(worker) -> None:
    sent: list[list[TopicPartition]] = []

    def refused(offsets: list[TopicPartition]) -> bool:
        sent.append(offsets)
        return False  # what `_commit_at_least_once` returns for ILLEGAL_GENERATION and kin

    worker._commit_at_least_once = refused
    worker.assigned = {0, 2}  # partition 1 went to another member in the rebalance
    worker.checkpoint.offsets.update({0: 10, 1: 20, 2: 30})
    worker._commit()
    assert [(tp.partition, tp.offset) for tp in sent[0]] == [(0, 10), (1, 20), (2, 30)]
    assert worker.checkpoint.offsets == {0: 10, 2: 30}
    assert worker.stats.commits == 0

    worker._commit_at_least_once = lambda offsets: sent.append(offsets) or True
    worker._commit()
    assert [(tp.partition, tp.offset) for tp in sent[1]] == [(0, 10), (2, 30)]
    assert worker.checkpoint.offsets == {} and worker.stats.commits == 1
