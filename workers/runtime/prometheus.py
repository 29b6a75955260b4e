"""Prometheus metrics of one worker process.

Named by Prometheus conventions: base units (seconds), `_total` counters, no request id as a label
(per-request numbers go to the metrics topic instead), and every label value of a bounded set
pre-initialised so that dashboards show zeros instead of gaps. Updated once per batch or commit,
never per token: the hot loop must not pay for observability.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)

from pipeline.processor import BatchResult
from schemas.events import DeadLetterReason
from workers.runtime.checkpointing import ABORT_CAUSES, REPLACEMENT_CAUSES
from workers.runtime.health import Health
from workers.runtime.health import serve as serve_endpoints

# Where `detok worker --metrics-port` is conventionally served: the Dockerfile, the compose file
# and the Prometheus configurations in deploy/ all use it (a test keeps them in step).
DEFAULT_METRICS_PORT = 9400
EVENT_TYPES = ("prompt", "tokens", "finish")
REBALANCE_EVENTS = ("assign", "revoke", "lost")
# Commit and restore latencies span a few ms (a healthy broker) to seconds (restores, a slow
# broker); decode rounds span tens of microseconds to a few hundred ms.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000)


def _package_version() -> str:
    try:
        return version("detok")
    except PackageNotFoundError:
        return "unknown"


class PrometheusMetrics:
    """The worker's metric objects, on their own registry (several workers may share a process
    in tests; each serves its own)."""

    def __init__(self, models: Iterable[str], registry: CollectorRegistry | None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        models = list(models)
        self._declare_record_counters(r)
        self._declare_commit_metrics(r)
        self._declare_state_metrics(r)
        self.build_info = Info("detok_build", "Version and served models", registry=r)
        self.build_info.info({"version": _package_version(), "models": ",".join(sorted(models))})
        self._label_known_values(models)

    def _declare_record_counters(self, r: CollectorRegistry) -> None:
        """What came in and what went out: events, records, tokens, outputs, dead letters."""
        self.events_consumed = Counter(
            "detok_events_consumed", "Input events parsed, by type", ["type"], registry=r
        )
        self.records_consumed = Counter(
            "detok_records_consumed", "Input records consumed (valid or not)", registry=r
        )
        self.tokens_decoded = Counter(
            "detok_generated_tokens_decoded", "Generated token ids decoded", registry=r
        )
        self.deltas_produced = Counter(
            "detok_deltas_produced", "Text delta records produced", registry=r
        )
        self.completions_produced = Counter(
            "detok_completions_produced", "Completions produced, by status", ["status"], registry=r
        )
        self.stop_signals_produced = Counter(
            "detok_stop_signals_produced",
            "Stop signals produced for engines (requests ended before their finish), by reason",
            ["reason"],
            registry=r,
        )
        self.metric_events_produced = Counter(
            "detok_metric_events_produced", "Filtered-prompt-id metric events produced", registry=r
        )
        self.prompt_ids_filtered = Counter(
            "detok_prompt_ids_filtered",
            "Prompt ids the tokenizer cannot map, dropped while seeding, by model",
            ["model"],
            registry=r,
        )
        self.dead_letters = Counter(
            "detok_dead_letters",
            "Records sent to the dead-letter topic, by reason",
            ["reason"],
            registry=r,
        )
        self.duplicates = Counter(
            "detok_duplicate_events", "Input events dropped as duplicates", registry=r
        )
        self.events_after_stop = Counter(
            "detok_events_after_stop",
            "Input events consumed without output after a stop string ended their request",
            registry=r,
        )

    def _declare_commit_metrics(self, r: CollectorRegistry) -> None:
        """Transactions and commits: outcomes, aborts, replacements, stalls, durations."""
        self.transactions = Counter(
            "detok_transactions", "Commits, by outcome", ["outcome"], registry=r
        )
        self.transaction_aborts = Counter(
            "detok_transaction_aborts",
            "Transactions aborted, by cause (their batch is re-processed from restored state)",
            ["cause"],
            registry=r,
        )
        self.transactions_recommitted = Counter(
            "detok_transactions_recommitted",
            "Transactions a rebalance refused (a new group generation) and that were committed "
            "again unchanged under it: neither aborted nor redone",
            registry=r,
        )
        self.producer_replacements = Counter(
            "detok_producer_replacements",
            "Producers replaced in process, by cause (the worker then rolls back and restores)",
            ["cause"],
            registry=r,
        )
        # A stall is work waiting while nothing commits: a broker outage, a coordinator that
        # moved, a worker wedged. Read on scrape, so it grows while the loop is blocked too.
        # Nothing to commit counts as committed, so an idle worker does not look stalled.
        self._last_commit = time.monotonic()
        self.seconds_since_last_commit = Gauge(
            "detok_seconds_since_last_commit",
            "Seconds since the worker last committed (or last had nothing to commit)",
            registry=r,
        )
        self.seconds_since_last_commit.set_function(lambda: time.monotonic() - self._last_commit)
        self.commit_duration = Histogram(
            "detok_commit_duration_seconds",
            "Time to commit a checkpoint",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _declare_state_metrics(self, r: CollectorRegistry) -> None:
        """Batches, live state, restores, rebalances and lag."""
        self.batch_size = Histogram(
            "detok_batch_events",
            "Valid events per decoded batch",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.decode_duration = Histogram(
            "detok_decode_duration_seconds",
            "Time to process one batch (sequence + decode)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_requests = Gauge(
            "detok_active_requests", "Requests with live decode state", registry=r
        )
        self.partitions_restoring = Gauge(
            "detok_partitions_restoring", "Assigned partitions still restoring state", registry=r
        )
        self.restore_duration = Histogram(
            "detok_state_restore_duration_seconds",
            "Time to restore partitions from the changelog",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.changelog_records_skipped = Counter(
            "detok_changelog_records_skipped",
            "Changelog records that could not be restored (their request failed instead)",
            registry=r,
        )
        self.rebalances = Counter(
            "detok_rebalances", "Rebalance callbacks, by event", ["event"], registry=r
        )
        self.consumer_lag = Gauge(
            "detok_consumer_lag_messages",
            "Records behind the end, per input partition",
            ["partition"],
            registry=r,
        )
        self._lag_partitions: set[str] = set()
        self.last_processed = Gauge(
            "detok_last_processed_timestamp_seconds",
            "When a record was last consumed (unix time)",
            registry=r,
        )

    def _label_known_values(self, models: list[str]) -> None:
        """Every known label value exists from the start, so a dashboard's rate() over a
        counter that has not moved yet reads 0, not 'no data'."""
        for event_type in EVENT_TYPES:
            self.events_consumed.labels(type=event_type)
        for reason in DeadLetterReason:
            self.dead_letters.labels(reason=reason.value)
        for status in ("ok", "failed"):
            self.completions_produced.labels(status=status)
        for outcome in ("committed", "aborted"):
            self.transactions.labels(outcome=outcome)
        for cause in ABORT_CAUSES:
            self.transaction_aborts.labels(cause=cause)
        for cause in REPLACEMENT_CAUSES:
            self.producer_replacements.labels(cause=cause)
        for event in REBALANCE_EVENTS:
            self.rebalances.labels(event=event)
        for model in models:
            self.prompt_ids_filtered.labels(model=model)

    def serve(self, port: int, host: str = "0.0.0.0", health: Health | None = None) -> None:
        """Serve /metrics, and the worker's /healthz and /readyz (workers/runtime/health.py). All
        interfaces by default: Prometheus scrapes a container from outside it; on a shared
        machine pass 127.0.0.1."""
        serve_endpoints(port, host, self.registry, health or Health())

    def observe_consumed(self, records: int, now: float) -> None:
        """Count consumed records; a poll that returned only partition EOFs processed nothing,
        so it must not move the last-processed timestamp."""
        if records:
            self.records_consumed.inc(records)
            self.last_processed.set(now)

    def observe_batch(self, result: BatchResult, events: int, seconds: float) -> None:
        for event_type, count in result.events_by_type.items():
            if count:
                self.events_consumed.labels(type=event_type).inc(count)
        self.tokens_decoded.inc(result.decoded_tokens)
        self.duplicates.inc(result.duplicates)
        self.events_after_stop.inc(result.events_after_stop)
        self.batch_size.observe(events)
        self.decode_duration.observe(seconds)

    def observe_outputs(self, result: BatchResult) -> None:
        for completion in result.completions:
            self.completions_produced.labels(status=completion.status).inc()
        for metric in result.filtered_ids:
            self.prompt_ids_filtered.labels(model=metric.model).inc(metric.filtered_count)
        self.metric_events_produced.inc(len(result.filtered_ids))
        for signal in result.stop_signals:
            self.stop_signals_produced.labels(reason=signal.reason).inc()

    def observe_commit(self, seconds: float, committed: bool, recommitted: bool = False) -> None:
        self.transactions.labels(outcome="committed" if committed else "aborted").inc()
        if committed:
            self.commit_duration.observe(seconds)
        if recommitted:
            self.transactions_recommitted.inc()

    def observe_caught_up(self) -> None:
        """A commit went through, or there was nothing to commit: no stall."""
        self._last_commit = time.monotonic()

    def observe_abort(self, cause: str) -> None:
        self.transaction_aborts.labels(cause=cause).inc()

    def observe_restore(self, seconds: float, still_restoring: int) -> None:
        self.restore_duration.observe(seconds)
        self.partitions_restoring.set(still_restoring)

    def consumer_statistics(self, stats_json: str) -> None:
        """librdkafka's statistics callback: per-partition consumer lag of the input topic.

        librdkafka reports -1 for partitions this consumer does not fetch (revoked ones stay in
        its metadata); their series are removed, or a partition that moved to another worker
        would be counted twice by `sum(detok_consumer_lag_messages)`.
        """
        stats = json.loads(stats_json)
        current: dict[str, int] = {}
        for topic in stats.get("topics", {}).values():
            for partition, data in topic.get("partitions", {}).items():
                lag = data.get("consumer_lag", -1)
                if partition != "-1" and lag >= 0:
                    current[partition] = lag
        for partition in self._lag_partitions - current.keys():
            self.consumer_lag.remove(partition)
        for partition, lag in current.items():
            self.consumer_lag.labels(partition=partition).set(lag)
        self._lag_partitions = set(current)


__all__ = ["DEFAULT_METRICS_PORT", "PrometheusMetrics"]
