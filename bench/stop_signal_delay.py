"""bench_e2e's stop-signal section (`--stop-signals`): how soon an engine hears that detok stopped
a request, and how many ids it could then skip.

Every other request of the workload gets a stop string from its own text (a few characters
starting between a quarter and a half of it), so it stops mid-generation, as a tokens-only
engine's request does when detok finds a stop it cannot see. One exactly-once worker runs live
while the events arrive at the given rate (half the one-worker maximum), all the ids of every
request, as from an engine that does not abort (and, for a stopped request, no finish: such an
engine finishes at its own limit, long after); an engine's `StopSignals` (workers.io.publish) stamps
each signal as it receives it. Reported:

  delay       from the produce of the tokens event holding the id that completed the stop
              (`detok run` on the same requests says which id) to the signal's receipt: p50,
              p99 (median run of three, by p99);
  skippable   the simulated engine: the ids each stopped request generates after its stop
              (up to its `max_tokens`: the rest of its scripted output, or 1,024), how many of
              them it makes before the signal comes (wasted even so), and the rest, which an
              engine aborting on the signal does not generate. In the live run above every
              request's ids come at the paced producer's per-request rate (thousands of ids a
              second: the aggregate rate over a few hundred requests in flight), faster than any
              engine decodes one sequence; so the engine is simulated at SIMULATED_RATES ids/s
              per request (typical decode speeds), each stop's own measured delay deciding how
              many ids it makes meanwhile.

The run imports bench_e2e's helpers lazily (bench_e2e imports this module only when asked).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.offline import run_generations
from pipeline.tokenizer_registry import TokenizerRegistry
from workers.formats.jsonl import jsonl_records
from workers.io.publish import StopSignals

# Per-request decode speeds of the simulated engine (ids/s of one sequence), and the limits it
# generates to without a signal (None: the request's scripted length).
SIMULATED_RATES = (30.0, 100.0)
SIMULATED_LIMITS = (None, 1024)


def with_stop_strings(records: list[dict[str, Any]], registry: TokenizerRegistry) -> list[dict]:
    """The records, every other one with a stop string from its own text."""
    rng = random.Random(3)
    out = []
    for index, record in enumerate(records):
        record = {**record, "request_id": f"stop-{record['request_id']}"}
        if index % 2 == 0:
            tokenizer = registry.get(record["model"]).tokenizer
            text = tokenizer.decode(record["output_token_ids"], skip_special_tokens=True)
            if len(text) > 16:
                start = rng.randint(len(text) // 4, len(text) // 2)
                record["stop"] = [text[start : start + 4]]
        out.append(record)
    return out


def stops_used(records: list[dict[str, Any]], registry: TokenizerRegistry) -> dict[str, int]:
    """request id -> the ids the completion used (up to the one completing the stop), for each
    request `detok run` stops at a stop string: the oracle of where each stop lands."""
    lines = [json.dumps(r).encode() for r in records]
    return {
        outcome.completion.request_id: outcome.completion.generated_tokens
        for outcome in run_generations(jsonl_records(lines), registry)
        if outcome.completion is not None and outcome.completion.stop_reason is not None
    }


def without_finishes(
    events: list[tuple[bytes, bytes, int]], used: dict[str, int]
) -> list[tuple[bytes, bytes, int]]:
    """The events, less the finish events of the stopped requests: an engine that cannot see a
    stop generates on to its own limit and finishes long after (here: never), so no worker
    batch holds both the stop and the finish (which would need no signal)."""
    return [
        (key, value, seq)
        for key, value, seq in events
        if key.decode() not in used or b'"type":"finish"' not in value
    ]


def completing_events(
    events: list[tuple[bytes, bytes, int]], used: dict[str, int]
) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """request id -> (seq of the event holding its completing id, (seq, ids) of every tokens
    event of the request in order), for the stopped requests."""
    by_request: dict[str, list[tuple[int, int]]] = {}
    for key, value, seq in events:
        request_id = key.decode()
        if request_id in used and seq > 0:
            ids = len(json.loads(value).get("token_ids", []))
            by_request.setdefault(request_id, []).append((seq, ids))
    out = {}
    for request_id, parts in by_request.items():
        total = 0
        for seq, ids in parts:
            total += ids
            if total >= used[request_id] and ids:
                out[request_id] = (seq, parts)
                break
    return out


def stop_signal_run(
    kafka: Any,
    workload: Any,
    tokens_per_s: float,
    seconds: float,
    logs: Path,
    prefix: str,
) -> dict[str, Any]:
    """One exactly-once worker live at `tokens_per_s`, the stop-signal figures (see the module
    docstring). `prefix` names the run's topics, made ahead (bench_e2e's `ReadyTopics`)."""
    from bench import bench_e2e as e2e

    registry = e2e.registry_of(workload)
    names = e2e.topics(prefix)
    per_request = workload.generated_tokens / workload.requests
    wanted = max(50, int(tokens_per_s * seconds / per_request))
    records = with_stop_strings(workload.records[:wanted], registry)
    used = stops_used(records, registry)
    events = without_finishes(e2e.timed_events(records), used)
    completing = completing_events(events, used)
    tokens = sum(len(r["output_token_ids"]) for r in records)
    events_per_s = len(events) * tokens_per_s / tokens
    log = logs / f"{prefix}.log"
    command = e2e.worker_command(kafka, names, f"{prefix}-group", workload.specs,
                                 "--instance-id", prefix)  # fmt: skip
    received: dict[str, float] = {}
    lock = threading.Lock()

    def on_stop(stop: Any) -> None:
        now = time.time()
        with lock:
            received.setdefault(stop.request_id, now)

    with e2e.load_apart_from_worker(kafka.broker_dir) as worker_cpus:
        worker = e2e.start(command, log, worker_cpus)
        signals = StopSignals(kafka.connection, names.control, on_stop=on_stop)
        try:
            e2e.wait_for(lambda: "restored" in log.read_text(), "the stop-signal worker")
            warm = with_stop_strings(
                [{**r, "request_id": f"warm-{r['request_id']}"} for r in workload.records[:20]],
                registry,
            )
            warm_stops = stops_used(warm, registry)
            warm_events = without_finishes(e2e.timed_events(warm), warm_stops)
            e2e._paced_produce(kafka.connection, names.input, warm_events, events_per_s)
            e2e.wait_for(lambda: warm_stops.keys() <= received.keys(), "the warm-up's signals")
            produced = e2e._paced_produce(kafka.connection, names.input, events, events_per_s)
            e2e.wait_for(lambda: completing.keys() <= received.keys(), "every stop signal", 120)
        finally:
            signals.close()
            worker.send_signal(signal.SIGTERM)
            worker.wait(60)
    e2e.drop_topics(kafka.connection, names)
    return _figures(completing, used, produced, received, records, events_per_s, tokens_per_s)


def _figures(
    completing: dict[str, tuple[int, list[tuple[int, int]]]],
    used: dict[str, int],
    produced: dict[tuple[str, int], float],
    received: dict[str, float],
    records: list[dict[str, Any]],
    events_per_s: float,
    tokens_per_s: float,
) -> dict[str, Any]:
    """Delays and the simulated engine's ids after each stop (see the module docstring)."""
    from bench.bench_e2e import _quantile

    lengths = {r["request_id"]: len(r["output_token_ids"]) for r in records}
    delays: dict[str, float] = {}
    after_stop, wasted, rates = 0, 0, []
    for request_id, (seq, parts) in completing.items():
        got = received[request_id]
        delays[request_id] = got - produced[(request_id, seq)]
        after_stop += lengths[request_id] - used[request_id]
        # Ids of the request produced by the time its signal came: the engine had made them.
        made = sum(ids for s, ids in parts if produced[(request_id, s)] <= got)
        wasted += max(0, made - used[request_id])
        first, last = produced[(request_id, parts[0][0])], produced[(request_id, parts[-1][0])]
        if last > first:
            rates.append(lengths[request_id] / (last - first))
    simulated = [
        _simulated(delays, used, lengths, rate, limit)
        for rate in SIMULATED_RATES
        for limit in SIMULATED_LIMITS
    ]
    return {
        "tokens_per_s": tokens_per_s,
        "events_per_s": events_per_s,
        "requests": len(records),
        "stopped": len(completing),
        "p50_ms": 1000 * _quantile(list(delays.values()), 0.5),
        "p99_ms": 1000 * _quantile(list(delays.values()), 0.99),
        "ids_per_s_per_request": _quantile(rates, 0.5) if rates else None,
        "ids_after_stops": after_stop,
        "ids_before_signal": wasted,
        "ids_skippable": after_stop - wasted,
        "skippable_share": (after_stop - wasted) / after_stop if after_stop else None,
        "simulated": simulated,
    }


def _simulated(
    delays: dict[str, float],
    used: dict[str, int],
    lengths: dict[str, int],
    rate: float,
    limit: int | None,
) -> dict[str, Any]:
    """An engine decoding each request at `rate` ids/s up to `limit` ids (None: its scripted
    length): the ids after the stops, those it makes during each stop's measured delay, and
    the rest, which it skips by aborting on the signal."""
    after = made = 0
    for request_id, delay in delays.items():
        rest = max(0, (limit or lengths[request_id]) - used[request_id])
        after += rest
        made += min(rest, int(rate * delay))
    return {
        "ids_per_s_per_request": rate,
        "max_tokens": limit,
        "ids_after_stops": after,
        "ids_before_signal": made,
        "ids_skippable": after - made,
        "skippable_share": (after - made) / after if after else None,
        "wasted_per_stop": made / len(delays) if delays else None,
    }
