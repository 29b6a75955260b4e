"""The engines' publisher on the real broker (issue 31 item 1): what it produces is what the
worker expects (completions equal `detok run`'s, zero dead letters, across every optional field
and any chunking), linger expiry sends buffered ids, threads may share it, and a record the
broker refuses reaches the caller."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.offline import run_generations
from pipeline.processor import RequestProcessor
from pipeline.results import EventOrigin
from schemas.validation import Rejection, parse_event
from tests.integration.worker_harness import (
    TEXTS,
    NewPipelineRun,
    oracle_registry,
    read_messages,
    read_topic,
    wait_exit,
    wait_until,
    worker_tokenizers,
)
from workers.formats.jsonl import jsonl_records
from workers.io.publish import FailedRecord, Publisher, PublishFailed
from workers.kafka.clients import UndeliveredRecords

pytestmark = pytest.mark.integration

PROMPT_OPTIONS = ("skip_special_tokens", "stop", "include_stop_str_in_output", "prompt_tokens")


def publish_generations(
    publisher: Publisher, generations: list[dict], rng: random.Random, threads: int = 1
) -> None:
    """Each logged generation as an engine would stream it: opened with its prompt options,
    its output appended in random pieces (logprobs with them), finished; requests interleaved,
    split among `threads` threads that share the publisher."""

    def stream(share: list[dict], seed: int) -> None:
        local = random.Random(seed)
        cursors = {g["request_id"]: 0 for g in share}
        for g in share:
            options = {name: g[name] for name in PROMPT_OPTIONS if name in g}
            publisher.open(g["request_id"], g["model"], g["prompt_token_ids"], **options)
        live = list(share)
        while live:
            g = local.choice(live)
            ids, start = g["output_token_ids"], cursors[g["request_id"]]
            if start == len(ids):
                publisher.finish(g["request_id"], g.get("finish_reason"))
                live.remove(g)
                continue
            end = min(len(ids), start + local.choice((1, 1, 1, 2, 5, 17)))
            piece = slice(start, end)
            logprobs = g.get("output_logprobs")
            tops = g.get("output_top_logprobs")
            publisher.append(
                g["request_id"],
                ids[piece],
                None if logprobs is None else logprobs[piece],
                None if tops is None else [[tuple(p) for p in pairs] for pairs in tops[piece]],
            )
            cursors[g["request_id"]] = end

    shares = [generations[i::threads] for i in range(threads)]
    workers = [
        threading.Thread(target=stream, args=(share, rng.random())) for share in shares if share
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def offline_oracle(generations: list[dict]) -> dict[str, dict]:
    """`detok run` on the generations as logged."""
    lines = [json.dumps(g).encode() for g in generations]
    return {
        o.completion.request_id: json.loads(o.completion.model_dump_json())
        for o in run_generations(jsonl_records(lines), oracle_registry())
        if o.completion is not None
    }


def process_topic(bootstrap: str, topic: str) -> tuple[dict[str, dict], list[Any]]:
    """The worker's processor over every record of `topic` as read back from the broker, in
    partition order: its completions, and every rejection or dead letter."""
    processor = RequestProcessor(oracle_registry())
    completions: dict[str, dict] = {}
    refused: list[Any] = []
    for message in read_messages(bootstrap, topic):
        event = parse_event(message.value())
        if isinstance(event, Rejection):
            refused.append(event)
            continue
        origin = EventOrigin(topic, message.partition(), message.offset(), message.value())
        result = processor.process([(event, origin)])
        refused += result.dead_letters
        for completion in result.completions:
            completions[completion.request_id] = json.loads(completion.model_dump_json())
    leftover = processor.flush_incomplete()
    refused += leftover.dead_letters
    assert not leftover.completions, "a request published by the library was never finished"
    return completions, refused


@st.composite
def generations(draw: st.DrawFn) -> list[dict]:
    """Logged generations over the real tokenizers, each optional prompt field and logprob
    layout present or not; stop strings drawn from the generated text so that they fire."""
    tokenizers = worker_tokenizers()
    count = draw(st.integers(1, 5))
    drawn = []
    for index in range(count):
        model = draw(st.sampled_from(sorted(tokenizers)))
        ids = tokenizers[model].encode(draw(st.sampled_from(TEXTS)), add_special_tokens=False).ids
        cut = draw(st.integers(1, len(ids) - 1))
        output = ids[cut:][: draw(st.integers(0, 40))]
        g: dict[str, Any] = {
            "request_id": f"r{index}-{draw(st.integers(0, 10**6))}",
            "model": model,
            "prompt_token_ids": ids[:cut],
            "output_token_ids": output,
            "finish_reason": draw(st.sampled_from([None, "stop", "length"])),
        }
        if draw(st.booleans()):
            g["skip_special_tokens"] = draw(st.booleans())
        text = tokenizers[model].decode(output) if output else ""
        if draw(st.booleans()) and len(text) > 2:
            start = draw(st.integers(0, len(text) - 2))
            g["stop"] = [text[start : start + draw(st.integers(1, 3))], "\x00never"]
            g["include_stop_str_in_output"] = draw(st.booleans())
        if draw(st.booleans()):
            g["prompt_tokens"] = cut + draw(st.integers(0, 1000))
        if output and draw(st.booleans()):
            g["output_logprobs"] = [-draw(st.floats(0, 20)) for _ in output]
            if draw(st.booleans()):
                g["output_top_logprobs"] = [[[t, -1.5], [(t + 1) % 50_000, -2.5]] for t in output]
        drawn.append(g)
    return drawn


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests=generations(), linger_s=st.sampled_from([0, 0.001, 0.02]), seed=st.integers())
def test_published_requests_decode_as_detok_run_with_no_dead_letters(
    kafka_bootstrap: str,
    create_topic: Callable[..., str],
    requests: list[dict],
    linger_s: float,
    seed: int,
) -> None:
    topic = create_topic("pub-prop", partitions=2)
    with Publisher(kafka_bootstrap, topic, linger_s=linger_s) as publisher:
        publish_generations(publisher, requests, random.Random(seed))
    completions, refused = process_topic(kafka_bootstrap, topic)
    assert refused == []
    assert completions == offline_oracle(requests)


def every_option_generations() -> list[dict]:
    """Forty generations over both models with every optional field, fixed by a seed."""
    rng = random.Random(31)
    tokenizers = worker_tokenizers()
    drawn = []
    for index in range(40):
        model = ("gpt2", "qwen2")[index % 2]
        ids = tokenizers[model].encode(" ".join(rng.sample(TEXTS, 2)), add_special_tokens=False).ids
        cut = rng.randint(1, len(ids) // 2)
        output = ids[cut:][:60]
        text = tokenizers[model].decode(output)
        g: dict[str, Any] = {
            "request_id": f"every-{index:02d}",
            "model": model,
            "prompt_token_ids": ids[:cut],
            "output_token_ids": output,
            "finish_reason": "length",
            "skip_special_tokens": index % 3 != 0,
            "prompt_tokens": cut + index,
        }
        if index % 4 == 0:
            g["stop"] = [text[20:23]]
            g["include_stop_str_in_output"] = index % 8 == 0
        if index % 5 == 0:
            g["output_logprobs"] = [-0.25 * (i % 7) for i in range(len(output))]
            g["output_top_logprobs"] = [[[t, -0.5]] for t in output]
        drawn.append(g)
    return drawn


@pytest.mark.slow
def test_a_worker_completes_published_requests_as_detok_run(
    pipeline_run: NewPipelineRun,
) -> None:
    """The real worker, end to end: requests published by four engine threads sharing one
    publisher (coalescing on) give `detok run`'s completions, deltas exactly once, and nothing
    on the dead-letter topic."""
    requests = every_option_generations()
    run = pipeline_run(requests, partitions=3)
    with Publisher(run.bootstrap, run.names.input) as publisher:
        publish_generations(publisher, requests, random.Random(5), threads=4)
    worker = run.start_worker("pub", extra=["--exit-when-idle", "3"])
    assert wait_exit(worker) == 0
    run.assert_exactly_once()
    assert list(read_topic(run.bootstrap, run.names.dead_letters)) == []


def tokens_events(bootstrap: str, topic: str) -> list[dict]:
    events = (json.loads(value) for _, value, _ in read_topic(bootstrap, topic))
    return [event for event in events if event["type"] == "tokens"]


def test_buffered_ids_go_out_when_the_linger_expires(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    """No finish, no flush: the publisher's own timer sends what waited a linger."""
    topic = create_topic("pub-linger")
    with Publisher(kafka_bootstrap, topic, linger_s=0.05) as publisher:
        publisher.open("a", "gpt2", [1, 2])
        for token in range(100):
            publisher.append("a", [token])
        wait_until(
            lambda: sum(len(e["token_ids"]) for e in tokens_events(kafka_bootstrap, topic)) == 100,
            "the lingered ids on the topic",
        )
        publisher.finish("a")
    sent = tokens_events(kafka_bootstrap, topic)
    assert [t for e in sent for t in e["token_ids"]] == list(range(100))
    assert len(sent) < 100  # coalesced


def test_threads_sharing_a_publisher_lose_nothing_and_keep_seqs_contiguous(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    """Eight threads append to their own requests and all to one shared request while the
    linger timer flushes: every id arrives once, each request's seqs run 0..n without a gap,
    and each thread's own request keeps its order."""
    topic = create_topic("pub-threads", partitions=2)
    per_thread = 2_000
    with Publisher(kafka_bootstrap, topic, linger_s=0.001) as publisher:
        publisher.open("shared", "gpt2", [1])
        for thread in range(8):
            publisher.open(f"own-{thread}", "gpt2", [1])

        def engine(thread: int) -> None:
            for token in range(per_thread):
                publisher.append(f"own-{thread}", [token])
                publisher.append("shared", [thread * per_thread + token])
            publisher.finish(f"own-{thread}")

        threads = [threading.Thread(target=engine, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        publisher.finish("shared")
    by_request: dict[str, list[dict]] = {}
    for _, value, _ in read_topic(kafka_bootstrap, topic):
        event = json.loads(value)
        by_request.setdefault(event["request_id"], []).append(event)
    assert len(by_request) == 9
    for request_id, events in by_request.items():
        assert [e["seq"] for e in events] == list(range(len(events))), request_id
        ids = [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]
        if request_id == "shared":
            assert sorted(ids) == list(range(8 * per_thread))
        else:
            assert ids == list(range(per_thread))


def oversized(publisher: Publisher) -> None:
    publisher.open("big", "gpt2", [1])
    publisher.append("big", list(range(100_000, 110_000)))  # ~70 KB: one event, linger off


def test_a_refused_record_raises_from_the_next_call(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    topic = create_topic("pub-refused", config={"max.message.bytes": "20000"})
    publisher = Publisher(kafka_bootstrap, topic, linger_s=0)
    oversized(publisher)
    with pytest.raises(PublishFailed) as raised:
        publisher.finish("big")
    assert [(f.request_id, f.seq, f.error) for f in raised.value.failures] == [
        ("big", 1, "MSG_SIZE_TOO_LARGE")
    ]
    with pytest.raises(UndeliveredRecords, match="1 of 2 records not delivered"):
        publisher.close()


def test_a_refused_record_goes_to_on_error(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    topic = create_topic("pub-on-error", config={"max.message.bytes": "20000"})
    failures: list[FailedRecord] = []
    publisher = Publisher(kafka_bootstrap, topic, linger_s=0, on_error=failures.append)
    oversized(publisher)
    publisher.finish("big")
    with pytest.raises(UndeliveredRecords, match="1 of 3 records not delivered"):
        publisher.close()
    assert failures == [FailedRecord("big", 1, "MSG_SIZE_TOO_LARGE")]
    assert [json.loads(v)["type"] for _, v, _ in read_topic(kafka_bootstrap, topic)] == [
        "prompt",
        "finish",
    ]
