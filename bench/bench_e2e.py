"""End-to-end throughput through Kafka, side by side with the in-process core, in one run.

On the cluster the usual client flags name (`--bootstrap-servers`, `--kafka-config FILE`, `-X
key=value`, as every detok command reads them), else on the local broker (`detok broker start`,
or one this script starts), with real tokenizers:

  core        `RequestProcessor.process` over the same events, cut into the worker's consume
              batches (no Kafka, no parsing): the ceiling the worker is measured against,
              measured again right before each one-worker exactly-once run and paired with it
              (and once more with parsing, from the record bytes, for reference);
  e2e         the workload is replayed first, then 1 and 2 `detok worker` processes drain it
              under exactly-once and at-least-once; generated tokens / (last commit - first
              consume), both taken from the workers' own `run summary` log lines, so replay
              speed and process start-up are not part of the figure;
  latency     one exactly-once worker live while events arrive at half the measured one-worker
              rate; delay from each event's produce time to the moment a read_committed reader
              receives the delta covering it (p50/p99; median run of three, and the same at
              a quarter of the rate); the worker gets a core of its own, the paced producer,
              the reader and the broker share the other (`load_apart_from_worker`); the
              runs' topics are made 10 s ahead (`TOPIC_SETTLE_S`);
  scale out   the 2-worker rows against the 1-worker rows (target: >= 1.0x), and the timeline of
              the worker assigned partitions last; then a worker joining a group already running
              at a quarter of the rate: when its first output became visible to a reader after
              its assignment (target: <= 1 s; median of three) and its own timeline;
  memory      RSS growth of a worker per 10,000 active (started, unfinished) requests, as the
              slope between two fill levels so fixed costs (tokenizers, client buffers) cancel;
  restore     kill -9 of that worker, then the restore time its successor logs;
  stop        with `--stop-signals`: the delay from the tokens event completing a stop string to
              an engine's receipt of its stop signal at half the one-worker rate, and the ids
              an engine could skip (bench/stop_signal_delay.py).

No figure is asserted; targets are printed next to each figure as ratios measured in this run.
`--compare-with TREE` runs another checkout's workers (e.g. `git worktree add /tmp/base <commit>`)
beside this tree's, alternating in every rotation, so before/after figures come from one run.

    python -m bench.bench_e2e [--requests 20000] [--quick] [--json] [--profile DIR]
                              [--compare-with TREE] [--kafka-config FILE] [-X KEY=VALUE]
                              [--stop-signals]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource, ResourceType
from tokenizers import Tokenizer

from bench.workload import generations
from pipeline.generations import generation_events
from pipeline.processor import EventOrigin, RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import LoggedGeneration
from schemas.fast_events import encode_event
from schemas.validation import parse_event
from workers.commands.options import add_connection_options, connection_from, kafka_config_arguments
from workers.formats.jsonl import jsonl_records
from workers.io.replay import replay, replay_events
from workers.kafka.clients import (
    METADATA_TIMEOUT_S,
    KafkaConnection,
    cluster_metadata,
    make_admin,
    make_consumer,
    make_producer,
)
from workers.kafka.config import CONFIG_FILE_ENV, KafkaConfigError
from workers.kafka.topics import TopicNames, delete_topics, ensure_topics
from workers.local.broker import (
    DEFAULT_DATA_DIR,
    DEFAULT_PORT,
    LOOPBACK,
    answers_metadata,
    broker_status,
    free_port_block,
    start_broker,
    start_cluster,
    stop_cluster,
)
from workers.runtime.process_policy import tune_garbage_collector

REPO_ROOT = Path(__file__).resolve().parent.parent
CHUNK = 16
PARTITIONS = 8
# The worker's default consume batch; the core is fed batches of the same size so that the
# ratio compares like with like (one decode round per batch in both).
CORE_BATCH = 2000
COMMIT_INTERVAL_MS = 250
# Runs of each delay measurement; the median is reported.
LATENCY_REPEATS = 3
# The latency phase's generator wakes this often and produces every event then due.
PACE_TICK_S = 0.002
# The delta reader's consume timeout: the most its receive stamps can lag (see `_read_deltas`).
READER_WAIT_S = 0.01
# A join run lasts at least this long, so the joining worker (seconds of start-up: tokenizers,
# group join) joins while the load still runs.
JOIN_RUN_S = 15.0
# A join run's load, as a share of one worker's max rate: the lower of the delay rows' two.
JOIN_RATE_SHARE = 0.25
# The latency and join runs' topics are created together, before the first of those runs, and
# the first waits until they are this old. Created just before its worker (as they were), a
# run's fresh partitions cost it one stall in the local broker: a transaction's commit markers
# took 0.2-0.9 s to append (the broker's debug log: "Produce to local log in 808 ms" for one
# WriteTxnMarkers request; JFR: its request handler inside OffsetIndex.append, the first writes
# to the new partitions' memory-mapped index), every later transaction waited for them
# (CONCURRENT_TRANSACTIONS), and so did every delta meanwhile: that stall was the run's p99.
# Paired on this machine, five runs each at half the `--quick` rate: p99 468-1,017 ms with
# fresh topics, 407-450 ms with topics made 8 s earlier, 365-455 ms 30 s earlier. A deployment's
# topics are not seconds old, so the delay measured is the worker's, not the new partitions'.
TOPIC_SETTLE_S = 10.0
# A run that takes longer than this is stuck (the full run drains in well under a minute).
WAIT_BOUND_S = 600.0
DEFAULT_TOKENIZERS = ("gpt2", "llama-spm", "qwen2-from-tiktoken")
GROUP_DELAY = "group.initial.rebalance.delay.ms"
SUMMARY = re.compile(r"run summary (\{.*\})")
RESTORED = re.compile(r"restored (\d+) requests of partitions .* in ([0-9.]+)s")


class WorkerCrashed(RuntimeError):
    """A worker of a measured run exited non-zero: the run has no figure (reported, not fatal
    for a `--compare-with` tree, whose bugs are what a comparison may show)."""


@dataclass
class Workload:
    path: Path
    records: list[dict[str, Any]]
    generated_tokens: int
    specs: list[str]

    @property
    def requests(self) -> int:
        return len(self.records)


@dataclass
class WorkerRun:
    label: str
    workers: int
    guarantee: str
    seconds: float
    generated_tokens: int
    peak_rss: int
    summaries: list[dict[str, Any]] = field(default_factory=list)
    redone_tokens: int = 0  # decoded beyond the workload: work redone after rebalances
    core_tokens_per_s: float | None = None  # the core measured right before this run
    tree: str = "this"

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    def time_shares(self) -> dict[str, float]:
        """Where the worker's wall time went (one worker): the processor, the rest of record
        handling (parse, origins, emitting), consume() calls and commits."""
        summary = self.summaries[0]
        handle_rest = summary["handle_s"] - summary["process_s"]
        return {
            "process": summary["process_s"] / self.seconds,
            "parse_and_handle": handle_rest / self.seconds,
            "consume": summary["consume_s"] / self.seconds,
            "commit": summary["commit_s"] / self.seconds,
        }


# -- workload -----------------------------------------------------------------------------------


def build_workload(shared: Path, names: list[str], requests: int, cache: Path) -> Workload:
    """Generations split evenly over the tokenizers, cached: generating 20k takes ~20 s."""
    specs = [f"{name}={shared / 'tokenizers' / name / 'tokenizer.json'}" for name in names]
    path = cache / f"e2e-{'-'.join(names)}-{requests}.jsonl"
    if not path.exists():
        records: list[dict[str, Any]] = []
        for index, name in enumerate(names):
            tokenizer = Tokenizer.from_file(str(shared / "tokenizers" / name / "tokenizer.json"))
            count = requests // len(names) + (index < requests % len(names))
            # Prompts of 32-256 ids and 100-400 generated ids: ~250 generated tokens a request,
            # so 20,000 requests are the ~5M generated tokens the issue asks for.
            records += generations(
                tokenizer,
                model=name,
                requests=count,
                prompt_tokens=(32, 256),
                output_tokens=(100, 400),
                seed=index,
            )
        random.Random(0).shuffle(records)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.rename(path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    tokens = sum(len(r["output_token_ids"]) for r in records)
    return Workload(path, records, tokens, specs)


def registry_of(workload: Workload) -> TokenizerRegistry:
    return TokenizerRegistry.from_specs(workload.specs)


# -- core ---------------------------------------------------------------------------------------


class Core:
    """The processor alone on the workload, in this process: the ceiling the worker is measured
    against. Measured again right before each one-worker exactly-once run, so each ratio pairs
    two figures taken under the same load: on a shared host the load moves between runs, and
    pairing keeps that movement out of the ratio."""

    def __init__(self, workload: Workload) -> None:
        lines = workload.path.read_bytes().splitlines()
        self.values = [value for _, value in replay_events(jsonl_records(lines), CHUNK)]
        self.parsed = [
            (parse_event(value), EventOrigin("bench", 0, offset, value))
            for offset, value in enumerate(self.values)
        ]
        self.registry = registry_of(workload)
        self.tokens = workload.generated_tokens

    def throughput(self, parse: bool = False) -> float:
        """Generated tokens/s over the replay's event order and the worker's batch cut; with
        `parse`, from the raw record bytes (everything the worker does but Kafka)."""
        processor = RequestProcessor(self.registry)
        processor.warm_up()
        tune_garbage_collector()  # the worker's own collector policy, for a like-for-like ratio
        started = time.perf_counter()
        if parse:
            for start in range(0, len(self.values), CORE_BATCH):
                values = self.values[start : start + CORE_BATCH]
                origins = [EventOrigin("bench", 0, start + i, v) for i, v in enumerate(values)]
                processor.process(zip(map(parse_event, values), origins, strict=True))
        else:
            for start in range(0, len(self.parsed), CORE_BATCH):
                processor.process(self.parsed[start : start + CORE_BATCH])
        return self.tokens / (time.perf_counter() - started)


# -- Kafka plumbing -----------------------------------------------------------------------------


def topics(prefix: str, input_topic: str | None = None) -> TopicNames:
    names = TopicNames.with_prefix(prefix)
    return names.model_copy(update={"input": input_topic}) if input_topic else names


@dataclass(frozen=True)
class Kafka:
    """The cluster a run measures on: the connection of this process's own clients, and the
    `--kafka-config` / `-X` flags that give its workers the same one (the file's path goes on
    their command lines, not the secrets in it)."""

    connection: KafkaConnection
    config_flags: tuple[str, ...] = ()
    # The local broker's state directory (`detok broker start --data-dir`): where its process is
    # found, to pin it beside the load generator (`load_apart_from_worker`).
    broker_dir: Path = DEFAULT_DATA_DIR


def kafka_from(args: argparse.Namespace) -> Kafka:
    """The cluster the flags describe, read as every detok command reads them (`connection_from`).

    With no address and no client configuration given, as before: $KAFKA_BOOTSTRAP_SERVERS, else
    the local broker's port, and the local broker started if nothing answers there. A given
    address or configuration names a cluster of its own, so nothing is started for it.
    """
    connection = connection_from(args, fallback=lambda: f"{LOOPBACK}:{DEFAULT_PORT}")
    given = args.bootstrap_servers or args.kafka_config_file or args.kafka_overrides
    local = not (given or os.environ.get(CONFIG_FILE_ENV))
    if local and not answers_metadata(connection.bootstrap_servers):
        started = start_broker(data_dir=args.broker_data_dir)
        connection = replace(connection, bootstrap_servers=started.bootstrap_servers)
    return Kafka(connection, tuple(kafka_config_arguments(args)), args.broker_data_dir)


def worker_command(
    kafka: Kafka,
    names: TopicNames,
    group: str,
    specs: list[str],
    *extra: str,
    tree: Tree | None = None,
) -> list[str]:
    """A `detok worker` on `kafka`'s cluster: its address, and the client configuration as the
    same `--kafka-config` / `-X` flags this bench was given, so the worker connects as it does.
    A topic role `tree`'s worker has no flag for (a tree from before the role, e.g. the control
    topic's) is left out: that worker does not write it."""
    bootstrap = kafka.connection.bootstrap_servers
    command = [sys.executable, "-m", "workers.cli", "worker", "--bootstrap-servers", bootstrap]
    command += kafka.config_flags
    command += ["--group", group, "--commit-interval-ms", str(COMMIT_INTERVAL_MS)]
    for spec in specs:
        command += ["--tokenizer", spec]
    known = worker_help(tree or THIS_TREE)
    for role, name in names.model_dump().items():
        flag = f"--{role.replace('_', '-')}-topic"
        if flag in known:
            command += [flag, name]
    return [*command, *extra]


@functools.cache
def worker_help(tree: Tree) -> str:
    """`detok worker --help` of a tree: which flags its worker takes."""
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", "worker", "--help"],
        env=tree.environment(), cwd=tree.path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


@dataclass(frozen=True)
class Tree:
    """A checkout whose `detok worker` a run starts: this one, or `--compare-with`'s (the code
    before a change), so before and after are measured in one run, under the same load."""

    label: str
    path: Path

    def environment(self) -> dict[str, str]:
        # Ahead of the editable install's finder, so the tree's own packages are imported.
        return {**os.environ, "PYTHONPATH": str(self.path)}


THIS_TREE = Tree("this", REPO_ROOT)


def start(
    command: list[str], log: Path, cpus: set[int] | None = None, tree: Tree = THIS_TREE
) -> subprocess.Popen:
    handle = log.open("w")
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(
        command,
        cwd=tree.path,
        env=tree.environment(),
        stdout=handle,
        stderr=subprocess.STDOUT,
        preexec_fn=pin,
    )


@contextlib.contextmanager
def load_apart_from_worker(broker_dir: Path) -> Iterator[set[int] | None]:
    """Move this process (the paced producer, the delta reader) and the local broker onto the
    last CPU, and yield the others for the worker under test.

    With two cores the generator and the broker otherwise take turns on the worker's core:
    the worker's own processing ran 1.2-2x slower than when draining, so "half the maximum"
    measured while draining was 85-100% of what it could do live, and one hiccup made seconds
    of backlog. The broker still runs on the same host, as the target says; the worker just has
    a core of its own, as it would in a deployment.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield None
        return
    load = {cpus[-1]}
    broker = broker_status(broker_dir)
    pids = [os.getpid()] + ([broker.pid] if broker else [])
    tasks = [int(t) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
    for task in tasks:
        _set_affinity(task, load)
    try:
        yield set(cpus[:-1])
    finally:
        for task in tasks:
            _set_affinity(task, set(cpus))


def _set_affinity(task: int, cpus: set[int]) -> None:
    # A thread may have ended meanwhile, or the broker may not be ours to move.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.sched_setaffinity(task, cpus)


def attach_profiler(pid: int, output: Path) -> subprocess.Popen:
    """py-spy on a running worker; `--idle` so time spent waiting on decode_batch's threads or
    on the broker shows up too. It stops by itself when the worker exits."""
    command = ["py-spy", "record", "-r", "200", "--idle", "-f", "raw", "-o", str(output)]
    return subprocess.Popen(
        [*command, "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_for(predicate: Any, what: str, bound_s: float = WAIT_BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def end_offsets(connection: KafkaConnection, topic: str) -> dict[int, int]:
    consumer = make_consumer(connection, {"group.id": "bench-offsets"})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), 30)[1] for p in parts}
    finally:
        consumer.close()


def committed_offsets(
    connection: KafkaConnection, group: str, topic: str, parts: list[int]
) -> dict[int, int]:
    consumer = make_consumer(connection, {"group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in parts], 30)
        return {tp.partition: tp.offset for tp in committed}
    finally:
        consumer.close()


def drop_topics(connection: KafkaConnection, names: TopicNames, keep: str | None = None) -> None:
    """Delete a measured run's topics (all but `keep`): a broker left with every run's
    partitions slows down the runs after it (see `workers.kafka.topics.delete_topics`)."""
    wanted = [topic for topic in names.model_dump().values() if topic != keep]
    for topic in delete_topics(connection, wanted):
        print(f"# could not delete topic {topic}", file=sys.stderr)


def initial_rebalance_delay_ms(connection: KafkaConnection) -> int | None:
    """The broker's `group.initial.rebalance.delay.ms`: how long a new group waits for more
    members before its first assignment. The local broker's is 0 (tests form groups by the
    hundred); Kafka's default is 3000. With 0, of two workers started together the first takes
    every partition and the second joins a running group, so a two-worker drain includes one
    rebalance. None if the broker does not say (e.g. no DESCRIBE_CONFIGS ACL on the cluster)."""
    admin = make_admin(connection)
    broker = min(cluster_metadata(admin, METADATA_TIMEOUT_S).brokers)
    resource = ConfigResource(ResourceType.BROKER, str(broker))
    try:
        configs = admin.describe_configs([resource])[resource].result(timeout=METADATA_TIMEOUT_S)
    except (KafkaException, TimeoutError):  # only leaves the row out: no run depends on it
        return None
    return int(configs[GROUP_DELAY].value)


def summaries(log: Path) -> list[dict[str, Any]]:
    return [json.loads(m.group(1)) for m in SUMMARY.finditer(log.read_text())]


# -- end to end ---------------------------------------------------------------------------------


def run_workers(
    kafka: Kafka,
    workload: Workload,
    input_topic: str,
    workers: int,
    guarantee: str,
    logs: Path,
    profile: Path | None,
    tree: Tree = THIS_TREE,
) -> WorkerRun:
    label = f"{workers} worker{'s' if workers > 1 else ''}, {guarantee}"
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    names = topics(prefix, input_topic)
    ensure_topics(kafka.connection, names, PARTITIONS)
    group = f"{prefix}-group"
    processes = []
    for index in range(workers):
        log = logs / f"{prefix}-{index}.log"
        command = worker_command(
            kafka,
            names,
            group,
            workload.specs,
            "--guarantee",
            guarantee,
            "--instance-id",
            f"{prefix}-{index}",
            tree=tree,
        )
        processes.append((start(command, log, tree=tree), log))
    profiler = None
    if profile is not None:
        profiler = attach_profiler(processes[0][0].pid, profile)
    # Done when the group has committed every input offset; then SIGTERM, and each worker logs
    # its summary. (`--exit-when-idle` cannot tell "done" from "between two rebalance rounds".)
    ends = end_offsets(kafka.connection, input_topic)

    def done() -> bool:
        for process, log in processes:
            if process.poll() is not None:  # a worker that cannot start ends the wait at once
                raise WorkerCrashed(f"worker exited {process.returncode}; see {log}")
        return committed_offsets(kafka.connection, group, input_topic, list(ends)) == ends

    wait_for(done, f"{label} to commit the whole input")
    found = []
    for process, log in processes:
        process.send_signal(signal.SIGTERM)
        code = process.wait(WAIT_BOUND_S)
        if code != 0:
            raise WorkerCrashed(f"worker exited {code}; see {log}")
        found += summaries(log)
    if profiler is not None:
        profiler.wait(60)
    first = min(s["first_consume_at"] for s in found if s["first_consume_at"])
    last = max(s["last_commit_at"] for s in found if s["last_commit_at"])
    tokens = sum(s["generated_tokens"] for s in found)
    if tokens < workload.generated_tokens:
        raise RuntimeError(f"{label}: decoded {tokens} of {workload.generated_tokens} tokens")
    # More than the workload: work decoded again after a commit that did not take (a
    # transaction aborted by a rebalance, offsets refused, partitions lost). Not an error of
    # the output (the committed topics hold each token once): the cost is reported instead.
    redone = tokens - workload.generated_tokens
    if redone:
        reported = sum(s.get("redone_tokens", 0) for s in found)
        aborted = sum(s.get("aborted_commits", 0) for s in found)
        print(
            f"# {label}: {redone:,} tokens decoded twice after rebalances "
            f"({aborted} commits did not take; the workers counted {reported:,} redone)",
            file=sys.stderr,
        )
    peak = max(s["peak_rss"] for s in found)
    drop_topics(kafka.connection, names, keep=input_topic)
    return WorkerRun(
        label,
        workers,
        guarantee,
        last - first,
        workload.generated_tokens,
        peak,
        found,
        redone,
        tree=tree.label,
    )


# -- latency ------------------------------------------------------------------------------------


def timed_events(records: list[dict[str, Any]]) -> list[tuple[bytes, bytes, int]]:
    """(key, value, seq) in replay order, encoded up front so pacing measures nothing else."""
    lines = iter(json.dumps(r).encode() for r in records)
    out = []
    for key, value in replay_events(jsonl_records(lines), CHUNK):
        out.append((key or b"", value, json.loads(value)["seq"]))
    return out


def latency_run(
    kafka: Kafka,
    workload: Workload,
    tokens_per_s: float,
    seconds: float,
    logs: Path,
    prefix: str,
    tree: Tree = THIS_TREE,
    join: bool = False,
) -> dict[str, Any]:
    """p50/p99 of produce -> committed delta, one exactly-once worker at `tokens_per_s`.

    With `join`, a second worker is started as the measured load begins and joins the running
    group mid-load; the figures then say when its first output became visible to a reader after
    its assignment (`join`), and the delay percentiles include the rebalance. `prefix` names
    the run's topics, made ahead (`ReadyTopics`).
    """
    names = topics(prefix)
    group = f"{prefix}-group"
    per_request = workload.generated_tokens / workload.requests
    wanted = max(50, int(tokens_per_s * seconds / per_request))
    # A join run must outlast the second worker's start-up, so it may reuse the workload's
    # requests (under new ids); a latency run keeps to the workload, as it always did.
    records = _cycled(workload.records, wanted) if join else workload.records[:wanted]
    events = timed_events(records)
    tokens = sum(len(r["output_token_ids"]) for r in records)
    events_per_s = len(events) * tokens_per_s / tokens
    log = logs / f"{prefix}.log"
    join_log = logs / f"{prefix}-joining.log"
    command = worker_command(
        kafka, names, group, workload.specs, "--instance-id", prefix, tree=tree
    )
    join_command = worker_command(
        kafka, names, group, workload.specs, "--instance-id", f"{prefix}-joining", tree=tree
    )
    received: dict[tuple[str, int], tuple[float, float]] = {}
    arrivals: list[tuple[int, float, float]] = []  # (partition, created, seen) of each delta
    joining = None
    every_cpu = os.sched_getaffinity(0)  # before this process is pinned with the broker
    with load_apart_from_worker(kafka.broker_dir) as worker_cpus:
        worker = start(command, log, worker_cpus, tree)
        reader_done = threading.Event()
        reader = threading.Thread(
            target=_read_deltas,
            args=(kafka.connection, names.deltas, received, reader_done, arrivals),
            daemon=True,
        )
        reader.start()
        try:
            wait_for(lambda: "restored" in log.read_text(), "the latency worker's assignment")
            # Warm-up, not measured: the first batches of a fresh process (caches, the first
            # transaction, the reader's own join) are start-up, not the steady-state delay of
            # the target.
            warm = timed_events(
                [{**r, "request_id": f"warm-{r['request_id']}"} for r in workload.records[:20]]
            )
            _paced_produce(kafka.connection, names.input, warm, events_per_s)
            warm_finals = set({k.decode(): s for k, _, s in warm}.items())
            wait_for(lambda: warm_finals <= received.keys(), "the warm-up's deltas")
            if join:
                # Not pinned: it stands for a worker on another machine, and pinned beside the
                # first its start-up (loading tokenizers) would stall that one instead. Given
                # every CPU explicitly: a child inherits this process's pin, the broker's core,
                # and there its start-up starved the broker for seconds; once, past the broker's
                # 9 s session with its own controller, which fenced it, leaving every partition
                # without a leader (that run's delay p99: 41 s).
                joining = start(join_command, join_log, every_cpu, tree)
            produced = _paced_produce(kafka.connection, names.input, events, events_per_s)
            finals = set({k.decode(): s for k, _, s in events}.items())  # the finish: last seq
            wait_for(lambda: finals <= received.keys(), "every request's final delta", bound_s=120)
        finally:
            reader_done.set()
            for process in (worker, joining):
                if process is not None:
                    process.send_signal(signal.SIGTERM)
                    process.wait(60)
    visible, worker_side = [], []
    for (request_id, seq), at in produced.items():
        if seq == 0:
            continue  # prompts produce no delta of their own
        seen, created = received[(request_id, _covering(received, request_id, seq))]
        visible.append(seen - at)
        worker_side.append(created - at)
    drop_topics(kafka.connection, names)
    result = {
        "tree": tree.label,
        "events_per_s": events_per_s,
        "tokens_per_s": tokens_per_s,
        "events": len(events),
        "p50_ms": 1000 * _quantile(visible, 0.5),
        "p99_ms": 1000 * _quantile(visible, 0.99),
        "worker_p50_ms": 1000 * _quantile(worker_side, 0.5),
        "worker_p99_ms": 1000 * _quantile(worker_side, 0.99),
    }
    if join:
        result["join"] = joining_worker(join_log, arrivals)
    return result


@dataclass
class ReadyTopics:
    """Topic sets made ahead of the latency and join runs that use them (see TOPIC_SETTLE_S)."""

    prefixes: list[str]
    ready_at: float  # monotonic

    @classmethod
    def create(cls, kafka: Kafka, count: int) -> ReadyTopics:
        prefixes = [f"bench-lat-{uuid.uuid4().hex[:8]}" for _ in range(count)]
        for prefix in prefixes:
            ensure_topics(kafka.connection, topics(prefix), PARTITIONS)
        return cls(prefixes, time.monotonic() + TOPIC_SETTLE_S)

    def take(self) -> str:
        """The next set's prefix, once the sets are TOPIC_SETTLE_S old."""
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.prefixes.pop(0)

    def drop_unused(self, kafka: Kafka) -> None:
        """Delete the sets no run took (a run failed): each run drops its own."""
        for prefix in self.prefixes:
            drop_topics(kafka.connection, topics(prefix))


def _cycled(records: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`count` requests from `records`, repeated under new ids once they run out."""
    out = records[:count]
    while len(out) < count:
        lap = len(out) // len(records)
        out += [
            {**r, "request_id": f"{r['request_id']}-{lap}"} for r in records[: count - len(out)]
        ]
    return out


ASSIGNED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO detok\.worker\[\d+\]: "
    r"assigned partitions \[(\d[\d, ]*)\]$",
    re.MULTILINE,
)


def joining_worker(log: Path, arrivals: list[tuple[int, float, float]]) -> dict[str, Any]:
    """When the joining worker's first output became visible, from outside: the first delta a
    read_committed reader received on one of the partitions the worker was assigned, produced
    after that assignment (the partition's deltas from before were committed by the worker that
    gave it up, in its revoke). Works for any tree: the assignment time is the worker's
    `assigned partitions` log line, which every version writes. The worker's own timeline (from
    its run summary) is added where the tree has one."""
    text = log.read_text()
    found = ASSIGNED.search(text)
    if found is None:
        return {"assigned": False}
    assigned_at = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    partitions = {int(p) for p in found.group(2).split(",")}
    after = [
        (seen, created)
        for partition, created, seen in arrivals
        if partition in partitions and created >= assigned_at
    ]
    first = min(after, default=None)
    runs = summaries(log)
    return {
        "assigned": True,
        "partitions": sorted(partitions),
        "first_visible_s": None if first is None else first[0] - assigned_at,
        "first_produced_s": None if first is None else first[1] - assigned_at,
        "timeline": runs[0].get("timeline") if runs else None,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def _covering(received: dict[tuple[str, int], Any], request_id: str, seq: int) -> int:
    """The seq_end of the delta that covers `seq` (the first delta ending at or after it)."""
    while (request_id, seq) not in received:
        seq += 1
    return seq


def _read_deltas(
    connection: KafkaConnection,
    topic: str,
    received: dict[tuple[str, int], tuple[float, float]],
    done: threading.Event,
    arrivals: list[tuple[int, float, float]],
) -> None:
    """(receive time, produce time) of each delta, keyed by (request, seq_end); read_committed,
    low fetch wait, so the reader's own polling adds a few milliseconds at most. The produce time
    (the worker's, at its commit) separates the worker's delay from the reader's."""
    consumer = make_consumer(
        connection,
        {
            "group.id": f"bench-deltas-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 10,
        },
    )
    consumer.subscribe([topic])
    try:
        while not done.is_set():
            # consume() returns when its batch is full or its timeout ends, and every message of
            # the batch is stamped when it returns: at low rates a 50 ms timeout stamped deltas up
            # to 50 ms late. 10 ms keeps that error small for a few wake-ups more a second.
            for message in consumer.consume(1000, READER_WAIT_S):
                if message.error():
                    continue
                now = time.time()
                delta = json.loads(message.value())
                created = message.timestamp()[1] / 1000
                received[(delta["request_id"], delta["seq_end"])] = (now, created)
                arrivals.append((message.partition(), created, now))
    finally:
        consumer.close()


def _paced_produce(
    connection: KafkaConnection,
    topic: str,
    events: list[tuple[bytes, bytes, int]],
    events_per_s: float,
) -> dict[tuple[str, int], float]:
    """Produce `events` at `events_per_s`, in bursts of whatever is due every PACE_TICK_S, and
    return each one's produce time. The generator shares the 2 cores with the broker and the
    worker under test, so it does as little per event as it can: one produce and one clock
    read, times kept in a list and keyed only afterwards."""
    # It stands in for an inference server's plain producer. With detok's idempotent default the
    # load generator itself added ~0.5 s to the measured p99 (paired runs, same worker), which
    # is no cost of the worker's. One request in flight keeps its order anyway: with several, a
    # retried batch (a broker slow for seconds during a rebalance's aborts) landed a prompt after
    # its own tokens, which the worker rightly dead-lettered ("no prompt event"), and the run then
    # waited in vain for those requests' final deltas.
    producer = make_producer(
        connection,
        {
            "linger.ms": 5,
            "enable.idempotence": False,
            "max.in.flight.requests.per.connection": 1,
        },
    )
    produced_at = [0.0] * len(events)
    started = time.time()
    index = 0
    while index < len(events):
        due = min(len(events), int((time.time() - started) * events_per_s) + 1)
        while index < due:
            key, value, _ = events[index]
            try:
                producer.produce(topic, value, key)
            except BufferError:
                # The client's queue is full (100k records: a full run's join phase, with the
                # broker slowed by the rebalance and one request in flight): wait for deliveries
                # instead of failing the run. Times are taken at produce, so the wait is not
                # counted as the worker's delay; the pace catches up after it.
                producer.poll(PACE_TICK_S)
                continue
            produced_at[index] = time.time()
            index += 1
        producer.poll(0)
        time.sleep(PACE_TICK_S)
    producer.flush(60)
    return {(key.decode(), seq): at for (key, _, seq), at in zip(events, produced_at, strict=True)}


# -- memory and restore -------------------------------------------------------------------------


def vm_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(rest.split()[0]) * 1024
    return fields


def measure_open_requests(
    kafka: Kafka,
    topic: str,
    group: str,
    pid: int,
    batches: Iterable[Iterable[tuple[str, bytes]]],
    *,
    linger_ms: int,
    settle_s: float,
) -> list[dict[str, int]]:
    """Produce each batch of (key, value) records to `topic`, wait until `group` has committed
    all of it, and read the worker `pid`'s memory: one `vm_status` per batch.

    The commit says the worker has taken every record into its open requests; `settle_s` then
    lets its allocator and the changelog producer's buffers come to rest before the reading."""
    readings = []
    for batch in batches:
        producer = make_producer(kafka.connection, {"linger.ms": linger_ms})
        for key, value in batch:
            while True:
                try:
                    producer.produce(topic, value, key)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    producer.poll(0.05)
            producer.poll(0)
        producer.flush(120)
        ends = end_offsets(kafka.connection, topic)
        wait_for(
            lambda e=ends: committed_offsets(kafka.connection, group, topic, list(e)) == e,
            "the memory worker's commit",
        )
        time.sleep(settle_s)
        readings.append(vm_status(pid))
    return readings


def memory_and_restore(kafka: Kafka, workload: Workload, active: int, logs: Path) -> dict[str, Any]:
    """Fill a worker with `active` unfinished requests in two halves, measure RSS at each, then
    kill -9 it and time its successor's restore."""
    prefix = f"bench-mem-{uuid.uuid4().hex[:8]}"
    names = topics(prefix)
    ensure_topics(kafka.connection, names, PARTITIONS)
    group = f"{prefix}-group"
    records = (workload.records * (active // workload.requests + 1))[:active]
    # Prompt and two chunks of each: started, text accumulated, not finished.
    halves = [records[: active // 2], records[active // 2 :]]
    log = logs / f"{prefix}-a.log"
    command = worker_command(kafka, names, group, workload.specs, "--instance-id", prefix)
    worker = start(command, log)

    def opened(half_index: int, half: list[dict[str, Any]]) -> Iterator[tuple[str, bytes]]:
        for position, record in enumerate(half):
            generation = LoggedGeneration.model_validate(
                {**record, "request_id": f"{record['request_id']}-m{half_index}-{position}"}
            )
            for event in generation_events(generation, CHUNK)[:3]:
                yield generation.request_id, encode_event(event)

    try:
        wait_for(lambda: "restored" in log.read_text(), "the memory worker's assignment")
        rss = measure_open_requests(
            kafka,
            names.input,
            group,
            worker.pid,
            (opened(index, half) for index, half in enumerate(halves)),
            linger_ms=20,
            settle_s=0.5,
        )
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(60)
    per_request = (rss[1]["VmRSS"] - rss[0]["VmRSS"]) / len(halves[1])
    log_b = logs / f"{prefix}-b.log"
    successor = start(command, log_b)
    try:
        wait_for(
            lambda: sum(int(m.group(1)) for m in RESTORED.finditer(log_b.read_text())) >= active,
            "the successor's restore",
        )
        time.sleep(0.2)
        restores = RESTORED.findall(log_b.read_text())
        after_restore = vm_status(successor.pid)
    finally:
        successor.send_signal(signal.SIGTERM)
        successor.wait(60)
    drop_topics(kafka.connection, names)
    return {
        "active_requests": active,
        "rss_half": rss[0]["VmRSS"],
        "rss_full": rss[1]["VmRSS"],
        "peak_rss": rss[1]["VmHWM"],
        "bytes_per_active_request": per_request,
        "growth_per_10k_mb": per_request * 10_000 / 2**20,
        "restored_requests": sum(int(n) for n, _ in restores),
        "restore_s": sum(float(s) for _, s in restores),
        "rss_after_restore": after_restore["VmRSS"],
    }


# -- profile ------------------------------------------------------------------------------------


def top_frames(raw: Path, limit: int = 15) -> list[tuple[float, str]]:
    """Self-time share of the hottest frames of the worker's loop (start-up, such as loading the
    tokenizers, left out) in a py-spy raw (collapsed-stack) file."""
    self_counts: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "WorkerLoop.step" not in stack:
            continue
        frame = stack.rsplit(";", 1)[-1]
        self_counts[frame] = self_counts.get(frame, 0) + int(count)
        total += int(count)
    ranked = sorted(self_counts.items(), key=lambda item: -item[1])[:limit]
    return [(count / total, frame) for frame, count in ranked]


# -- report -------------------------------------------------------------------------------------


def add_local_broker_option(parser: argparse.ArgumentParser) -> None:
    """`--broker-data-dir`, read by `kafka_from`."""
    parser.add_argument(
        "--broker-data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="the local broker's state directory (`detok broker start --data-dir`), e.g. on "
        "tmpfs to measure without the disk's stalls (docs/performance.md, 'The broker's "
        "storage'); started there if no broker answers",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_connection_options(parser)
    parser.add_argument("--shared-dir", type=Path, default=REPO_ROOT.parent / "shared")
    add_local_broker_option(parser)
    parser.add_argument("--tokenizers", default=",".join(DEFAULT_TOKENIZERS))
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--active", type=int, default=10_000, help="requests for memory/restore")
    parser.add_argument("--quick", action="store_true", help="4,000 requests, 4,000 active")
    parser.add_argument("--latency-seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each e2e variant")
    parser.add_argument("--profile", type=Path, help="py-spy the 1-worker exactly-once run here")
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="TREE",
        help="another checkout (e.g. `git worktree add /tmp/base <commit>`) whose workers run "
        "beside this tree's in the same rotation: before/after figures from one run",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--drain-only",
        action="store_true",
        help="only the drain rows (1 and 2 workers, both guarantees): no latency, join or "
        "memory rows, for a quicker paired before/after of scaling out",
    )
    parser.add_argument(
        "--three-brokers",
        action="store_true",
        help="also: 1 worker exactly-once on a local three-node cluster beside one broker",
    )
    parser.add_argument(
        "--sasl-ssl", action="store_true", help="also 1 worker over SASL_SSL (bench_secured.py)"
    )
    parser.add_argument(
        "--stop-signals",
        action="store_true",
        help="also: the delay from the tokens event completing a stop string to an engine's "
        "receipt of its stop signal, and the ids an engine could skip, at half the 1-worker "
        "rate (bench/stop_signal_delay.py); with --drain-only, after the drain rows",
    )
    return parser


def stop_signal_rows(
    kafka: Kafka, workload: Workload, max_rate: float, args: argparse.Namespace, logs: Path,
    note: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """The stop-signal run at half of `max_rate`, LATENCY_REPEATS times; the median by p99."""
    from bench import stop_signal_delay  # imports this module: only when asked for

    ready = ReadyTopics.create(kafka, LATENCY_REPEATS)
    try:
        runs = []
        for _ in range(LATENCY_REPEATS):
            run = stop_signal_delay.stop_signal_run(
                kafka, workload, max_rate * 0.5, args.latency_seconds, logs, ready.take()
            )
            runs.append(run)
            note(f"stop signals at {run['tokens_per_s']:,.0f} tok/s: p50 {run['p50_ms']:.0f} "
                 f"ms, p99 {run['p99_ms']:.0f} ms")  # fmt: skip
        return _median_p99(runs)
    finally:
        ready.drop_unused(kafka)


def delay_rows(
    kafka: Kafka,
    workload: Workload,
    max_rate: float,
    trees: list[Tree],
    args: argparse.Namespace,
    logs: Path,
    note: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The delay rows at half and a quarter of `max_rate` (this tree's one-worker rate; every
    tree is measured at the same rates), and a worker joining the running group at a quarter.

    Each runs LATENCY_REPEATS times per tree and the run with the median p99 is reported (all
    p99s alongside): on this shared machine one host-side stall of a second within an 8 s run
    sets that run's p99, and a median is not decided by one such stall.
    """
    ready = ReadyTopics.create(kafka, 3 * LATENCY_REPEATS * len(trees))
    try:
        latencies = []
        for share in (0.5, 0.25):
            rate = max_rate * share
            repeats: dict[str, list[dict[str, Any]]] = {tree.label: [] for tree in trees}
            for repeat in range(LATENCY_REPEATS):
                for tree in _in_turn(trees, repeat):
                    run = latency_run(
                        kafka, workload, rate, args.latency_seconds, logs, ready.take(), tree
                    )
                    repeats[tree.label].append(run)
                    note(f"{tree.label}: delay at {rate:,.0f} tok/s: p99 {run['p99_ms']:.0f} ms")
            latencies.append(
                {"share": share, **{label: _median_p99(r) for label, r in repeats.items()}}
            )
        joins: dict[str, list[dict[str, Any]]] = {tree.label: [] for tree in trees}
        for repeat in range(LATENCY_REPEATS):
            for tree in _in_turn(trees, repeat):
                seconds = max(args.latency_seconds, JOIN_RUN_S)
                run = latency_run(
                    kafka,
                    workload,
                    max_rate * JOIN_RATE_SHARE,
                    seconds,
                    logs,
                    ready.take(),
                    tree,
                    join=True,
                )
                joins[tree.label].append(run)
                first = run["join"].get("first_visible_s")
                shown = "never" if first is None else f"{first:.2f} s"
                note(f"{tree.label}: joining worker's first output {shown} after its assignment")
        return latencies, joins
    finally:
        ready.drop_unused(kafka)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.active = 4000, 4000
    try:
        kafka = kafka_from(args)
    except KafkaConfigError as error:  # its message never quotes a secret
        parser.error(str(error))
    cache = Path(tempfile.gettempdir()) / "detok-bench"
    cache.mkdir(exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="detok-e2e-"))
    note = _note(args.json)
    trees = [THIS_TREE]
    if args.compare_with is not None:
        trees.append(Tree("base", args.compare_with.resolve()))

    workload = build_workload(args.shared_dir, args.tokenizers.split(","), args.requests, cache)
    note(f"workload: {workload.requests} requests, {workload.generated_tokens} generated tokens")
    core = Core(workload)
    core_alone = core.throughput()
    core_with_parse = core.throughput(parse=True)
    note(f"core: {core_alone:,.0f} tokens/s; with parsing: {core_with_parse:,.0f} tokens/s")

    input_topic = f"bench-{uuid.uuid4().hex[:8]}.tokens"
    ensure_topics(kafka.connection, topics("unused", input_topic), PARTITIONS)
    started = time.perf_counter()
    totals = replay(kafka.connection, workload.path, input_topic, chunk_size=CHUNK, progress=False)
    replay_s = time.perf_counter() - started
    note(f"replay: {totals.events} events in {replay_s:.1f}s")

    # Each variant runs `--repeats` times in rotating order (the broker's page cache and
    # compaction make the first run of a series slower), each tree in turn (the order flips
    # every repeat); the best run of each is reported.
    variants = [(w, g) for g in ("exactly-once", "at-least-once") for w in (1, 2)]
    best: dict[tuple[str, int, str], WorkerRun] = {}
    crashes: dict[str, int] = {}
    cores = [core_alone]
    for repeat in range(args.repeats):
        for workers, guarantee in variants[repeat % 4 :] + variants[: repeat % 4]:
            for tree in _in_turn(trees, repeat):
                profile = None
                paired_core = None
                if (tree, workers, guarantee) == (THIS_TREE, 1, "exactly-once"):
                    paired_core = core.throughput()
                    cores.append(paired_core)
                    if args.profile and repeat == 0:
                        args.profile.mkdir(parents=True, exist_ok=True)
                        profile = args.profile / "worker-eos.raw"
                try:
                    run = run_workers(
                        kafka, workload, input_topic, workers, guarantee, logs, profile, tree
                    )
                except WorkerCrashed as crash:
                    if tree == THIS_TREE:
                        raise
                    note(f"{tree.label}: {workers} worker(s), {guarantee}: {crash}")
                    crashes[tree.label] = crashes.get(tree.label, 0) + 1
                    continue
                run.core_tokens_per_s = paired_core
                paired = f", core just before: {paired_core:,.0f}" if paired_core else ""
                note(
                    f"{tree.label}: {run.label}: {run.tokens_per_s:,.0f} tokens/s "
                    f"({run.seconds:.2f}s{paired})"
                )
                key = (tree.label, workers, guarantee)
                if key not in best or run.tokens_per_s > best[key].tokens_per_s:
                    best[key] = run
    runs = [best[key] for tree in trees for v in variants if (key := (tree.label, *v)) in best]
    sasl_ssl = None
    if args.sasl_ssl:  # a plaintext run paired with each SASL_SSL one, on a secured broker
        from bench import bench_secured  # imports this module: only when asked for

        plaintext = partial(run_workers, kafka, workload, input_topic, 1, "exactly-once", logs)
        sasl_ssl = bench_secured.compare(workload, logs, args.repeats, plaintext, note)
    # The core's parsed events are 100s of MB of Python objects; freed, this process's paced
    # producer and delta reader (on the same 2 cores as the worker under test) run leaner.
    del core
    eos1 = runs[0]
    alos1 = runs[2]
    latencies, joins = [], {tree.label: [] for tree in trees}
    join_rate = eos1.tokens_per_s * JOIN_RATE_SHARE
    if not args.drain_only:
        latencies, joins = delay_rows(kafka, workload, eos1.tokens_per_s, trees, args, logs, note)
    stop_signals = None
    if args.stop_signals:
        stop_signals = stop_signal_rows(kafka, workload, eos1.tokens_per_s, args, logs, note)
    memory = None if args.drain_only else memory_and_restore(kafka, workload, args.active, logs)
    three_brokers = None
    if args.three_brokers:
        three_brokers = three_broker_row(kafka, workload, input_topic, logs, note)
    delete_topics(kafka.connection, [input_topic])

    report = {
        "workload": {
            "requests": workload.requests,
            "generated_tokens": workload.generated_tokens,
            "events": totals.events,
            "chunk": CHUNK,
            "partitions": PARTITIONS,
            "tokenizers": args.tokenizers.split(","),
            "replay_s": replay_s,
        },
        "trees": {tree.label: str(tree.path) for tree in trees},
        "crashed_runs": crashes,
        "core_tokens_per_s": statistics.median(cores),
        "core_runs_tokens_per_s": cores,
        "core_with_parse_tokens_per_s": core_with_parse,
        "runs": [
            {
                "tree": r.tree,
                "label": r.label,
                "workers": r.workers,
                "guarantee": r.guarantee,
                "seconds": r.seconds,
                "tokens_per_s": r.tokens_per_s,
                "vs_core": r.tokens_per_s / (r.core_tokens_per_s or statistics.median(cores)),
                "core_paired": r.core_tokens_per_s is not None,
                "peak_rss": r.peak_rss,
                "redone_tokens": r.redone_tokens,
                **{
                    counter: sum(s.get(counter, 0) for s in r.summaries)
                    for counter in ("aborted_commits", "recommitted_commits")
                },
                "joining_timeline": joining_timeline(r.summaries),
            }
            for r in runs
        ],
        "worker_time_shares": eos1.time_shares(),
        "exactly_once_cost": 1 - eos1.tokens_per_s / alos1.tokens_per_s,
        "latency": latencies,
        "join": None
        if args.drain_only
        else {
            "tokens_per_s": join_rate,
            **{label: _median_join(r) for label, r in joins.items()},
        },
        "memory": memory,
        "commit_interval_ms": COMMIT_INTERVAL_MS,
        "initial_rebalance_delay_ms": initial_rebalance_delay_ms(kafka.connection),
        "logs": str(logs),
        **({"sasl_ssl": sasl_ssl} if sasl_ssl else {}),
    }
    if three_brokers is not None:
        report["three_brokers"] = three_brokers
    if stop_signals is not None:
        report["stop_signals"] = stop_signals
    if args.profile:
        frames = top_frames(args.profile / "worker-eos.raw")
        report["profile_top_self"] = [[share, frame] for share, frame in frames]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def three_broker_row(
    kafka: Kafka, workload: Workload, input_topic: str, logs: Path, note: Any
) -> dict[str, float]:
    """One worker, exactly-once, on a local three-node cluster (replication 3, min ISR 2, so
    every transaction waits for a second replica) and, right before it, on the one broker: the
    cost of replication, paired in one run."""
    single = run_workers(kafka, workload, input_topic, 1, "exactly-once", logs, None)
    data_dir = Path(tempfile.mkdtemp(prefix="detok-bench-cluster-"))
    cluster = start_cluster(3, port=free_port_block(6), data_dir=data_dir)
    try:
        # A plaintext cluster of its own: the given client configuration is for `kafka`'s.
        three_kafka = Kafka(KafkaConnection(cluster.bootstrap_servers))
        cluster_topic = f"bench-{uuid.uuid4().hex[:8]}.tokens"
        ensure_topics(three_kafka.connection, topics("unused", cluster_topic), PARTITIONS)
        replay(
            three_kafka.connection,
            workload.path,
            cluster_topic,
            chunk_size=CHUNK,
            progress=False,
        )
        three = run_workers(three_kafka, workload, cluster_topic, 1, "exactly-once", logs, None)
    finally:
        stop_cluster(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
    note(
        f"1 worker, exactly-once: one broker {single.tokens_per_s:,.0f} tokens/s, three brokers "
        f"{three.tokens_per_s:,.0f} tokens/s ({three.tokens_per_s / single.tokens_per_s:.2f}x)"
    )
    return {
        "one_broker_tokens_per_s": single.tokens_per_s,
        "three_brokers_tokens_per_s": three.tokens_per_s,
        "ratio": three.tokens_per_s / single.tokens_per_s,
    }


def _in_turn(trees: list[Tree], repeat: int) -> list[Tree]:
    """The trees in the order of this repeat: flipped every other one, so neither tree always
    runs first (right after the replay, or after the other's runs warmed the broker)."""
    return trees if repeat % 2 == 0 else trees[::-1]


def _median_p99(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda run: run["p99_ms"])
    return {**ordered[len(ordered) // 2], "p99_runs_ms": [run["p99_ms"] for run in ordered]}


def _median_join(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time to the joining worker's first visible output (a run in
    which it never produced output counts as the slowest)."""

    def first(run: dict[str, Any]) -> float:
        value = run["join"].get("first_visible_s")
        return float("inf") if value is None else value

    ordered = sorted(runs, key=first)
    return {
        **ordered[len(ordered) // 2],
        "first_visible_runs_s": [run["join"].get("first_visible_s") for run in ordered],
        "p99_runs_ms": [run["p99_ms"] for run in ordered],
    }


def joining_timeline(found: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of a multi-worker run, the timeline of the worker assigned partitions last (the one that
    joined a group already running); None for one worker or a tree without timelines."""
    timed = [s["timeline"] for s in found if s.get("timeline") and s["timeline"]["assignments"]]
    if len(found) < 2 or not timed:
        return None
    return max(timed, key=lambda t: t["process_started_at"] + t["assignments"][0]["since_start_s"])


def _note(quiet: bool) -> Any:
    def note(message: str) -> None:
        print(f"# {message}", file=sys.stderr if quiet else sys.stdout, flush=True)

    return note


def print_table(report: dict[str, Any]) -> None:
    core = report["core_tokens_per_s"]
    cores = report["core_runs_tokens_per_s"]
    runs = {(r["tree"], r["workers"], r["guarantee"]): r for r in report["runs"]}
    eos1 = runs[("this", 1, "exactly-once")]
    memory = report["memory"]
    interval = report["commit_interval_ms"]
    shares = report["worker_time_shares"]
    base = "base" in report["trees"]
    rows = [
        (
            "in-process core (processor, no Kafka)",
            f"{core:,.0f} tok/s",
            f"median of {len(cores)}: {min(cores):,.0f} .. {max(cores):,.0f}",
            "",
        ),
        (
            "in-process core with parsing",
            f"{report['core_with_parse_tokens_per_s']:,.0f} tok/s",
            "from the record bytes",
            "",
        ),
    ]
    for run in report["runs"]:
        if run["tree"] != "this":
            continue
        of_core = "of the core just before" if run["core_paired"] else "of the median core"
        before = runs.get(("base", run["workers"], run["guarantee"]))
        rows.append(
            (
                run["label"],
                f"{run['tokens_per_s']:,.0f} tok/s",
                f"{run['vs_core']:.0%} {of_core}, {run['seconds']:.2f}s"
                + (f"; base {before['tokens_per_s']:,.0f} tok/s" if before else ""),
                f"peak RSS {run['peak_rss'] / 2**20:.0f} MB",
            )
        )
    for run in report["runs"]:  # what rebalances cost: commits that did not take, redone work
        if run["workers"] > 1:
            rows.append(
                (
                    f"  {run['tree']}: {run['label']}: after rebalances",
                    f"{run['redone_tokens']:,} tokens redone",
                    f"{run['aborted_commits']} commits did not take, "
                    f"{run['recommitted_commits']} committed again under a new generation",
                    "",
                )
            )
    for guarantee in ("exactly-once", "at-least-once"):
        for tree in ("this", "base") if base else ("this",):
            two, one = runs.get((tree, 2, guarantee)), runs.get((tree, 1, guarantee))
            if two is None or one is None:
                crashed = report["crashed_runs"].get(tree, 0)
                rows.append((f"{tree}: 2 workers vs 1, {guarantee}", "no run", "", ""))
                rows.append((f"  {tree}: runs whose worker crashed", str(crashed), "", ""))
                continue
            ratio = two["tokens_per_s"] / one["tokens_per_s"]
            rows.append(
                (
                    f"{tree}: 2 workers vs 1, {guarantee}",
                    f"{ratio:.2f}x ({two['seconds']:.2f}s vs {one['seconds']:.2f}s)",
                    ">= 1.0x",
                    _ok(ratio >= 1.0) if tree == "this" else "",
                )
            )
    delay = report["initial_rebalance_delay_ms"]
    if delay is not None:
        rows.append(
            (
                f"  the broker's {GROUP_DELAY}",
                f"{delay} ms",
                "2 workers started together share the first assignment only if they join "
                "within it (Kafka's default 3000; docs/performance.md, 'Two workers started "
                "together')",
                "",
            )
        )
    timeline = runs[("this", 2, "exactly-once")]["joining_timeline"]
    if timeline:
        rows.append(("  2 workers EOS: the later one", _timeline(timeline), "", ""))
    rows += [
        (
            "  1 worker EOS: its wall time",
            " / ".join(f"{name} {share:.0%}" for name, share in shares.items()),
            "",
            "",
        ),
        (
            "1 worker EOS target",
            ">= 1,000,000 tok/s",
            ">= 40% of core",
            _ok(eos1["tokens_per_s"] >= 1e6 and eos1["vs_core"] >= 0.4),
        ),
        (
            "exactly-once cost vs at-least-once",
            f"{report['exactly_once_cost']:.1%}",
            "<= 15%",
            _ok(report["exactly_once_cost"] <= 0.15),
        ),
    ]
    shares_run = ("1/2", "1/4")[: len(report["latency"])]  # none with --drain-only
    for share, latency in zip(shares_run, report["latency"], strict=True):
        for tree in ("this", "base") if base else ("this",):
            figures = latency[tree]
            rows.append(
                (
                    f"{tree}: delay at {figures['tokens_per_s']:,.0f} tok/s ({share} max)",
                    f"p50 {figures['p50_ms']:.0f} ms / p99 {figures['p99_ms']:.0f} ms "
                    f"(worker-side p99 {figures['worker_p99_ms']:.0f} ms; p99 of the "
                    f"{len(figures['p99_runs_ms'])} runs: "
                    + ", ".join(f"{p99:.0f}" for p99 in figures["p99_runs_ms"])
                    + ")",
                    f"p99 <= {3 * interval} ms",
                    _ok(figures["p99_ms"] <= 3 * interval) if tree == "this" else "",
                )
            )
    join = report["join"]
    for tree in ("this", "base") if base and join else ("this",) if join else ():
        figures = join[tree]
        firsts = ", ".join(
            "never" if first is None else f"{first:.2f}"
            for first in figures["first_visible_runs_s"]
        )
        first = figures["join"].get("first_visible_s")
        rows.append(
            (
                f"{tree}: worker joining at {join['tokens_per_s']:,.0f} tok/s",
                f"first output seen {'never' if first is None else f'{first:.2f} s'} after its "
                f"assignment (runs: {firsts} s); delay p99 {figures['p99_ms']:.0f} ms",
                "<= 1 s",
                _ok(first is not None and first <= 1.0) if tree == "this" else "",
            )
        )
        if figures["join"].get("timeline"):
            rows.append(("  its timeline", _timeline(figures["join"]["timeline"]), "", ""))
    rows += (
        []
        if memory is None
        else [
            (
                f"memory per active request ({memory['active_requests']:,} active)",
                f"{memory['bytes_per_active_request']:,.0f} B "
                f"({memory['growth_per_10k_mb']:.1f} MB / 10k)",
                "<= 2 KB",
                _ok(memory["bytes_per_active_request"] <= 2048),
            ),
            (
                f"restore of {memory['restored_requests']:,} active requests after kill -9",
                f"{memory['restore_s']:.2f} s",
                "<= 3 s",
                _ok(memory["restore_s"] <= 3.0),
            ),
        ]
    )
    rows += stop_signal_table_rows(report.get("stop_signals"), interval)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    if "profile_top_self" in report:
        print("\nhottest frames (self time) of the 1-worker exactly-once run:")
        for share, frame in report["profile_top_self"]:
            print(f"  {share:6.1%}  {frame}")


def stop_signal_table_rows(
    figures: dict[str, Any] | None, interval: int
) -> list[tuple[str, str, str, str]]:
    """The `--stop-signals` rows: delay, and the ids after stops the engine could skip."""
    if figures is None:
        return []
    runs = ", ".join(f"{p99:.0f}" for p99 in figures["p99_runs_ms"])
    return [
        (
            f"stop signal at {figures['tokens_per_s']:,.0f} tok/s ({figures['stopped']:,} stops)",
            f"p50 {figures['p50_ms']:.0f} ms, p99 {figures['p99_ms']:.0f} ms (p99 runs: {runs})",
            f"commit interval {interval} ms",
            "",
        ),
        (
            "  ids after the stops, this run",
            f"{figures['ids_after_stops']:,} ids; made before the signal came: "
            f"{figures['ids_before_signal']:,}; skippable: {figures['ids_skippable']:,} "
            f"({figures['skippable_share']:.0%}) at the paced "
            f"{figures['ids_per_s_per_request'] or 0:,.0f} ids/s per request",
            "",
            "",
        ),
        *(
            (
                f"  simulated engine, {sim['ids_per_s_per_request']:.0f} ids/s per request, "
                f"max_tokens {sim['max_tokens'] or 'as scripted'}",
                f"{sim['ids_after_stops']:,} ids after the stops; skippable "
                f"{sim['ids_skippable']:,} ({sim['skippable_share']:.0%}); made before the "
                f"signal: {sim['wasted_per_stop']:.1f} per stop",
                "",
                "",
            )
            for sim in figures["simulated"]
        ),
    ]


def _timeline(timeline: dict[str, Any]) -> str:
    """One worker's phases: after process start, then after its first assignment."""
    since_start = [f"{phase} +{at:.2f}" for phase, at in timeline["since_start_s"].items()]
    if not timeline["assignments"]:
        return "s after start: " + ", ".join(since_start)
    first = timeline["assignments"][0]
    since_start.append(f"assigned {first['partitions']} +{first['since_start_s']:.2f}")
    after = [f"{phase} +{at:.2f}" for phase, at in first["since_assignment_s"].items()]
    return "s after start: " + ", ".join(since_start) + "; s after that: " + ", ".join(after)


def _ok(passed: bool) -> str:
    return "ok" if passed else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
