"""Black-box plumbing for the poison-record and fault regressions (issue 16).

Everything goes through what a user has: `detok topics ensure` and `detok worker` run as
subprocesses of the CLI, raw confluent-kafka producers to plant records (any bytes, any key,
headers, partition or timestamp) and read_committed readers for what the worker wrote. Nothing
here imports the worker's internals, so these tests keep specifying the required behaviour
while the code under them is restructured.

Every process a test starts is stopped by its own pid in a `finally` (see `started_worker`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from tests.conftest import REPO_ROOT
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import models, read_messages
from workers.cli import main as cli_main
from workers.kafka.topics import TopicNames

# A worker given `--exit-when-idle` stops a few seconds after its input is drained; on a loaded
# machine its start-up (tokenizer tables, group join, restore) takes up to ~20 s more. Twice the
# shared wait bound only turns a hang or a crash loop into a failure; it measures no speed.
WORKER_EXIT_BOUND_S = WAIT_BOUND_S * 2
# The producer's own record limit must exceed the ~1 MB records some tests plant on purpose
# (librdkafka's default of 1,000,000 bytes would refuse them before the broker sees them).
PLANT_MAX_MESSAGE_BYTES = 4_000_000
# `detok worker` logs one line `run summary {json}` when it stops normally.
RUN_SUMMARY_MARK = "run summary "


@dataclass(frozen=True)
class Record:
    """One record to plant, exactly as given: no re-encoding of the value."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] | None = None
    partition: int | None = None
    timestamp_ms: int = 0  # 0: the producer's current time


@dataclass(frozen=True)
class Pipeline:
    """One test's own set of topics and consumer group, on one broker."""

    bootstrap: str
    names: TopicNames
    group: str
    log_dir: Path


@dataclass
class WorkerProcess:
    """A running (or finished) `detok worker` subprocess and where its output goes."""

    process: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, bound_s: float = WORKER_EXIT_BOUND_S) -> int | None:
        """Its exit code, or None if it is still running after `bound_s`."""
        try:
            return self.process.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr()

    def tail(self, lines: int = 40) -> str:
        """The last lines of its output, without librdkafka's own log lines (`%3|...`), which
        repeat many times a second while a broker is unreachable and would hide the cause."""
        kept = [line for line in self.output().splitlines() if not line.startswith("%")]
        return "\n".join(kept[-lines:])

    def run_summary(self) -> dict | None:
        for line in reversed(self.output().splitlines()):
            if RUN_SUMMARY_MARK in line:
                return json.loads(line.split(RUN_SUMMARY_MARK, 1)[1])
        return None


def topic_args(names: TopicNames) -> list[str]:
    """`--input-topic NAME --deltas-topic NAME ...`, as `detok worker` and `topics ensure` take."""
    args = []
    for role, name in names.model_dump().items():
        args += [f"--{role.replace('_', '-')}-topic", name]
    return args


def detok_command(*args: str) -> list[str]:
    """The `detok` CLI of this checkout (the console script is `workers.cli:main`)."""
    return [sys.executable, "-m", "workers.cli", *args]


def ensure_topics_cli(bootstrap: str, names: TopicNames, partitions: int) -> None:
    """`detok topics ensure`, exactly as a user runs it: topic limits are whatever it sets."""
    result = subprocess.run(
        detok_command(
            "topics",
            "ensure",
            "--bootstrap-servers",
            bootstrap,
            "--partitions",
            str(partitions),
            *topic_args(names),
        ),  # fmt: skip
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=WAIT_BOUND_S * 2,
    )
    assert result.returncode == 0, f"detok topics ensure failed: {result.stderr}"


def new_pipeline(bootstrap: str, log_dir: Path, partitions: int = 1) -> Pipeline:
    """Fresh topics (via `detok topics ensure`) and a fresh group name for one test.

    One partition by default: every record then lands in the same consume batches as the good
    requests around it, which is what the crash-loop items are about.
    """
    names = TopicNames.with_prefix(unique_name("poison"))
    ensure_topics_cli(bootstrap, names, partitions)
    return Pipeline(bootstrap, names, unique_name("g"), log_dir)


def worker_command(
    pipeline: Pipeline,
    *extra: str,
    instance_id: str = "w",
    tokenizer_specs: Iterable[str] | None = None,
    bootstrap: str | None = None,
) -> list[str]:
    specs = models().specs if tokenizer_specs is None else tuple(tokenizer_specs)
    tokenizer_args = []
    for spec in specs:
        tokenizer_args += ["--tokenizer", spec]
    for spec in models().vocab_specs:
        if any(s.split("=", 1)[0] == spec.split("=", 1)[0] for s in specs):
            tokenizer_args += ["--model-vocab-size", spec]
    return detok_command(
        "worker",
        "--bootstrap-servers", bootstrap or pipeline.bootstrap,
        "--group", pipeline.group,
        "--instance-id", instance_id,
        "--commit-interval-ms", "100",
        *tokenizer_args,
        *topic_args(pipeline.names),
        *extra,
    )  # fmt: skip


def start_worker(
    pipeline: Pipeline,
    *extra: str,
    instance_id: str = "w",
    tokenizer_specs: Iterable[str] | None = None,
    bootstrap: str | None = None,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    command = worker_command(
        pipeline,
        *extra,
        instance_id=instance_id,
        tokenizer_specs=tokenizer_specs,
        bootstrap=bootstrap,
    )
    stem = pipeline.log_dir / f"worker-{instance_id}-{time.time_ns()}"
    stdout_path, stderr_path = stem.with_suffix(".out"), stem.with_suffix(".err")
    with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, **(env or {})},
        )
    return WorkerProcess(process, stdout_path, stderr_path, command)


@contextmanager
def started_worker(pipeline: Pipeline, *extra: str, **kwargs) -> Iterator[WorkerProcess]:
    """A worker that is killed by pid when the block ends, whatever happened in it."""
    worker = start_worker(pipeline, *extra, **kwargs)
    try:
        yield worker
    finally:
        worker.kill()


def run_worker_until_idle(
    pipeline: Pipeline, *extra: str, idle_s: float = 3, **kwargs
) -> WorkerProcess:
    """Start a worker with `--exit-when-idle`, wait for it to stop; return it (exited).

    Fails if it is still running after the wait bound (a hang), never on how fast it was.
    """
    with started_worker(pipeline, "--exit-when-idle", str(idle_s), *extra, **kwargs) as worker:
        code = worker.wait()
        if code is None:
            pytest.fail(
                f"worker still running after {WORKER_EXIT_BOUND_S:.0f} s with "
                f"--exit-when-idle {idle_s}:\n{worker.tail()}"
            )
    return worker


def assert_runs_twice_cleanly(pipeline: Pipeline, *extra: str, **kwargs) -> list[WorkerProcess]:
    """The crash-loop acceptance: two workers in turn on the same input both exit 0."""
    runs = []
    for attempt in (1, 2):
        worker = run_worker_until_idle(pipeline, *extra, instance_id=f"run{attempt}", **kwargs)
        assert worker.process.returncode == 0, (
            f"run {attempt} exited {worker.process.returncode} (crash loop):\n{worker.tail()}"
        )
        runs.append(worker)
    return runs


def produce(bootstrap: str, topic: str, records: Iterable[Record]) -> None:
    """Plant records as given; fails unless the broker acknowledged every one."""
    failures: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            failures.append(error)

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",  # where a Java producer (and detok) puts a key
            "message.max.bytes": PLANT_MAX_MESSAGE_BYTES,
            "linger.ms": 5,
        }
    )
    for record in records:
        kwargs: dict = {"key": record.key, "on_delivery": on_delivery}
        if record.headers is not None:
            kwargs["headers"] = record.headers
        if record.partition is not None:
            kwargs["partition"] = record.partition
        if record.timestamp_ms:
            kwargs["timestamp"] = record.timestamp_ms
        while True:
            try:
                producer.produce(topic, record.value, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    assert producer.flush(WAIT_BOUND_S) == 0, "planted records not delivered in time"
    assert not failures, f"planted records refused: {failures[:3]}"


def event(**fields: object) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def prompt(request_id: str, model: str, ids: list[int]) -> bytes:
    return event(type="prompt", request_id=request_id, model=model, prompt_token_ids=ids)


def tokens(request_id: str, seq: int, ids: list[int]) -> bytes:
    return event(type="tokens", request_id=request_id, seq=seq, token_ids=ids)


def finish(request_id: str, seq: int, reason: str = "stop") -> bytes:
    return event(type="finish", request_id=request_id, seq=seq, finish_reason=reason)


def generation_values(generation: dict, chunk_size: int = 8) -> list[bytes]:
    """A logged generation as the input events an inference server would send."""
    request_id, ids = generation["request_id"], generation["output_token_ids"]
    values = [prompt(request_id, generation["model"], generation["prompt_token_ids"])]
    chunks = [ids[start : start + chunk_size] for start in range(0, len(ids), chunk_size)]
    for seq, chunk in enumerate(chunks, start=1):
        values.append(tokens(request_id, seq, chunk))
    values.append(finish(request_id, len(chunks) + 1, generation["finish_reason"]))
    return values


def generation_records(generations: Iterable[dict], chunk_size: int = 8) -> list[Record]:
    return [
        Record(g["request_id"].encode(), value)
        for g in generations
        for value in generation_values(g, chunk_size)
    ]


def expected_completions(generations: list[dict], work_dir: Path) -> dict[str, dict]:
    """`detok run`'s completions for these generations: what the worker must publish.

    The offline command is the oracle, run through its command line as a user runs it, so these
    tests depend on no internal decoding API. It runs in this process: a subprocess would add
    seconds of interpreter start-up and imports to every test, and the CLI is the same.
    """
    stem = work_dir / f"expected-{time.time_ns()}"
    source, output = stem.with_suffix(".jsonl"), stem.with_suffix(".completions.jsonl")
    source.write_text("".join(json.dumps(g) + "\n" for g in generations), encoding="utf-8")
    tokenizer_args = []
    for spec in models().specs:
        tokenizer_args += ["--tokenizer", spec]
    for spec in models().vocab_specs:
        tokenizer_args += ["--model-vocab-size", spec]
    code = cli_main(
        ["run", *tokenizer_args, "--input", str(source), "--output", str(output),
         "--dead-letter", str(stem.with_suffix(".dead.jsonl"))]
    )  # fmt: skip
    assert code == 0, "detok run failed (its error is in the captured stderr)"
    expected = {}
    for line in output.read_text(encoding="utf-8").splitlines():
        completion = json.loads(line)
        expected[completion["request_id"]] = completion
    assert len(expected) == len(generations), "detok run did not complete every generation"
    return expected


def completions(pipeline: Pipeline) -> dict[str, dict]:
    """The latest committed completion per key (what a compacted topic keeps)."""
    latest = {}
    for record in read_records(pipeline.bootstrap, pipeline.names.completions):
        latest[record.key.decode()] = json.loads(record.value)
    return latest


def dead_letters(pipeline: Pipeline) -> list[tuple[bytes | None, bytes | None, list]]:
    """(key, value, headers) of every committed dead letter."""
    return [
        (record.key, record.value, record.headers)
        for record in read_records(pipeline.bootstrap, pipeline.names.dead_letters)
    ]


def header_values(headers: list[tuple[str, bytes | None]], name: str) -> list[bytes | None]:
    """Every value of one header name (Kafka allows repeats; none are hidden here)."""
    return [value for key, value in headers if key == name]


def reasons_of(pipeline: Pipeline, value: bytes) -> list[bytes | None]:
    """The `__detok.errors.reason` headers of every dead letter that holds exactly `value`."""
    return [
        reason
        for _, dead_value, headers in dead_letters(pipeline)
        if dead_value == value
        for reason in header_values(headers, "__detok.errors.reason")
    ]


def assert_good_requests_completed(pipeline: Pipeline, expected: dict[str, dict]) -> None:
    published = completions(pipeline)
    missing = sorted(set(expected) - set(published))
    assert not missing, f"{len(missing)} good requests have no completion: {missing[:5]}"
    wrong = [rid for rid, completion in expected.items() if published[rid] != completion]
    assert not wrong, f"{len(wrong)} good requests completed wrongly: {wrong[:5]}"


def wait_for_keys(
    bootstrap: str, topic: str, keys: set[bytes], bound_s: float = WAIT_BOUND_S
) -> dict[bytes, bytes | None]:
    """Re-read `topic` until every key in `keys` has a committed record; the latest values.

    `bound_s` only turns a hang into a failure."""
    deadline = time.monotonic() + bound_s
    while True:
        latest = {record.key: record.value for record in read_records(bootstrap, topic)}
        if keys <= set(latest):
            return latest
        if time.monotonic() > deadline:
            pytest.fail(f"{len(keys - set(latest))} keys never appeared on {topic}")
        time.sleep(0.5)


def committed_offsets(pipeline: Pipeline, partitions: int = 1) -> list[int]:
    """The group's committed input offsets (what a worker has finished with), per partition."""
    consumer = Consumer({"bootstrap.servers": pipeline.bootstrap, "group.id": pipeline.group})
    try:
        wanted = [TopicPartition(pipeline.names.input, p) for p in range(partitions)]
        return [tp.offset for tp in consumer.committed(wanted, WAIT_BOUND_S)]
    finally:
        consumer.close()


def wait_until_consumed(pipeline: Pipeline, offsets: list[int]) -> None:
    """Wait until the group committed at least `offsets` (one per input partition)."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        committed = committed_offsets(pipeline, len(offsets))
        if all(c >= o for c, o in zip(committed, offsets, strict=True)):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the worker did not consume up to {offsets} within the wait bound")
        time.sleep(0.5)


@dataclass(frozen=True)
class ReadRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


def read_records(bootstrap: str, topic: str) -> list[ReadRecord]:
    """Every committed record of `topic` (read_committed, as detok's readers do), to its end.

    Offsets are kept because they show what values do not: under exactly-once each
    transaction's commit marker takes an offset of every partition it wrote, so a gap between
    two records' offsets is a transaction boundary.
    """
    return [
        ReadRecord(
            message.partition(),
            message.offset(),
            message.key(),
            message.value(),
            message.headers() or [],
        )
        for message in read_messages(bootstrap, topic)
    ]


def process_rss_bytes(pid: int) -> int:
    """A running process's resident set size (Linux /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def set_max_message_bytes(bootstrap: str, topic: str, max_bytes: int) -> None:
    """Set a topic's own `max.message.bytes`, as an operator (or a cluster policy) does: raised
    to let bigger records in, or lowered below what `topics ensure` sets."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    entry = ConfigEntry(
        "max.message.bytes", str(max_bytes), incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=WAIT_BOUND_S)
