"""A producer the Kafka client made unusable is replaced inside the worker (issue 12, item 3).

librdkafka declares an idempotent producer's sequence state lost (a fatal
OUT_OF_ORDER_SEQUENCE_NUMBER) only after a partition leader dies with records in flight, and a
transactional call that never returns was seen only after a whole cluster restarted: neither
happens on demand (tests/integration/test_cluster_faults.py causes them for real, when they
happen). Here a real producer, subclassed, raises that fatal error from a real
`commit_transaction`, and the next producer's `commit_transaction` blocks on an event, with the
records of its open transaction already on the broker. The worker must replace each in process
(the replacement's init_transactions fences the old instance and aborts its transaction), roll
back, and end with the same completions as `detok run`, deltas that tile every request exactly
once, no dead letter, and exit 0.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from tests.integration.conftest import unique_name
from tests.integration.worker_harness import (
    assert_deltas_cover_exactly_once,
    completions_on,
    make_generations,
    models,
    offline_completions,
    pipeline_topics,
    read_messages,
    write_jsonl,
)
from workers.io.replay import replay
from workers.kafka.clients import PRODUCER_DEFAULTS, KafkaConnection
from workers.runtime import checkpointing, worker
from workers.runtime.output_limits import read_output_limits
from workers.runtime.prometheus import PrometheusMetrics
from workers.runtime.settings import WorkerSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 150


class ScriptedProducer(Producer):
    """A real producer whose `at`-th `commit_transaction` fails as `fault` says: "sequence"
    raises librdkafka's fatal lost-sequence error, "wedge" never returns (until the test
    releases it), None commits."""

    def __init__(
        self, config: dict[str, Any], fault: str | None, at: int, release: threading.Event
    ) -> None:
        super().__init__(config)
        self.fault = fault
        self.at = at
        self.release = release
        self.commits = 0

    def commit_transaction(self, *args: Any) -> None:
        self.commits += 1
        if self.commits == self.at and self.fault == "sequence":
            raise KafkaException(
                KafkaError(
                    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
                    "injected: sequence desynchronization",
                    fatal=True,
                )
            )
        if self.commits == self.at and self.fault == "wedge":
            self.release.wait()
            raise KafkaException(KafkaError(KafkaError._FENCED, fatal=True))
        super().commit_transaction(*args)


def test_a_lost_and_a_wedged_producer_are_replaced_with_output_exactly_once(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_jsonl(tmp_path / "generations.jsonl", make_generations(REQUESTS, seed=31))
    expected = offline_completions(source, models().registry())
    names = pipeline_topics(kafka_bootstrap)
    replay(kafka_bootstrap, source, names.input, progress=False)

    # The first producer fails at its second commit, with committed state to restore; the
    # second at its first, the re-processing of the batch the first one lost.
    faults = iter([("sequence", 2), ("wedge", 1)])
    release = threading.Event()
    made: list[ScriptedProducer] = []

    def make_producer(connection: KafkaConnection, settings: dict[str, Any]) -> Producer:
        config = connection.client_config({**PRODUCER_DEFAULTS, **settings})
        made.append(ScriptedProducer(config, *next(faults, (None, 0)), release))
        return made[-1]

    monkeypatch.setattr(worker, "make_producer", make_producer)
    # The wedge is noticed after the call's timeout plus this: short, so the test is.
    monkeypatch.setattr(checkpointing, "WEDGED_CALL_SLACK_S", 1.0)
    spec = models()
    settings = WorkerSettings(
        bootstrap_servers=kafka_bootstrap,
        tokenizers=list(spec.specs),
        model_vocab_sizes=list(spec.vocab_specs),
        group=unique_name("g"),
        instance_id="w0",
        topics=names,
        # Small batches committed at once: many transactions, so each fault lands mid-stream.
        commit_interval_ms=10,
        max_batch=20,
        exit_when_idle_s=5.0,  # longer than a wedge takes to notice (2 s timeout + 1 s)
    )
    metrics = PrometheusMetrics(spec.registry().names, registry=None)
    limits = read_output_limits(settings.connection, names, 30.0, lambda: False)
    try:
        code = worker.Worker(settings, spec.registry(), metrics, limits).run()
    finally:
        release.set()

    assert code == 0
    assert [p.fault for p in made] == ["sequence", "wedge", None]
    assert all(p.commits >= p.at for p in made[:2])
    replaced = metrics.producer_replacements
    assert replaced.labels(cause="producer_state_lost")._value.get() == 1
    assert replaced.labels(cause="wedged_call")._value.get() == 1
    assert metrics.transaction_aborts.labels(cause="producer_replaced")._value.get() == 2
    assert completions_on(kafka_bootstrap, names) == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
    assert list(read_messages(kafka_bootstrap, names.dead_letters)) == []
