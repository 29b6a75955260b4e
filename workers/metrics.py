"""Moved to workers/prometheus.py (`PrometheusMetrics`); this name stays only until the demo
imports from there (delete at merge)."""

from workers.prometheus import DEFAULT_METRICS_PORT
from workers.prometheus import PrometheusMetrics as WorkerMetrics

__all__ = ["DEFAULT_METRICS_PORT", "WorkerMetrics"]
