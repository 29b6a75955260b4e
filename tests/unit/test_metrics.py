"""PrometheusMetrics: Prometheus naming conventions, pre-initialised labels, and what each
observation does to the exposition a scraper reads."""

from __future__ import annotations

import json
import socket
import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.processor import BatchResult
from schemas.events import Completion, DeadLetterReason, FilteredIdsRecord
from workers.runtime.prometheus import EVENT_TYPES, PrometheusMetrics

MODELS = ("gpt2", "qwen2")
# Bounds on label values per series, from the Prometheus instrumentation guide: keep labelled
# metrics under about 10 values, investigate anything over 100.
MAX_LABEL_VALUES = 16


def samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: PrometheusMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_names_follow_prometheus_conventions() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    for family in metrics.registry.collect():
        assert family.name.startswith("detok_"), family.name
        names = {sample.name for sample in family.samples}
        if family.type == "counter":
            assert all(n.endswith(("_total", "_created")) for n in names), names
        if family.type == "histogram" or "duration" in family.name:
            # Durations in base units: seconds, never ms.
            assert family.name.endswith(("_seconds", "_events")), family.name
        if "timestamp" in family.name:
            assert family.name.endswith("_timestamp_seconds"), family.name
        for sample in family.samples:
            assert "request_id" not in sample.labels, family.name


def test_bounded_labels_are_pre_initialised_to_zero() -> None:
    scraped = samples(PrometheusMetrics(MODELS, registry=None))
    for event_type in EVENT_TYPES:
        assert scraped[("detok_events_consumed_total", (("type", event_type),))] == 0
    for reason in DeadLetterReason:
        assert scraped[("detok_dead_letters_total", (("reason", reason.value),))] == 0
    for model in MODELS:
        assert scraped[("detok_prompt_ids_filtered_total", (("model", model),))] == 0
    for outcome in ("committed", "aborted"):
        assert scraped[("detok_transactions_total", (("outcome", outcome),))] == 0
    for event in ("assign", "revoke", "lost"):
        assert scraped[("detok_rebalances_total", (("event", event),))] == 0
    per_family: dict[str, set] = {}
    for name, labels in scraped:
        per_family.setdefault(name, set()).add(labels)
    assert all(len(values) <= MAX_LABEL_VALUES for values in per_family.values())


def test_build_info_names_version_and_models() -> None:
    scraped = samples(PrometheusMetrics(MODELS, registry=None))
    (labels,) = [labels for name, labels in scraped if name == "detok_build_info"]
    assert dict(labels)["models"] == "gpt2,qwen2"
    assert dict(labels)["version"]


def test_a_batch_and_its_outputs_are_counted_once() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    result = BatchResult()
    result.events_by_type.update(prompt=2, tokens=5, finish=1)
    result.decoded_tokens = 40
    result.duplicates = 1
    result.completions.append(
        Completion(
            request_id="r1", model="qwen2", text="hi", status="ok", prompt_tokens=3,
            generated_tokens=40, filtered_prompt_ids=[151700, 151800],
        )
    )  # fmt: skip
    result.filtered_ids.append(
        FilteredIdsRecord(
            request_id="r1", model="qwen2", filtered_ids=[151700, 151800], filtered_count=2,
            prompt_tokens=3,
        )
    )  # fmt: skip
    metrics.observe_batch(result, events=8, seconds=0.002)
    metrics.observe_outputs(result)

    assert value(metrics, "detok_events_consumed_total", type="tokens") == 5
    assert value(metrics, "detok_generated_tokens_decoded_total") == 40
    assert value(metrics, "detok_duplicate_events_total") == 1
    assert value(metrics, "detok_completions_produced_total", status="ok") == 1
    assert value(metrics, "detok_prompt_ids_filtered_total", model="qwen2") == 2
    assert value(metrics, "detok_prompt_ids_filtered_total", model="gpt2") == 0
    assert value(metrics, "detok_metric_events_produced_total") == 1
    assert value(metrics, "detok_batch_events_count") == 1
    assert value(metrics, "detok_batch_events_sum") == 8
    assert value(metrics, "detok_decode_duration_seconds_count") == 1


def test_only_real_records_move_the_last_processed_timestamp() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    metrics.observe_consumed(0, now=1_700_000_000.0)  # a poll of partition EOFs only
    assert value(metrics, "detok_last_processed_timestamp_seconds") == 0
    metrics.observe_consumed(3, now=1_700_000_001.0)
    assert value(metrics, "detok_last_processed_timestamp_seconds") == 1_700_000_001.0
    assert value(metrics, "detok_records_consumed_total") == 3


def test_commits_count_by_outcome_and_time_only_successes() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    metrics.observe_commit(0.01, committed=True)
    metrics.observe_commit(0.5, committed=False)
    assert value(metrics, "detok_transactions_total", outcome="committed") == 1
    assert value(metrics, "detok_transactions_total", outcome="aborted") == 1
    assert value(metrics, "detok_commit_duration_seconds_count") == 1


def _statistics(lags: dict[str, int]) -> str:
    """A trimmed librdkafka statistics document: per-partition consumer_lag, -1 when unowned,
    and the internal "-1" partition librdkafka always lists."""
    partitions = {p: {"partition": int(p), "consumer_lag": lag} for p, lag in lags.items()}
    partitions["-1"] = {"partition": -1, "consumer_lag": -1}
    return json.dumps({"name": "rdkafka#consumer-1", "topics": {"t": {"partitions": partitions}}})


def test_consumer_lag_per_partition_drops_partitions_that_moved_away() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    metrics.consumer_statistics(_statistics({"0": 12, "1": 0, "2": -1}))
    lag = {
        dict(labels)["partition"]: v
        for (name, labels), v in samples(metrics).items()
        if name == "detok_consumer_lag_messages"
    }
    assert lag == {"0": 12, "1": 0}

    metrics.consumer_statistics(_statistics({"0": -1, "1": 4}))  # partition 0 was revoked
    lag = {
        dict(labels)["partition"]: v
        for (name, labels), v in samples(metrics).items()
        if name == "detok_consumer_lag_messages"
    }
    assert lag == {"1": 4}


def test_serve_exposes_the_registry_on_the_given_interface() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics.serve(port, "127.0.0.1")
    metrics.observe_consumed(7, now=1.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert "detok_records_consumed_total 7.0" in text


def test_events_after_a_stop_are_exported() -> None:
    metrics = PrometheusMetrics(MODELS, registry=None)
    result = BatchResult()
    result.events_after_stop = 3
    metrics.observe_batch(result, events=3, seconds=0.001)
    assert value(metrics, "detok_events_after_stop_total") == 3
