"""Running real `detok worker` processes against the session's broker, and reading what they wrote.

Workers run as subprocesses (`python -m workers.cli worker ...`) so that a test can kill -9 one
exactly as an orchestrator's OOM killer would. Every test gets its own topics and group.
"""

from __future__ import annotations

import functools
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from tokenizers import Tokenizer

from pipeline.offline import run_generations
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.conftest import REPO_ROOT, real_tokenizer_path
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from workers.formats.jsonl import jsonl_records
from workers.io.replay import replay
from workers.kafka.clients import KafkaConnection, as_connection
from workers.kafka.topic_names import TopicNames
from workers.kafka.topics import ensure_topics

QWEN_MODEL_VOCAB = 151_936
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Kafka keeps the log; workers keep the state.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n",
    "天空为什么是蓝色的？因为瑞利散射使短波长的蓝光散射得更多。𠀀𠀁𠀂 是扩展B区的汉字。",
    "Emoji: 👩‍💻🚀🇯🇵 🏳️‍🌈 — naïve café, résumé, Ελληνικά, русский, العربية, हिन्दी.",
    "SELECT id, name FROM users WHERE created_at > now() - interval '7 days' ORDER BY id;",
    "おはようございます。今日はいい天気ですね。안녕하세요, 반갑습니다!",
]


@dataclass(frozen=True)
class Models:
    """The two real tokenizers the worker tests decode with, as CLI specs and a registry."""

    specs: tuple[str, ...]
    vocab_specs: tuple[str, ...]

    def registry(self) -> TokenizerRegistry:
        return TokenizerRegistry.from_specs(self.specs, {"qwen2": QWEN_MODEL_VOCAB})

    def worker_args(self) -> list[str]:
        args = []
        for spec in self.specs:
            args += ["--tokenizer", spec]
        for spec in self.vocab_specs:
            args += ["--model-vocab-size", spec]
        return args


def models() -> Models:
    return Models(
        specs=(
            f"gpt2={real_tokenizer_path('gpt2')}",
            f"qwen2={real_tokenizer_path('qwen2-from-tiktoken')}",
        ),
        vocab_specs=(f"qwen2={QWEN_MODEL_VOCAB}",),
    )


@functools.cache
def oracle_registry() -> TokenizerRegistry:
    """The registry `offline_completions` decodes with, loaded once per session: loading both
    real tokenizers costs seconds, and `detok run`'s answer depends only on the input."""
    return models().registry()


@functools.cache
def worker_tokenizers() -> dict[str, Tokenizer]:
    """The workers' two models' tokenizers by model name, loaded once per session (seconds each
    on a loaded machine) for the tests that build their inputs with them."""
    return {
        "gpt2": Tokenizer.from_file(str(real_tokenizer_path("gpt2"))),
        "qwen2": Tokenizer.from_file(str(real_tokenizer_path("qwen2-from-tiktoken"))),
    }


def make_generations(count: int, seed: int = 7) -> list[dict]:
    """Deterministic logged generations over gpt2 and qwen2, with the cases that matter:
    prompts cut mid-character, qwen2 prompt ids outside the tokenizer vocab, zero-token outputs."""
    rng = random.Random(seed)
    tokenizers = worker_tokenizers()
    encoded = {
        name: [
            tok.encode(" ".join(rng.sample(TEXTS, 3)), add_special_tokens=False).ids
            for _ in range(12)
        ]
        for name, tok in tokenizers.items()
    }
    generations = []
    for index in range(count):
        model = "gpt2" if index % 2 else "qwen2"
        ids = rng.choice(encoded[model])
        cut = rng.randint(1, len(ids) - 1)
        prompt, output = ids[:cut], ids[cut:][: rng.randint(0, 60)]
        if model == "qwen2" and index % 10 == 0:
            prompt = [*prompt, rng.randint(151_646, QWEN_MODEL_VOCAB - 1), *prompt[-4:]]
        generations.append(
            {
                "request_id": f"req-{index:05d}",
                "model": model,
                "prompt_token_ids": prompt,
                "output_token_ids": output,
                "finish_reason": "stop",
            }
        )
    return generations


def with_early_ends(generations: list[dict], seed: int, failures: bool = True) -> list[dict]:
    """Half the requests get a stop string from the first half of their own text (it fires
    well before the end); with `failures`, every tenth qwen2 request gets an id the tokenizer
    lacks mid-way (a strict-decode failure)."""
    rng = random.Random(seed)
    tokenizers = worker_tokenizers()
    for index, generation in enumerate(generations):
        output = generation["output_token_ids"]
        text = tokenizers[generation["model"]].decode(output)
        if failures and generation["model"] == "qwen2" and index % 10 == 4 and len(output) > 8:
            bad = rng.randint(151_646, QWEN_MODEL_VOCAB - 1)
            generation["output_token_ids"] = [*output[:4], bad, *output[4:]]
        elif index % 2 == 0 and len(text) > 24:
            start = rng.randint(len(text) // 5, len(text) // 3)
            generation["stop"] = [text[start : start + 3], "never-ever"]
    return generations


def paced_replay(bootstrap: str, source: Path, topic: str, rate: float) -> threading.Thread:
    """Replay `source` at `rate` events/s in the background, so workers can be killed, added
    and removed while the stream is still flowing; join the thread to wait for the end."""
    thread = threading.Thread(
        target=replay, args=(bootstrap, source, topic), kwargs={"rate": rate, "progress": False}
    )
    thread.start()
    return thread


def write_jsonl(path: Path, records: Iterable[dict | str]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def offline_completions(path: Path, registry: TokenizerRegistry) -> dict[str, dict]:
    """`detok run`'s answer for the file: the oracle every Kafka run must equal."""
    lines = path.read_bytes().splitlines()
    return {
        outcome.completion.request_id: json.loads(outcome.completion.model_dump_json())
        for outcome in run_generations(jsonl_records(lines), registry)
        if outcome.completion is not None
    }


def pipeline_topics(bootstrap: str, partitions: int = 4) -> TopicNames:
    names = TopicNames.with_prefix(unique_name("wt"))
    ensure_topics(bootstrap, names, partitions)
    return names


def topic_args(names: TopicNames) -> list[str]:
    args = []
    for role, name in names.model_dump().items():
        args += [f"--{role.replace('_', '-')}-topic", name]
    return args


def worker_log(log_dir: Path, instance_id: str) -> Path:
    """A new log file for one start of worker `instance_id` (each start gets its own)."""
    return log_dir / f"worker-{instance_id}-{time.time_ns()}.log"


def start_worker(
    bootstrap: str,
    names: TopicNames,
    group: str,
    *,
    instance_id: str,
    extra: Iterable[str] = (),
    log_dir: Path,
    log_path: Path | None = None,
) -> subprocess.Popen:
    log = (log_path or worker_log(log_dir, instance_id)).open("w")
    command = [
        sys.executable, "-m", "workers.cli", "worker",
        "--bootstrap-servers", bootstrap,
        "--group", group,
        "--instance-id", instance_id,
        "--commit-interval-ms", "100",
        *models().worker_args(),
        *topic_args(names),
        *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_exit(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=WAIT_BOUND_S * 2)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("worker did not exit within the wait bound")


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return wait_exit(process)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll until `condition()` holds. The bound only turns a hang into a failure naming `what`;
    nothing is asserted on time."""
    deadline = time.monotonic() + WAIT_BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def logged(logs: Path | Iterable[Path], text: str) -> bool:
    """Whether any of the worker logs holds `text` (a log not yet created holds nothing)."""
    paths = [logs] if isinstance(logs, Path) else logs
    return any(path.is_file() and text in path.read_text() for path in paths)


def wait_for_log(logs: Path | Callable[[], Iterable[Path]], text: str) -> None:
    """Until a worker logs `text` in `logs` (one file, or the files a callable lists now)."""
    wait_until(lambda: logged(logs if isinstance(logs, Path) else logs(), text), repr(text))


def read_messages(bootstrap: KafkaConnection | str, topic: str) -> Iterator[Message]:
    """Every committed record of a topic (read_committed, as detok's readers do), to its end.

    `bootstrap` may be a KafkaConnection, for a secured broker."""
    consumer = Consumer(
        as_connection(bootstrap).client_config(
            {
                "group.id": unique_name("reader"),
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "enable.auto.commit": False,
            }
        )
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        remaining = set(partitions)
        deadline = time.monotonic() + WAIT_BOUND_S
        while remaining:
            if time.monotonic() > deadline:
                pytest.fail(f"could not read {topic} to its end within the wait bound")
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    remaining.discard(message.partition())
                    continue
                pytest.fail(f"read error: {message.error()}")
            yield message
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str) -> Iterator[tuple[bytes | None, bytes | None, list]]:
    """Every committed record of a topic, read to its end: (key, value, headers)."""
    for message in read_messages(bootstrap, topic):
        yield message.key(), message.value(), message.headers() or []


def completions_on(bootstrap: str, names: TopicNames) -> dict[str, dict]:
    latest = {}
    for key, value, _ in read_topic(bootstrap, names.completions):
        latest[key.decode()] = json.loads(value)
    return latest


def assert_deltas_cover_exactly_once(bootstrap: str, names: TopicNames, completions: dict) -> None:
    """Committed deltas of each completed request tile its seq range 1..finish exactly once,
    and their texts concatenate to the completion's text."""
    deltas: dict[str, list[dict]] = {}
    for _, value, _ in read_topic(bootstrap, names.deltas):
        delta = json.loads(value)
        deltas.setdefault(delta["request_id"], []).append(delta)
    for request_id, completion in completions.items():
        if completion["status"] != "ok":
            continue
        parts = deltas.get(request_id, [])
        expected_start = 1
        for delta in parts:  # one partition per request: topic order is production order
            assert delta["seq_start"] == expected_start, (request_id, parts)
            expected_start = delta["seq_end"] + 1
        assert parts and parts[-1]["final"], (request_id, parts)
        assert sum(d["final"] for d in parts) == 1, (request_id, parts)
        assert "".join(d["text"] for d in parts) == completion["text"], request_id


def input_all_committed(bootstrap: KafkaConnection | str, group: str, topic: str) -> bool:
    """Whether `group` has committed every record of `topic`: nothing left for its workers."""
    consumer = Consumer(
        as_connection(bootstrap).client_config({"group.id": group, "enable.auto.commit": False})
    )
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        wanted = [TopicPartition(topic, p) for p in partitions]
        committed = consumer.committed(wanted, timeout=30)
        ends = [consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in wanted]
    finally:
        consumer.close()
    # A partition nothing was committed on reports a negative offset; it is done if empty.
    return all(max(tp.offset, 0) >= end for tp, end in zip(committed, ends, strict=True))


def wait_for_first_commit(log: Path, nothing_left: Callable[[], bool]) -> None:
    """Until the worker logging to `log` has committed part of the stream (its timeline's
    "first commit"): the moment a kill -9 tests most, with state restored, outputs committed
    and more in flight. A fixed sleep instead is too short on a loaded machine (the kill then
    lands before the worker has even loaded its tokenizers) and wasted time on an idle one.

    A worker restored with `nothing_left()` (the input ended and all of it is committed) will
    never commit, so its restore is enough then."""
    wait_until(
        lambda: logged(log, "first commit") or (logged(log, "restored") and nothing_left()),
        f"the first commit of the worker logging to {log.name}",
    )


@dataclass
class PipelineRun:
    """One test's pipeline on a broker: its logged generations as a JSONL file, `detok run`'s
    answer for them (the oracle the Kafka output must equal), its own topics and consumer group,
    and every worker it started, which the `pipeline_run` fixture stops by pid at the end even
    when the test failed half-way (a leftover worker would hold the CPU the next tests need)."""

    bootstrap: str
    log_dir: Path
    source: Path
    expected: dict[str, dict]
    names: TopicNames
    group: str
    logs: dict[int, Path] = field(default_factory=dict)
    workers: list[subprocess.Popen] = field(default_factory=list)

    def start_worker(
        self, instance_id: str, extra: Iterable[str] = (), log_dir: Path | None = None
    ) -> subprocess.Popen:
        log = worker_log(log_dir or self.log_dir, instance_id)
        process = start_worker(
            self.bootstrap,
            self.names,
            self.group,
            instance_id=instance_id,
            extra=extra,
            log_dir=log.parent,
            log_path=log,
        )
        self.logs[process.pid] = log
        self.workers.append(process)
        return process

    def log_of(self, process: subprocess.Popen) -> Path:
        return self.logs[process.pid]

    def wait_for_log(self, process: subprocess.Popen, text: str) -> None:
        wait_for_log(self.log_of(process), text)

    def wait_for_first_commit(self, process: subprocess.Popen, replaying: threading.Thread) -> None:
        wait_for_first_commit(
            self.log_of(process),
            lambda: (
                not replaying.is_alive()
                and input_all_committed(self.bootstrap, self.group, self.names.input)
            ),
        )

    def paced_replay(self, rate: float, source: Path | None = None) -> threading.Thread:
        return paced_replay(self.bootstrap, source or self.source, self.names.input, rate)

    def replay(self, source: Path | None = None) -> None:
        replay(self.bootstrap, source or self.source, self.names.input, progress=False)

    def completions(self) -> dict[str, dict]:
        return completions_on(self.bootstrap, self.names)

    def assert_exactly_once(self) -> None:
        """The committed completions equal `detok run`'s, and each completed request's deltas
        tile its seqs exactly once and concatenate to its text."""
        assert self.completions() == self.expected
        assert_deltas_cover_exactly_once(self.bootstrap, self.names, self.expected)

    def stop_leftovers(self) -> None:
        for process in self.workers:
            if process.poll() is None:
                process.kill()
                process.wait()


# What the `pipeline_run` fixture gives a test: `pipeline_run(generations, partitions=4)`.
NewPipelineRun = Callable[..., PipelineRun]


def new_pipeline_run(
    bootstrap: str, log_dir: Path, generations: list[dict], partitions: int = 4
) -> PipelineRun:
    source = write_jsonl(log_dir / f"generations-{time.time_ns()}.jsonl", generations)
    return PipelineRun(
        bootstrap=bootstrap,
        log_dir=log_dir,
        source=source,
        expected=offline_completions(source, oracle_registry()),
        names=pipeline_topics(bootstrap, partitions),
        group=unique_name("g"),
    )
