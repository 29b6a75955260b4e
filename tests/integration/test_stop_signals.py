"""Stop signals on the real broker (issue 31 item 2), across a kill -9 of one of two exactly-once
workers: every request a worker ended before its finish event (a stop string, a strict-decode
failure) has exactly one committed control record, with its completion's count of ids, and a
request that finished normally has none; an engine's `StopSignals` receives each once.

The engine publishes in two phases so that "before its finish" is known without looking inside
the worker: first every request's ids without a finish (the worker ends some of them: those have
a completion once the input is all committed), then the finishes. The requests complete as
`detok run` completes them from the same generations.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from schemas.events import StopSignal
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    NewPipelineRun,
    PipelineRun,
    input_all_committed,
    make_generations,
    read_topic,
    stop,
    wait_until,
    with_early_ends,
)
from workers.io.publish import AsyncStopSignals, Publisher, StopSignals

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHUNK = 8  # ids per tokens event
RATE = 100.0  # tokens events per second while publishing


def publish_without_finishes(run: PipelineRun, generations: list[dict]) -> Publisher:
    """Open every request and send its ids, CHUNK per event, requests interleaved, at RATE
    events/s; nothing is finished. Returns the open publisher."""
    publisher = Publisher(run.bootstrap, run.names.input, linger_s=0)
    for g in generations:
        publisher.open(g["request_id"], g["model"], g["prompt_token_ids"], stop=g.get("stop"))
    longest = max(len(g["output_token_ids"]) for g in generations)
    for start in range(0, longest, CHUNK):
        for g in generations:
            ids = g["output_token_ids"][start : start + CHUNK]
            if ids:
                publisher.append(g["request_id"], ids)
                time.sleep(1 / RATE)
    publisher.flush()
    return publisher


def test_each_request_ended_early_has_one_signal_across_kill_9(
    pipeline_run: NewPipelineRun,
) -> None:
    generations = with_early_ends(make_generations(120, seed=5), seed=5)
    run = pipeline_run(generations)
    expected = run.expected
    ended_early = {
        r for r, c in expected.items() if c["stop_reason"] is not None or c["status"] == "failed"
    }
    assert sum(expected[r]["status"] == "failed" for r in ended_early) >= 3
    assert sum(expected[r]["stop_reason"] is not None for r in ended_early) > 20

    received: list[StopSignal] = []
    engine = StopSignals(run.bootstrap, run.names.control, on_stop=received.append)
    finished_already = StopSignals(run.bootstrap, run.names.control, requests=frozenset())
    steady = run.start_worker("steady")
    crashy = run.start_worker("crashy")
    try:
        run.wait_for_log(steady, "restored")
        published: list[Publisher] = []
        producing = threading.Thread(
            target=lambda: published.append(publish_without_finishes(run, generations))
        )
        producing.start()
        run.wait_for_first_commit(crashy, producing)
        crashy.kill()  # SIGKILL: its open transaction, signals included, is aborted
        crashy.wait()
        crashy = run.start_worker("crashy")
        producing.join()
        (publisher,) = published
        wait_until(lambda: input_all_committed(run.bootstrap, run.group, run.names.input),
                   "the workers to commit every event of the first phase")  # fmt: skip

        # Only the requests ended early have a completion before their finish.
        assert set(run.completions()) == ended_early
        wait_until(lambda: len(received) >= len(ended_early), "the engine's stop signals")
        for g in generations:
            publisher.finish(g["request_id"], g["finish_reason"])
        publisher.close()
        wait_until(lambda: input_all_committed(run.bootstrap, run.group, run.names.input),
                   "the workers to commit the finishes")  # fmt: skip
        assert stop(crashy) == 0 and stop(steady) == 0
        check_signals(run, expected, ended_early, received, finished_already)
    finally:
        engine.close()
        finished_already.close()
        run.stop_leftovers()


def check_signals(
    run: PipelineRun,
    expected: dict[str, dict],
    ended_early: set[str],
    received: list[StopSignal],
    finished_already: StopSignals,
) -> None:
    """The committed control records and what the two readers got of them."""
    run.assert_exactly_once()
    records = [(key.decode(), value) for key, value, _ in
               read_topic(run.bootstrap, run.names.control)]  # fmt: skip
    assert Counter(key for key, _ in records) == Counter(ended_early)
    for key, value in records:
        completion = expected[key]
        signal = StopSignal.model_validate_json(value)
        assert signal.request_id == key and signal.model == completion["model"]
        assert signal.generated_tokens == completion["generated_tokens"]
        wanted = "stop_string" if completion["status"] == "ok" else "strict_decode_failure"
        assert signal.reason == wanted
    assert sorted(s.request_id for s in received) == sorted(ended_early)
    passed_on: list[StopSignal] = []

    def all_skipped() -> bool:
        passed_on.extend(finished_already.poll(0.2))
        return finished_already.skipped >= len(ended_early)

    wait_until(all_skipped, "the signals for requests the engine finished to be skipped")
    assert passed_on == [] and finished_already.skipped == len(ended_early)
    reasons = {h[1] for _, _, headers in read_topic(run.bootstrap, run.names.dead_letters)
               for h in headers if h[0] == "__detok.errors.reason"}  # fmt: skip
    assert reasons <= {b"strict_decode_failure", b"request_already_failed"}


def signal_record(request_id: str) -> bytes:
    return (
        StopSignal(request_id=request_id, model="gpt2", reason="stop_string", generated_tokens=3)
        .model_dump_json()
        .encode()
    )


def test_readers_see_committed_signals_from_their_making_on(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    """Both faces of the library, against records written as a worker writes them: a signal
    committed before the reader was made, one in an aborted transaction and an unreadable
    record never reach the engine; each committed one does, once, through `poll` and through
    `AsyncStopSignals`."""
    topic = create_topic("control", partitions=3)
    producer = Producer({"bootstrap.servers": kafka_bootstrap,
                         "transactional.id": unique_name("control")})  # fmt: skip
    producer.init_transactions()

    def transaction(records: list[tuple[str, bytes]], commit: bool = True) -> None:
        producer.begin_transaction()
        for key, value in records:
            producer.produce(topic, value, key.encode())
        if commit:
            producer.commit_transaction()
        else:
            producer.abort_transaction()

    transaction([("before", signal_record("before"))])
    polled = StopSignals(kafka_bootstrap, topic)

    async def read_async(count: int) -> list[StopSignal]:
        signals = await AsyncStopSignals.create(kafka_bootstrap, topic)
        async with signals:
            transaction([("aborted", signal_record("aborted"))], commit=False)
            transaction([("a", signal_record("a")), ("junk", b"{not json")])
            transaction([(f"r{i}", signal_record(f"r{i}")) for i in range(count - 1)])
            return [await asyncio.wait_for(signals.get(), WAIT_BOUND_S) for _ in range(count)]

    try:
        got = asyncio.run(read_async(5))
        assert sorted(s.request_id for s in got) == ["a", "r0", "r1", "r2", "r3"]
        seen: list[StopSignal] = []
        wait_until(lambda: bool(seen.extend(polled.poll(0.2))) or len(seen) >= 5, "the signals")
        assert sorted(s.request_id for s in seen) == ["a", "r0", "r1", "r2", "r3"]
        assert polled.poll(0.5) == [] and polled.skipped == 1  # the unreadable record
    finally:
        polled.close()
