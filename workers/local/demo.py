"""`detok demo`: the whole pipeline on one machine, checked against the offline oracle.

One command a new user can run after `make test`:

1. a Kafka broker (the local one of `detok broker` unless `--bootstrap-servers` is given);
2. fresh topics and a fresh group named after this run, so reruns never see old records;
3. a sample of logged generations over the real gpt2 and qwen2 tokenizers, generated at run time
   by `workers.local.sample_workload` (deterministic: the same file every run), plus the cases
   operators meet: qwen2 prompt ids outside the tokenizer vocabulary (filtered and counted),
   generated ids outside it (strict-decode failures), an unknown model and a malformed line (dead
letters); 4. `detok run` on that file (the oracle), then `detok replay` into Kafka, two `detok
   worker` processes with metrics endpoints, and `detok collect` of their completions;
5. checks: Kafka's completions equal the oracle's, and the workers' Prometheus counters of
   decoded tokens and filtered prompt ids equal what the oracle decoded and filtered.

Exit status: 0 when every check passes, 1 when one fails, 2 when the demo cannot start.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from workers.io.replay import collect, replay, write_completions
from workers.kafka.clients import KafkaConnection, make_admin
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import delete_topics, ensure_topics
from workers.local import broker
from workers.local.child_flags import tokenizer_arguments, topic_arguments
from workers.local.sample_workload import generations
from workers.runtime.prometheus import DEFAULT_METRICS_PORT

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHARED_DIR = REPO_ROOT.parent / "shared"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "out" / "demo"
# The sample's two models and their tokenizer folders under SHARED_DIR/tokenizers.
MODELS = {"gpt2": "gpt2", "qwen2": "qwen2-from-tiktoken"}
# Qwen2 models have 151,936 embedding rows; the tokenizer maps only 151,646 ids. Prompt ids in
# between are filtered (and counted); generated ones are strict-decode failures.
QWEN_MODEL_VOCAB = 151_936
QWEN_TOKENIZER_VOCAB = 151_646
WORKERS = 2
PARTITIONS = 4
# Every wait below polls for an event; the bound only turns a hang into a failed demo. A worker
# loads its tokenizers and joins the group in seconds, and the whole default sample decodes in
# well under a minute even on a small, shared machine, so 90 s means something is broken.
WAIT_BOUND_S = 90.0
POLL_INTERVAL_S = 0.25
# A worker that was sent SIGTERM commits and leaves the group within a commit round trip.
STOP_BOUND_S = 30.0
SCRAPE_TIMEOUT_S = 5.0
# One group-description round trip; retried until WAIT_BOUND_S while the coordinator is loading.
DESCRIBE_TIMEOUT_S = 5.0


class DemoError(Exception):
    """The demo cannot run (missing tokenizer, a worker died, a bound passed)."""


@dataclass(frozen=True)
class DemoOptions:
    """What `detok demo` was asked for (see its --help)."""

    connection: KafkaConnection
    kafka_config_flags: list[str]  # --kafka-config / -X for the workers (see options.py)
    shared_dir: Path
    tokenizer_overrides: list[str]  # MODEL=PATH for gpt2 or qwen2
    model_vocab_sizes: dict[str, int]  # over the sample's own (qwen2's embedding size)
    requests: int
    metrics_port: int | None
    output_dir: Path
    keep_running: bool


@dataclass(frozen=True)
class Sample:
    """What the generated input file holds, as the summary reports it."""

    path: Path
    requests: Counter  # by model (valid lines only)
    invalid_lines: int
    strict_failures: int


@dataclass
class WorkerProcess:
    name: str
    metrics_port: int
    log_path: Path
    process: subprocess.Popen

    @property
    def metrics_url(self) -> str:
        return f"http://{broker.LOOPBACK}:{self.metrics_port}/metrics"


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, passed, detail))

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


# -- inputs ------------------------------------------------------------------------------------


def tokenizer_paths(shared_dir: Path, overrides: list[str]) -> dict[str, Path]:
    """The sample's tokenizer files: SHARED_DIR/tokenizers/<folder>/tokenizer.json, or
    `--tokenizer MODEL=PATH`. Raises DemoError naming the missing file and both remedies."""
    paths = {
        model: shared_dir / "tokenizers" / folder / "tokenizer.json"
        for model, folder in MODELS.items()
    }
    for spec in overrides:
        model, sep, path = spec.partition("=")
        if not sep or model not in MODELS:
            raise DemoError(
                f"--tokenizer {spec!r}: expected MODEL=PATH with MODEL in {list(MODELS)}"
            )
        paths[model] = Path(path)
    for model, path in paths.items():
        if path.is_dir():
            paths[model] = path = path / "tokenizer.json"
        if not path.is_file():
            raise DemoError(
                f"tokenizer for {model} not found: {path}. The demo decodes with the real "
                f"tokenizers in ../shared/tokenizers beside the clone; pass --shared-dir DIR "
                f"(holding tokenizers/{MODELS[model]}/tokenizer.json) or --tokenizer {model}=PATH."
            )
    return paths


def write_sample(path: Path, tokenizers: dict[str, Path], requests_per_model: int) -> Sample:
    """Generate the demo's logged generations (deterministically) into `path`."""
    rng = random.Random(20240501)
    per_model = {}
    for seed, model in enumerate(MODELS, start=1):
        per_model[model] = generations(
            Tokenizer.from_file(str(tokenizers[model])),
            model=model,
            requests=requests_per_model,
            # Shorter than the benchmark's generations: a few thousand requests then decode in
            # seconds, and the demo stays well under two minutes on a small machine.
            prompt_tokens=(16, 256),
            output_tokens=(16, 256),
            seed=seed,
        )
    strict_failures = 0
    for index, generation in enumerate(per_model["qwen2"]):
        prompt = generation["prompt_token_ids"]
        if index % 10 == 3:
            # A chat template's reserved ids, as Qwen's embedding holds and its tokenizer lacks,
            # near the prompt's end: the decoder seeds from the prompt's tail, and only ids there
            # are looked at (and filtered).
            for _ in range(rng.randint(1, 3)):
                prompt.insert(len(prompt) - rng.randint(0, 3), _unmapped_qwen_id(rng))
        output = generation["output_token_ids"]
        if index % 300 == 7 and len(output) > 2:
            output[len(output) // 2] = _unmapped_qwen_id(rng)
            strict_failures += 1
    lines = [
        json.dumps(generation, ensure_ascii=False)
        for pair in zip(per_model["gpt2"], per_model["qwen2"], strict=True)
        for generation in pair
    ]
    lines.insert(
        len(lines) // 3,
        json.dumps(
            {"request_id": "unknown-model-0", "model": "llama-9000",
             "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5, 6]}
        ),
    )  # fmt: skip
    lines.insert(2 * len(lines) // 3, '{"request_id": "truncated-0", "model": "gpt2", "prompt_')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    requests = Counter({model: len(items) for model, items in per_model.items()})
    requests["llama-9000"] = 1
    return Sample(path, requests, invalid_lines=1, strict_failures=strict_failures)


def _unmapped_qwen_id(rng: random.Random) -> int:
    return rng.randrange(QWEN_TOKENIZER_VOCAB, QWEN_MODEL_VOCAB)


def tokenizer_args(tokenizers: dict[str, Path], model_vocab_sizes: dict[str, int]) -> list[str]:
    """The tokenizer flags of `detok run` and `detok worker` for the sample."""
    return tokenizer_arguments(tokenizers, {"qwen2": QWEN_MODEL_VOCAB, **model_vocab_sizes})


def run_offline(sample: Path, tokenizer_flags: list[str], output: Path) -> dict[str, dict]:
    """`detok run` on the sample, as a user would run it: the oracle."""
    command = [sys.executable, "-m", "workers.cli", "run", *tokenizer_flags,
               "--input", str(sample), "--output", str(output)]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise DemoError(f"detok run failed ({finished.returncode}): {finished.stderr.strip()}")
    return _completions_by_id(output)


def _completions_by_id(path: Path) -> dict[str, dict]:
    with path.open(encoding="utf-8") as lines:
        return {record["request_id"]: record for record in map(json.loads, lines)}


# -- Kafka side --------------------------------------------------------------------------------


def demo_topics(run_id: str) -> TopicNames:
    return TopicNames.with_prefix(f"detok-demo-{run_id}")


def metrics_ports(base: int | None, count: int) -> list[int]:
    """`base`, base+1, ... when given (they must be free); else the default ports if free, else
    ephemeral ones, so a demo never fails on a busy port it did not ask for."""
    wanted = [(base or DEFAULT_METRICS_PORT) + i for i in range(count)]
    if all(broker.port_is_free(port) for port in wanted):
        return wanted
    if base is not None:
        raise DemoError(f"metrics ports {wanted} are not all free on {broker.LOOPBACK}")
    ports = []
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((broker.LOOPBACK, 0))
            ports.append(probe.getsockname()[1])
    return ports


def start_workers(
    connection_flags: list[str],
    names: TopicNames,
    group: str,
    tokenizer_flags: list[str],
    ports: list[int],
    log_dir: Path,
) -> list[WorkerProcess]:
    workers = []
    for index, port in enumerate(ports, start=1):
        name = f"worker-{index}"
        log_path = log_dir / f"{name}.log"
        command = [
            sys.executable, "-m", "workers.cli", "worker",
            *connection_flags,
            "--group", group,
            "--instance-id", f"{group}-{name}",
            "--metrics-port", str(port),
            "--metrics-host", broker.LOOPBACK,
            *tokenizer_flags,
            *topic_arguments(names),
        ]  # fmt: skip
        with log_path.open("w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        workers.append(WorkerProcess(name, port, log_path, process))
    return workers


def wait_for_assignment(
    connection: KafkaConnection, group: str, workers: list[WorkerProcess]
) -> None:
    """Until every worker owns input partitions: replaying before that would process records
    during the join rebalance, which is correct but makes the run less repeatable."""
    admin = make_admin(connection)
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        _fail_on_dead(workers)
        try:
            future = admin.describe_consumer_groups([group], request_timeout=DESCRIBE_TIMEOUT_S)
            members = future[group].result().members
        except KafkaException:
            # A fresh broker answers only once its group coordinator (the __consumer_offsets
            # topic) exists, which the workers' first join creates: not yet, ask again.
            members = []
        owners = [m for m in members if m.assignment.topic_partitions]
        if len(owners) == len(workers):
            return
        if time.monotonic() > deadline:
            raise DemoError(
                f"only {len(owners)} of {len(workers)} workers were assigned partitions within "
                f"{WAIT_BOUND_S:.0f} s; see {workers[0].log_path.parent}"
            )
        time.sleep(POLL_INTERVAL_S)


def _fail_on_dead(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.poll() is not None:
            tail = worker.log_path.read_text(errors="replace").splitlines()[-15:]
            raise DemoError(
                f"{worker.name} exited with {worker.process.returncode}:\n" + "\n".join(tail)
            )


def stop_workers(workers: list[WorkerProcess]) -> list[int | None]:
    """SIGTERM (commit, leave the group), then SIGKILL past the bound; the exit codes."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for worker in workers:
        try:
            codes.append(worker.process.wait(timeout=STOP_BOUND_S))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
            codes.append(None)
    return codes


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape of a /metrics endpoint: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def summed(scrapes: list[dict], name: str, **labels: str) -> float:
    """Sum of a metric over the workers (and over labels not given)."""
    return sum(
        value
        for scraped in scrapes
        for (sample, sample_labels), value in scraped.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def by_label(scrapes: list[dict], name: str, label: str) -> Counter:
    totals: Counter = Counter()
    for scraped in scrapes:
        for (sample, labels), value in scraped.items():
            if sample == name:
                totals[dict(labels)[label]] += value
    return totals


def wait_all_consumed(workers: list[WorkerProcess], records: int) -> list[dict]:
    """Scrape until the workers together consumed every replayed record; then the counters of
    what they decoded and dead-lettered are final. Returns the last scrapes."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:
        _fail_on_dead(workers)
        scrapes = [scrape(worker.metrics_url) for worker in workers]
        if summed(scrapes, "detok_records_consumed_total") >= records:
            return scrapes
        if time.monotonic() > deadline:
            raise DemoError(f"the workers did not consume all {records} records in time")
        time.sleep(POLL_INTERVAL_S)


# -- the command -------------------------------------------------------------------------------


def run(options: DemoOptions) -> int:
    """The demo's exit status: 0 when every check passes, 1 when one fails, 2 when it cannot
    start."""
    try:
        report = demo(options)
    except DemoError as error:
        print(f"detok demo: {error}", file=sys.stderr)
        return 2
    return 0 if report.passed else 1


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def demo(args: DemoOptions) -> Report:
    if args.requests < 1:
        raise DemoError("--requests must be at least 1")
    tokenizers = tokenizer_paths(args.shared_dir, args.tokenizer_overrides)
    tokenizer_flags = tokenizer_args(tokenizers, args.model_vocab_sizes)
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    out = args.output_dir / run_id
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    sample = write_sample(out / "generations.jsonl", tokenizers, args.requests)
    _say(f"sample: {sample.path} ({sum(sample.requests.values())} requests)")
    offline_started = time.monotonic()
    expected = run_offline(sample.path, tokenizer_flags, out / "completions.offline.jsonl")
    offline_s = time.monotonic() - offline_started
    _say(f"detok run: {len(expected)} completions in {offline_s:.1f} s")

    connection = args.connection
    connection_flags = [
        "--bootstrap-servers", connection.bootstrap_servers, *args.kafka_config_flags
    ]  # fmt: skip
    names = demo_topics(run_id)
    group = f"detok-demo-{run_id}"
    ensure_topics(connection, names, PARTITIONS)
    _say(f"broker {connection.bootstrap_servers}; topics {names.input} and 5 more; group {group}")
    ports = metrics_ports(args.metrics_port, WORKERS)
    workers = start_workers(connection_flags, names, group, tokenizer_flags, ports, out)
    try:
        report = _run_pipeline(connection, names, group, workers, sample, expected, offline_s)
        if args.keep_running and report.passed:
            _serve_until_interrupted(workers)
    finally:
        codes = stop_workers(workers)
        for topic in delete_topics(connection, list(names.all)):
            _say(f"could not delete topic {topic}")
    report.check(
        "both workers stopped cleanly on SIGTERM",
        all(code == 0 for code in codes),
        f"exit codes {codes}; logs in {out}",
    )
    _print_checks(report, time.monotonic() - started)
    return report


def _run_pipeline(
    connection: KafkaConnection,
    names: TopicNames,
    group: str,
    workers: list[WorkerProcess],
    sample: Sample,
    expected: dict[str, dict],
    offline_s: float,
) -> Report:
    """Replay the sample through the running workers, collect, check and summarise."""
    wait_for_assignment(connection, group, workers)
    _say(f"{WORKERS} workers own the {PARTITIONS} input partitions; replaying")
    pipeline_started = time.monotonic()
    totals = replay(connection, sample.path, names.input, progress=False)
    received = collect(
        connection, names.completions, expect=len(expected), idle_timeout_s=WAIT_BOUND_S
    ).completions
    scrapes = wait_all_consumed(workers, totals.events)
    pipeline_s = time.monotonic() - pipeline_started
    write_completions(sample.path.with_name("completions.kafka.jsonl"), received)
    report = _checks(sample, expected, received, scrapes)
    _print_summary(sample, totals.events, expected, scrapes, workers, offline_s, pipeline_s)
    return report


def local_broker() -> str:
    """Start (or reuse) this checkout's broker. If its port is held by another broker (say,
    another clone's `detok broker start`), use that one: the demo's topics are its own."""
    try:
        running = broker.start_broker()
    except broker.PortInUse as error:
        bootstrap = f"{broker.LOOPBACK}:{broker.DEFAULT_PORT}"
        if broker.answers_metadata(bootstrap):
            _say(f"port {broker.DEFAULT_PORT} already serves a Kafka broker; using it")
            return bootstrap
        raise DemoError(f"the local Kafka broker did not start: {error}") from error
    except broker.BrokerError as error:
        raise DemoError(f"the local Kafka broker did not start: {error}") from error
    return running.bootstrap_servers


def _checks(
    sample: Sample, expected: dict[str, dict], received: dict, scrapes: list[dict]
) -> Report:
    report = Report()
    failed = sum(c["status"] == "failed" for c in expected.values())
    report.check(
        "the oracle fails exactly the requests with a generated id outside the vocabulary",
        failed == sample.strict_failures,
        f"{failed} failed, {sample.strict_failures} planted",
    )
    kafka = {rid: json.loads(c.model_dump_json()) for rid, c in received.items()}
    report.check(
        "every request completed on Kafka",
        kafka.keys() == expected.keys(),
        f"{len(kafka)} of {len(expected)}",
    )
    differing = sorted(rid for rid in expected.keys() & kafka.keys() if kafka[rid] != expected[rid])
    report.check(
        "completions equal `detok run`'s, field by field",
        not differing and kafka.keys() == expected.keys(),
        f"{len(differing)} differ" + (f", e.g. {differing[:3]}" if differing else ""),
    )
    # Counters count work done, and an aborted transaction's work is done again; with no abort
    # they must equal the oracle exactly.
    aborted = summed(scrapes, "detok_transactions_total", outcome="aborted")
    tokens = int(summed(scrapes, "detok_generated_tokens_decoded_total"))
    want_tokens = sum(c["generated_tokens"] for c in expected.values())
    report.check(
        "detok_generated_tokens_decoded_total = tokens decoded offline",
        tokens == want_tokens or (aborted and tokens > want_tokens),
        f"{tokens:,} vs {want_tokens:,} ({int(aborted)} aborted transactions)",
    )
    filtered = by_label(scrapes, "detok_prompt_ids_filtered_total", "model")
    want_filtered: Counter = Counter({model: 0 for model in MODELS})
    for completion in expected.values():
        want_filtered[completion["model"]] += len(completion["filtered_prompt_ids"])
    report.check(
        "detok_prompt_ids_filtered_total{model} = ids filtered offline",
        {m: int(v) for m, v in filtered.items()} == dict(want_filtered)
        or (aborted > 0 and all(filtered[m] >= n for m, n in want_filtered.items())),
        ", ".join(f"{m}={int(filtered[m])} vs {n}" for m, n in sorted(want_filtered.items())),
    )
    return report


def _print_summary(
    sample: Sample,
    events: int,
    expected: dict[str, dict],
    scrapes: list[dict],
    workers: list[WorkerProcess],
    offline_s: float,
    pipeline_s: float,
) -> None:
    tokens = sum(c["generated_tokens"] for c in expected.values())
    failed = sum(c["status"] == "failed" for c in expected.values())
    requests = ", ".join(f"{n} {model}" for model, n in sorted(sample.requests.items()))
    filtered = by_label(scrapes, "detok_prompt_ids_filtered_total", "model")
    with_filtered = Counter(c["model"] for c in expected.values() if c["filtered_prompt_ids"])
    letters = by_label(scrapes, "detok_dead_letters_total", "reason")
    commit_sum = summed(scrapes, "detok_commit_duration_seconds_sum")
    commits = summed(scrapes, "detok_commit_duration_seconds_count")
    lines = [
        "",
        "detok demo summary",
        f"  requests          {sum(sample.requests.values()):,} ({requests}) "
        f"+ {sample.invalid_lines} malformed line; {events:,} events on Kafka",
        f"  completions       {len(expected):,} ({failed} failed: strict decode)",
        f"  generated tokens  {tokens:,}",
        f"  throughput        {tokens / pipeline_s:,.0f} tokens/s through Kafka "
        f"({WORKERS} workers, {PARTITIONS} partitions, exactly-once; {pipeline_s:.1f} s from "
        f"replay to the last completion); `detok run`: {tokens / offline_s:,.0f} "
        "tokens/s (one process, start-up included)",
        "  filtered ids      "
        + ", ".join(
            f"{model}={int(filtered[model])} in {with_filtered[model]} requests"
            for model in sorted(MODELS)
        ),
        "  dead letters      "
        + (", ".join(f"{r}={int(n)}" for r, n in sorted(letters.items()) if n) or "none"),
        f"  commits           {int(commits)}, mean {1000 * commit_sum / max(commits, 1):.1f} ms",
        "  metrics           " + ", ".join(w.metrics_url for w in workers),
    ]
    print("\n".join(lines), flush=True)


def _print_checks(report: Report, elapsed_s: float) -> None:
    print("  checks")
    for check in report.checks:
        print(f"    {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    print(f"  result            {'PASS' if report.passed else 'FAIL'} in {elapsed_s:.0f} s")


def _serve_until_interrupted(workers: list[WorkerProcess]) -> None:
    _say(
        "workers keep serving metrics; scrape them with Prometheus: "
        "prometheus --config.file=deploy/prometheus/prometheus-local.yml. Ctrl-C stops."
    )
    try:
        while all(w.process.poll() is None for w in workers):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
