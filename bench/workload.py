"""The benchmarks' workload generator, which lives in `workers.local.sample_workload` (the demo
uses it too); kept importable here for the benchmark scripts."""

from workers.local.sample_workload import generations

__all__ = ["generations"]
