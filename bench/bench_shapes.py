"""Production shapes through Kafka (issue 15 items 1-4), beside today's workload, in one run.

One `detok worker`, exactly-once, on the cluster the usual client flags name (as bench_e2e),
else on the local broker, with real tokenizers:

  today         bench_e2e's workload (prompts of 32-256 ids, 100-400 generated), measured
                first and last: the baseline every ratio below is taken against (their mean);
  prompts 8k    the same generations behind prompts of 8,192 ids, sent whole (~50 KB each);
  prompts 32k   the same behind prompts of 32,768 ids, sent whole (~200 KB each, under the 1 MB
                limit, so replay sends them whole) and as 64-id tails (`replay --prompt-tail
                64`, exact: docs/production-shapes.md 'Prompt tails'; as many requests as
                today's workload);
  long gens     16k-32k generated ids per request;
  backlog       N prompt-only requests never finished (default 200,000; `--open-requests
                1000000`, alias `--backlog`): worker RSS per open request (slope between N/2
                and N, fixed costs cancel; with `--compare-with`, that tree's worker's too, on
                topics of its own), kill -9, then the successor's restore time (its log
                line), from its assignment to restored (its timeline) and from its start, its
                RSS per restored request (above the same worker's RSS with none open) and the
                load average then; then the successor idles with the N requests for
                `--idle-seconds` and its TTL sweeps' share of that time (its run summary).
                `--compare-with TREE`: that checkout's worker restores the same changelog
                first (killed -9 in turn), so before and after come from one run.

Generated tokens/s are the worker's own (first consume to last commit, from its run summary).
Changelog bytes per request (key + value + headers of every record written for it, read back
before compaction could run) are compared with the request's final text bytes (its completion):
the target is at most 2x the text plus a small constant. "before" is what the format before
text segments would have written in the same run (each head with the whole text so far).

    python -m bench.bench_shapes [--quick] [--open-requests N] [--compare-with TREE] [--json]
                                 [--kafka-config FILE] [-X K=V]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from bench.bench_e2e import (
    CHUNK,
    DEFAULT_TOKENIZERS,
    PARTITIONS,
    REPO_ROOT,
    RESTORED,
    THIS_TREE,
    WAIT_BOUND_S,
    Kafka,
    Tree,
    Workload,
    add_local_broker_option,
    build_workload,
    committed_offsets,
    drop_topics,
    end_offsets,
    kafka_from,
    measure_open_requests,
    start,
    summaries,
    topics,
    vm_status,
    wait_for,
    worker_command,
)
from pipeline.request_state import split_changelog_key
from workers.commands.options import add_connection_options
from workers.io.replay import replay
from workers.kafka.clients import KafkaConnection, make_consumer
from workers.kafka.config import KafkaConfigError
from workers.kafka.topics import ensure_topics

LONG_PROMPTS = (8_192, 32_768)
LONG_GENERATION = (16_384, 32_768)
TARGET_TEXT_FACTOR = 2.0


@dataclass
class ShapeRun:
    label: str
    requests: int
    generated_tokens: int
    seconds: float
    input_bytes: int
    changelog: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


# -- workloads ----------------------------------------------------------------------------------


def write_records(path: Path, records: list[dict[str, Any]]) -> Workload:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens = sum(len(r["output_token_ids"]) for r in records)
    return Workload(path, records, tokens, [])


def long_prompt_records(base: Workload, length: int, count: int) -> list[dict[str, Any]]:
    """`count` of today's generations, each behind a prompt grown to `length` ids with ids of
    other requests of its model (real token sequences, so seeding sees ordinary text)."""
    pools: dict[str, list[int]] = {}
    for record in base.records:
        pools.setdefault(record["model"], []).extend(record["output_token_ids"])
    out = []
    for record in base.records[:count]:
        pool = pools[record["model"]]
        need = length - len(record["prompt_token_ids"])
        filler = (pool * (need // len(pool) + 1))[:need]
        out.append({**record, "prompt_token_ids": filler + record["prompt_token_ids"]})
    return out


def long_generation_records(base: Workload, count: int) -> list[dict[str, Any]]:
    """`count` generations of 16k-32k ids: today's outputs of one model strung together."""
    rng = random.Random(15)
    by_model: dict[str, list[dict[str, Any]]] = {}
    for record in base.records:
        by_model.setdefault(record["model"], []).append(record)
    models = sorted(by_model)
    out = []
    for index in range(count):
        records = by_model[models[index % len(models)]]
        target = rng.randint(*LONG_GENERATION)
        output: list[int] = []
        position = rng.randrange(len(records))
        while len(output) < target:
            output += records[position % len(records)]["output_token_ids"]
            position += 1
        first = records[position % len(records)]
        out.append({**first, "request_id": f"long-gen-{index}", "output_token_ids": output})
    return out


# -- one worker on one workload -----------------------------------------------------------------


def run_shape(
    kafka: Kafka,
    label: str,
    workload: Workload,
    specs: list[str],
    logs: Path,
    prompt_tail: int | None = None,
) -> ShapeRun:
    prefix = f"shape-{uuid.uuid4().hex[:8]}"
    names = topics(prefix)
    ensure_topics(kafka.connection, names, PARTITIONS)
    replay(
        kafka.connection,
        workload.path,
        names.input,
        chunk_size=CHUNK,
        progress=False,
        prompt_tail=prompt_tail,
    )
    input_bytes = sum(topic_bytes(kafka.connection, names.input).values())
    group = f"{prefix}-group"
    log = logs / f"{prefix}.log"
    command = worker_command(
        kafka, names, group, specs, "--guarantee", "exactly-once", "--instance-id", prefix
    )
    process = start(command, log)
    # Partitions no record went to have nothing to commit (a few long requests leave some so).
    ends = {p: end for p, end in end_offsets(kafka.connection, names.input).items() if end}
    wait_for(
        lambda: committed_offsets(kafka.connection, group, names.input, list(ends)) == ends,
        f"{label} to commit the whole input",
    )
    process.send_signal(signal.SIGTERM)
    if process.wait(WAIT_BOUND_S) != 0:
        raise RuntimeError(f"worker exited non-zero; see {log}")
    (summary,) = summaries(log)
    seconds = summary["last_commit_at"] - summary["first_consume_at"]
    if summary["generated_tokens"] < workload.generated_tokens:
        raise RuntimeError(f"{label}: decoded {summary['generated_tokens']} tokens")
    changelog = changelog_ratio(kafka.connection, names.changelog, names.completions)
    drop_topics(kafka.connection, names)
    return ShapeRun(
        label, workload.requests, workload.generated_tokens, seconds, input_bytes, changelog
    )


def read_all(connection: KafkaConnection, topic: str) -> list[Any]:
    """Every committed record of a topic, to its end."""
    consumer = make_consumer(
        connection,
        {
            "group.id": f"shape-reader-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        },
    )
    out = []
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        parts = list(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        remaining = set(parts)
        deadline = time.monotonic() + WAIT_BOUND_S
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(10_000, 0.5):
                error = message.error()
                if error is None:
                    out.append(message)
                elif error.code() == KafkaError._PARTITION_EOF:
                    remaining.discard(message.partition())
    finally:
        consumer.close()
    return out


def topic_bytes(connection: KafkaConnection, topic: str) -> dict[bytes, int]:
    """Bytes written per key (key + value + header names and values) over a whole topic."""
    sizes: dict[bytes, int] = {}
    for message in read_all(connection, topic):
        key = message.key() or b""
        size = len(key) + len(message.value() or b"")
        size += sum(len(name) + len(value or b"") for name, value in message.headers() or ())
        sizes[key] = sizes.get(key, 0) + size
    return sizes


def changelog_ratio(
    connection: KafkaConnection, changelog: str, completions: str
) -> dict[str, Any]:
    """Changelog bytes written per request against its final text's UTF-8 bytes, and what the
    format before segments would have written in the same run (each head plus the whole text
    so far: the segments read up to it)."""
    per_request: dict[bytes, int] = {}
    whole_text_format = 0
    text_so_far: dict[bytes, int] = {}
    for message in read_all(connection, changelog):  # in order within each partition
        key = message.key() or b""
        value = message.value() or b""
        size = len(key) + len(value)
        size += sum(len(name) + len(v or b"") for name, v in message.headers() or ())
        head, segment = split_changelog_key(key)
        per_request[head] = per_request.get(head, 0) + size
        if segment is not None:
            text_so_far[head] = text_so_far.get(head, 0) + len(value)
        else:
            whole_text_format += size + (text_so_far.get(head, 0) if value else 0)
    texts = {
        message.key(): len(json.loads(message.value())["text"].encode())
        for message in read_all(connection, completions)
    }
    ratios = [per_request.get(k, 0) / t for k, t in texts.items() if t]
    excess = [per_request.get(k, 0) - TARGET_TEXT_FACTOR * t for k, t in texts.items()]
    total_text = sum(texts.values())
    return {
        "requests": len(texts),
        "changelog_bytes": sum(per_request.values()),
        "text_bytes": total_text,
        "ratio_total": sum(per_request.values()) / total_text if total_text else None,
        "whole_text_format_ratio_total": whole_text_format / total_text if total_text else None,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        # The largest "bytes - 2 x text" of any request: the constant the target allows.
        "max_excess_over_2x_text": max(excess) if excess else None,
    }


# -- the open backlog ---------------------------------------------------------------------------


# RSS is read this long after the restore's log line: the worker frees the records it read
# (a million, for a million open requests) as the restore returns, and a loaded host can take
# a moment to run that.
RSS_SETTLE_S = 3.0
RESTORED_AFTER_ASSIGNMENT = re.compile(r": restored at \+([0-9.]+) s after their assignment")
RESTORE_CPU = re.compile(r"restored \d+ requests of partitions .* \(([0-9.]+) s CPU")


def backlog(
    kafka: Kafka,
    base: Workload,
    specs: list[str],
    count: int,
    idle_s: float,
    logs: Path,
    compare: Tree | None = None,
) -> dict[str, Any]:
    """`count` prompt-only requests: RSS per open request, restore after kill -9, sweep share.

    With `compare`, that tree's worker first opens the same requests on topics of its own (its
    RSS per live open request), then restores this tree's changelog (and is killed -9 in
    turn), then this tree's does: before and after, one run, the same load.
    """
    prefix = f"shape-backlog-{uuid.uuid4().hex[:8]}"
    names = topics(prefix)
    ensure_topics(kafka.connection, names, PARTITIONS)
    group = f"{prefix}-group"
    command = worker_command(kafka, names, group, specs, "--instance-id", prefix)
    opened = count - count % 2
    live = {}
    if compare is not None:
        live[compare.label] = open_backlog(kafka, base, specs, count, logs, compare)
    # The same group and instance id as the successors: each takes over the killed member's
    # partitions and committed offsets at once.
    empty, rss, changelog_bytes = open_backlog(
        kafka, base, specs, count, logs, THIS_TREE, (names, group, command)
    )
    live[THIS_TREE.label] = (empty, rss, changelog_bytes)
    restores = {}
    if compare is not None:
        successor, restore = restore_after_kill(command, opened, logs / f"{prefix}-0.log", compare)
        successor.send_signal(signal.SIGKILL)
        successor.wait(60)
        restores[compare.label] = restore | per_open_request(restore, empty, opened)
    log_b = logs / f"{prefix}-b.log"
    started = time.monotonic()
    successor, restore = restore_after_kill(command, opened, log_b, THIS_TREE)
    restores[THIS_TREE.label] = restore | per_open_request(restore, empty, opened)
    try:
        time.sleep(idle_s)
    finally:
        successor.send_signal(signal.SIGTERM)
        successor.wait(120)
    (summary,) = summaries(log_b) or [{}]
    drop_topics(kafka.connection, names)
    lifetime = time.monotonic() - started
    return {
        "open_requests": opened,
        "bytes_per_open_request": per_live_request(rss, count),
        "bytes_per_open_request_by_tree": {
            label: per_live_request(readings, count) for label, (_, readings, _) in live.items()
        },
        "rss_full": rss[1]["VmRSS"],
        "changelog_bytes_per_request": changelog_bytes / opened,
        "restores": restores,
        **restores[THIS_TREE.label],
        "sweep_s": summary.get("expire_s"),
        "idle_s": lifetime,
        "sweep_share": (summary.get("expire_s") or 0.0) / lifetime,
    }


def open_backlog(
    kafka: Kafka,
    base: Workload,
    specs: list[str],
    count: int,
    logs: Path,
    tree: Tree,
    worker_on: tuple[Any, str, list[str]] | None = None,
) -> tuple[dict[str, int], list[dict[str, int]], int]:
    """A `tree` worker opens `count` prompt-only requests in two halves and is killed -9: its
    RSS with none open, at each half, and the changelog bytes it wrote. `worker_on`: the
    topics, group and command of a backlog kept for a restore; else topics of its own, dropped
    after."""
    prefix = f"shape-open-{tree.label}-{uuid.uuid4().hex[:8]}"
    if worker_on is None:
        names, group = topics(prefix), f"{prefix}-group"
        ensure_topics(kafka.connection, names, PARTITIONS)
        command = worker_command(kafka, names, group, specs, "--instance-id", prefix)
    else:
        names, group, command = worker_on
    log = logs / f"{prefix}.log"
    worker = start(command, log, tree=tree)
    prompts = base.records[:500]

    def prompts_of(half: int) -> Iterator[tuple[str, bytes]]:
        for position in range(count // 2):
            record = prompts[position % len(prompts)]
            request_id = f"open-{half}-{position}"
            value = json.dumps(
                {"type": "prompt", "request_id": request_id, "model": record["model"],
                 "prompt_token_ids": record["prompt_token_ids"][:48]},
                separators=(",", ":"),
            ).encode()  # fmt: skip
            yield request_id, value

    try:
        wait_for(lambda: "restored" in log.read_text(), f"the {tree.label} backlog worker")
        empty = vm_status(worker.pid)
        rss = measure_open_requests(
            kafka,
            names.input,
            group,
            worker.pid,
            (prompts_of(0), prompts_of(1)),
            linger_ms=50,
            settle_s=1.0,
        )
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(60)
    changelog_bytes = sum(topic_bytes(kafka.connection, names.changelog).values())
    if worker_on is None:
        drop_topics(kafka.connection, names)
    return empty, rss, changelog_bytes


def per_live_request(rss: list[dict[str, int]], count: int) -> float:
    """RSS per live open request: the slope between the two halves (fixed costs cancel)."""
    return (rss[1]["VmRSS"] - rss[0]["VmRSS"]) / (count // 2)


def restore_after_kill(
    command: list[str], count: int, log: Path, tree: Tree
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """Start a successor from `tree` and wait until it restored `count` requests: its restore
    time (its log line), from assignment to restored (its timeline) and from its start."""
    started = time.monotonic()
    successor = start(command, log, tree=tree)
    try:
        wait_for(
            lambda: sum(int(m.group(1)) for m in RESTORED.finditer(log.read_text())) >= count,
            f"the {tree.label} successor's restore",
        )
    except BaseException:
        successor.send_signal(signal.SIGKILL)
        successor.wait(60)
        raise
    to_restored = time.monotonic() - started
    time.sleep(RSS_SETTLE_S)
    status = vm_status(successor.pid)
    text = log.read_text()
    return successor, {
        "restore_s": sum(float(s) for _, s in RESTORED.findall(text)),
        "assignment_to_restored_s": sum(map(float, RESTORED_AFTER_ASSIGNMENT.findall(text))),
        # Only a worker that logs it (not one from before it did): None then.
        "restore_cpu_s": sum(map(float, cpu)) if (cpu := RESTORE_CPU.findall(text)) else None,
        "start_to_restored_s": to_restored,
        "rss_after_restore": status["VmRSS"],
        "peak_rss": status["VmHWM"],
        "load_average": os.getloadavg(),
    }


def per_open_request(
    restore: dict[str, Any], empty: dict[str, int], count: int
) -> dict[str, float]:
    """RSS per open request once restored: above what the same worker held with none open."""
    return {"bytes_per_restored_request": (restore["rss_after_restore"] - empty["VmRSS"]) / count}


# -- report -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_connection_options(parser)
    parser.add_argument("--shared-dir", type=Path, default=REPO_ROOT.parent / "shared")
    add_local_broker_option(parser)
    parser.add_argument("--tokenizers", default=",".join(DEFAULT_TOKENIZERS))
    parser.add_argument("--requests", type=int, default=20_000, help="today's workload")
    parser.add_argument("--long-prompt-requests", type=int, default=1_000)
    parser.add_argument("--long-generations", type=int, default=96)
    parser.add_argument("--backlog", "--open-requests", type=int, default=200_000)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="4,000 / 300 / 24 / 100,000")
    parser.add_argument("--skip", default="", help="comma-separated: prompts,generations,backlog")
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="TREE",
        help="a checkout of the code before a change (`git worktree add /tmp/base <commit>`): "
        "its worker restores the backlog too, before this tree's, in the same run",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.long_prompt_requests, args.long_generations = 4000, 300, 24
        args.backlog = min(args.backlog, 100_000)
    skip = set(filter(None, args.skip.split(",")))
    try:
        kafka = kafka_from(args)
    except KafkaConfigError as error:  # its message never quotes a secret
        parser.error(str(error))
    cache = Path(tempfile.gettempdir()) / "detok-bench"
    cache.mkdir(exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="detok-shapes-"))
    note = _note(args.json)

    names = args.tokenizers.split(",")
    base = build_workload(args.shared_dir, names, args.requests, cache)
    specs = base.specs
    shapes: list[tuple[str, Workload, int | None]] = [("today", base, None)]
    if "prompts" not in skip:
        for length in LONG_PROMPTS:
            records = long_prompt_records(base, length, args.long_prompt_requests)
            workload = write_records(logs / f"prompts-{length}.jsonl", records)
            shapes.append((f"prompts {length // 1024}k, whole", workload, None))
            if length == LONG_PROMPTS[-1]:
                # As many requests as today's workload: tails are small, and a run of a few
                # hundred requests is mostly its first and last commit interval.
                records = long_prompt_records(base, length, base.requests)
                tails = write_records(logs / f"prompts-{length}-tails.jsonl", records)
                shapes.append((f"prompts {length // 1024}k, 64-id tails", tails, 64))
    if "generations" not in skip:
        records = long_generation_records(base, args.long_generations)
        shapes.append(("long generations", write_records(logs / "gens.jsonl", records), None))
    shapes.append(("today (again)", base, None))

    runs = []
    for label, workload, tail in shapes:
        run = run_shape(kafka, label, workload, specs, logs, prompt_tail=tail)
        runs.append(run)
        note(
            f"{label}: {run.tokens_per_s:,.0f} tok/s over {run.requests} requests; changelog "
            f"{run.changelog['ratio_total']:.2f}x text (max {run.changelog['ratio_max']:.2f}x)"
        )
    baseline = statistics.mean(r.tokens_per_s for r in runs if r.label.startswith("today"))
    report: dict[str, Any] = {
        "baseline_tokens_per_s": baseline,
        "runs": [
            {
                "label": r.label,
                "requests": r.requests,
                "generated_tokens": r.generated_tokens,
                "seconds": r.seconds,
                "tokens_per_s": r.tokens_per_s,
                "vs_today": r.tokens_per_s / baseline,
                "input_bytes_per_request": r.input_bytes / r.requests,
                "changelog": r.changelog,
            }
            for r in runs
        ],
        "logs": str(logs),
    }
    if "backlog" not in skip:
        compare = Tree("base", args.compare_with.resolve()) if args.compare_with else None
        report["backlog"] = backlog(
            kafka, base, specs, args.backlog, args.idle_seconds, logs, compare
        )
        note(f"backlog: {json.dumps(report['backlog'])}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def _note(quiet: bool) -> Any:
    def note(message: str) -> None:
        print(f"# {message}", file=sys.stderr if quiet else sys.stdout, flush=True)

    return note


def print_table(report: dict[str, Any]) -> None:
    print(f"\nbaseline (today's workload, mean of first and last): "
          f"{report['baseline_tokens_per_s']:,.0f} generated tok/s")  # fmt: skip
    print(f"{'workload':28} {'req':>6} {'tok/s':>11} {'vs today':>9} {'in B/req':>10} "
          f"{'chlog/text':>10} {'max':>6} {'max - 2x text':>14} {'before':>7}")  # fmt: skip
    for run in report["runs"]:
        c = run["changelog"]
        print(
            f"{run['label']:28} {run['requests']:>6} {run['tokens_per_s']:>11,.0f} "
            f"{run['vs_today']:>9.2f} {run['input_bytes_per_request']:>10,.0f} "
            f"{c['ratio_total']:>10.2f} {c['ratio_max']:>6.2f} "
            f"{c['max_excess_over_2x_text']:>14,.0f} {c['whole_text_format_ratio_total']:>7.2f}"
        )
    backlog_report = report.get("backlog")
    if backlog_report:
        b = backlog_report
        by_tree = ", ".join(
            f"{label} {value:,.0f} B"
            for label, value in b["bytes_per_open_request_by_tree"].items()
        )
        print(
            f"\nbacklog of {b['open_requests']:,} open requests: "
            f"{b['bytes_per_open_request']:,.0f} B RSS each while live ({by_tree}; "
            f"target <= 1024), "
            f"changelog {b['changelog_bytes_per_request']:,.0f} B each; TTL sweeps "
            f"{b['sweep_s']} s of {b['idle_s']:.0f} s ({100 * b['sweep_share']:.2f}%; target < 5%)"
        )
        print("after kill -9, a successor restores them (target: 20 s at 1M):")
        for label, r in b["restores"].items():
            load = ", ".join(f"{x:.1f}" for x in r["load_average"])
            cpu = "" if r["restore_cpu_s"] is None else f" ({r['restore_cpu_s']:.1f} s CPU)"
            print(
                f"  {label:5} restore {r['restore_s']:.1f} s{cpu} (log line), assignment to "
                f"restored {r['assignment_to_restored_s']:.1f} s, start to restored "
                f"{r['start_to_restored_s']:.1f} s; {r['bytes_per_restored_request']:,.0f} B RSS "
                f"per restored request, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB; "
                f"load average {load}"
            )
    print(f"\nlogs: {report['logs']}")


if __name__ == "__main__":
    sys.exit(main())
