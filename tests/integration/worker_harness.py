"""Running real `detok worker` processes against the session's broker, and reading what they wrote.

Workers run as subprocesses (`python -m workers.cli worker ...`) so that a test can kill -9 one
exactly as an orchestrator's OOM killer would. Every test gets its own topics and group.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from tokenizers import Tokenizer

from pipeline.offline import run_generations
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.conftest import REPO_ROOT, real_tokenizer_path
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from workers.formats.jsonl import jsonl_records
from workers.kafka_clients import KafkaConnection, as_connection
from workers.replay import replay
from workers.topic_names import TopicNames
from workers.topics import ensure_topics

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


def make_generations(count: int, seed: int = 7) -> list[dict]:
    """Deterministic logged generations over gpt2 and qwen2, with the cases that matter:
    prompts cut mid-character, qwen2 prompt ids outside the tokenizer vocab, zero-token outputs."""
    rng = random.Random(seed)
    tokenizers = {
        "gpt2": Tokenizer.from_file(str(real_tokenizer_path("gpt2"))),
        "qwen2": Tokenizer.from_file(str(real_tokenizer_path("qwen2-from-tiktoken"))),
    }
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


def start_worker(
    bootstrap: str,
    names: TopicNames,
    group: str,
    *,
    instance_id: str,
    extra: Iterable[str] = (),
    log_dir: Path,
) -> subprocess.Popen:
    log = (log_dir / f"worker-{instance_id}-{time.time_ns()}.log").open("w")
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
