"""The worker end to end on the real broker: equivalence with `detok run`, crashes, rebalances,
poison input and duplicates. Each test replays logged generations with `detok replay`'s code,
runs real `detok worker` processes, and reads the output topics read_committed."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Producer

from tests.integration.conftest import WAIT_BOUND_S
from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    read_topic,
    stop,
    wait_exit,
)

pytestmark = pytest.mark.integration

IDLE_EXIT = ["--exit-when-idle", "3"]


def test_replay_worker_collect_equals_detok_run(pipeline_run: NewPipelineRun) -> None:
    run = pipeline_run(make_generations(300))
    assert len(run.expected) == 300
    run.replay()

    worker = run.start_worker("solo", extra=IDLE_EXIT)
    assert wait_exit(worker) == 0

    run.assert_exactly_once()
    filtered = [json.loads(v) for _, v, _ in read_topic(run.bootstrap, run.names.metrics)]
    expected_filtered = {
        r: c["filtered_prompt_ids"] for r, c in run.expected.items() if c["filtered_prompt_ids"]
    }
    assert expected_filtered, "the workload must exercise out-of-vocabulary prompt ids"
    assert {m["request_id"]: m["filtered_ids"] for m in filtered} == expected_filtered


def test_kill_9_mid_stream_changes_nothing(pipeline_run: NewPipelineRun) -> None:
    run = pipeline_run(make_generations(240, seed=11))
    # A paced replay keeps the stream going while the worker is killed and restarted.
    producer = run.paced_replay(rate=40.0)
    for _ in range(3):
        worker = run.start_worker("crashy")
        run.wait_for_first_commit(worker, producer)  # joined, restored, committed some
        worker.kill()  # SIGKILL: no commit, no goodbye
        worker.wait()
    producer.join()
    worker = run.start_worker("crashy", extra=IDLE_EXIT)
    assert wait_exit(worker) == 0

    run.assert_exactly_once()


def test_a_worker_joining_and_one_leaving_change_nothing(pipeline_run: NewPipelineRun) -> None:
    run = pipeline_run(make_generations(240, seed=23))
    producer = run.paced_replay(rate=80.0)
    first = run.start_worker("first")
    # Each step waits for the worker's own log, not a fixed time: on a loaded machine loading
    # the tokenizers alone took over 7 s, and a SIGTERM before the worker runs ends it with -15.
    run.wait_for_log(first, "restored")
    second = run.start_worker("second", extra=IDLE_EXIT)
    run.wait_for_log(second, "restored")  # it joined and holds partitions
    assert stop(first) == 0  # leaves the group cleanly: its partitions move to `second`
    producer.join()
    assert wait_exit(second) == 0

    run.assert_exactly_once()


def test_every_event_twice_changes_nothing(pipeline_run: NewPipelineRun) -> None:
    run = pipeline_run(make_generations(120, seed=5))
    run.replay()
    run.replay()  # the same events again

    worker = run.start_worker("dup", extra=IDLE_EXIT)
    assert wait_exit(worker) == 0
    run.assert_exactly_once()
    dead = list(read_topic(run.bootstrap, run.names.dead_letters))
    assert dead == [], "duplicates are dropped and counted, never dead-lettered"


def _event(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_poison_input_is_dead_lettered_with_headers_and_the_rest_completes(
    pipeline_run: NewPipelineRun,
) -> None:
    run = pipeline_run(make_generations(40, seed=3))
    kafka_bootstrap, names, expected = run.bootstrap, run.names, run.expected
    gpt2_prompt = [15496, 995]
    poison: list[tuple[str, bytes, str]] = [  # (key, value, expected reason)
        (
            "bad-json",
            b'{"type": "tokens", "request_id": "bad-json", "seq": 1, "tok',
            "malformed_json",
        ),
        (
            "bad-schema",
            _event(type="tokens", request_id="bad-schema", seq="one", token_ids=[1]),
            "schema_violation",
        ),
        (
            "bad-id",
            _event(type="tokens", request_id="bad-id", seq=1, token_ids=[5, 2**32]),
            "token_id_out_of_range",
        ),
        (
            "no-model",
            _event(type="prompt", request_id="no-model", model="nope", prompt_token_ids=[1, 2]),
            "unknown_model",
        ),
        (
            "orphan",
            _event(type="tokens", request_id="orphan", seq=1, token_ids=[1]),
            "missing_prompt",
        ),
        (
            "late",
            _event(type="prompt", request_id="late", model="gpt2", prompt_token_ids=gpt2_prompt),
            "",
        ),
        ("late", _event(type="finish", request_id="late", seq=1), ""),
        (
            "late",
            _event(type="tokens", request_id="late", seq=2, token_ids=[11]),
            "event_after_finish",
        ),
        (
            "strict",
            _event(
                type="prompt", request_id="strict", model="qwen2", prompt_token_ids=[9707, 11, 1879]
            ),
            "",
        ),
        (
            "strict",
            _event(type="tokens", request_id="strict", seq=1, token_ids=[9707, 151_800]),
            "strict_decode_failure",
        ),
        ("strict", _event(type="finish", request_id="strict", seq=2), "request_already_failed"),
        (
            "gap",
            _event(type="prompt", request_id="gap", model="gpt2", prompt_token_ids=gpt2_prompt),
            "",
        ),
        *[
            (
                "gap",
                _event(type="tokens", request_id="gap", seq=seq, token_ids=[11]),
                "sequence_gap",
            )
            for seq in range(3, 3 + 65)
        ],
        (
            "stale",
            _event(type="prompt", request_id="stale", model="gpt2", prompt_token_ids=gpt2_prompt),
            "",
        ),
        ("stale", _event(type="tokens", request_id="stale", seq=1, token_ids=[11]), ""),
    ]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    header = [("trace-id", b"abc123")]
    for key, value, _ in poison:
        producer.produce(names.input, value, key.encode(), headers=header)
    assert producer.flush(WAIT_BOUND_S) == 0
    run.replay()

    worker = run.start_worker("poison", extra=["--exit-when-idle", "9", "--request-ttl", "4"])
    assert wait_exit(worker) == 0

    completions = run.completions()
    for request_id, completion in expected.items():
        assert completions[request_id] == completion
    assert completions["strict"]["status"] == "failed"
    assert completions["stale"]["status"] == "failed"
    assert "151800" in completions["strict"]["error"]

    dead = list(read_topic(kafka_bootstrap, names.dead_letters))
    by_value = {}
    for key, value, headers in dead:
        by_value.setdefault(value, []).append((key, dict(headers)))
    for key, value, reason in poison:
        if not reason:
            continue
        assert value in by_value, f"{reason}: original bytes not in the dead-letter topic"
        (dl_key, headers), *_ = by_value[value]
        assert dl_key == key.encode()
        assert headers["trace-id"] == b"abc123", "original headers are kept"
        assert headers["__detok.errors.reason"] == reason.encode()
        assert headers["__connect.errors.topic"] == names.input.encode()
        for name in ("partition", "offset", "exception.class.name", "exception.message", "stage"):
            assert headers[f"__connect.errors.{name}"], name
        if reason not in ("malformed_json", "schema_violation", "token_id_out_of_range"):
            assert headers["__detok.errors.request_id"] == key.encode()
    reasons = [dict(h)["__detok.errors.reason"].decode() for _, _, h in dead]
    assert "ttl_expired" in reasons
    expiry = next(
        json.loads(v) for _, v, h in dead if dict(h)["__detok.errors.reason"] == b"ttl_expired"
    )
    assert expiry["request_id"] == "stale"
    assert set(reasons) >= {
        "malformed_json",
        "schema_violation",
        "token_id_out_of_range",
        "unknown_model",
        "missing_prompt",
        "event_after_finish",
        "sequence_gap",
        "strict_decode_failure",
        "request_already_failed",
        "ttl_expired",
    }
