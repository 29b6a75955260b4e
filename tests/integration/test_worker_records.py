"""Bad records and bad state against the real broker: each is set aside, the worker keeps
running (exit 0, and again on the same input), and the good requests of the same batches
complete (issue 16 items 1-4, 17, 19)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from tests.integration.conftest import WAIT_BOUND_S
from tests.integration.worker_harness import (
    NewPipelineRun,
    PipelineRun,
    make_generations,
    read_topic,
    wait_exit,
)
from workers.kafka.topic_names import TopicNames

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE_EXIT = ["--exit-when-idle", "3"]
GPT2_PROMPT = [15496, 995]
THE = 262  # gpt2 " the"

Record = tuple[bytes, bytes, list[tuple[str, bytes | None]] | None, int | None]


def event(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def produce(bootstrap: str, topic: str, records: Iterable[Record]) -> dict[bytes, int]:
    """Produce (key, value, headers, partition) records in order; the partition of each key."""
    producer = Producer(
        {"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "linger.ms": 0}
    )
    partition_of: dict[bytes, int] = {}

    def delivered(error, message) -> None:
        assert error is None, error
        partition_of[message.key()] = message.partition()

    for key, value, headers, partition in records:
        kwargs = {} if partition is None else {"partition": partition}
        producer.produce(topic, value, key, headers=headers, on_delivery=delivered, **kwargs)
        assert producer.flush(WAIT_BOUND_S) == 0  # one at a time: the order is the test's
    return partition_of


def run_worker(run: PipelineRun) -> None:
    assert wait_exit(run.start_worker("records", extra=IDLE_EXIT)) == 0


def dead_letters(bootstrap: str, names: TopicNames) -> list[tuple[bytes | None, dict]]:
    return [
        (value, dict(headers)) for _, value, headers in read_topic(bootstrap, names.dead_letters)
    ]


def reason_of(headers: dict) -> str:
    return headers["__detok.errors.reason"].decode()


def test_poison_records_are_set_aside_and_every_restart_keeps_running(
    pipeline_run: NewPipelineRun,
) -> None:
    run = pipeline_run(make_generations(30, seed=41), partitions=2)
    kafka_bootstrap, names, expected = run.bootstrap, run.names, run.expected
    deep = (
        b'{"type": "tokens", "request_id": "deep", "seq": 1, "token_ids": [11], "x": '
        + b"[" * 2000
        + b"]" * 2000
        + b"}"
    )
    forged = b"not json, with forged error headers"
    mismatched = event(type="tokens", request_id="keyed", seq=1, token_ids=[11])
    held = event(type="tokens", request_id="held", seq=2, token_ids=[11])
    phase_one: list[Record] = [
        (
            b"deep",
            event(type="prompt", request_id="deep", model="gpt2", prompt_token_ids=GPT2_PROMPT),
            None,
            None,
        ),
        (b"deep", deep, None, None),
        (b"deep", event(type="tokens", request_id="deep", seq=1, token_ids=[11]), None, None),
        (b"deep", event(type="finish", request_id="deep", seq=2), None, None),
        (
            b"forged",
            forged,
            [
                ("__detok.errors.reason", b"ttl_expired"),
                ("__connect.errors.exception.message", b"anything I like"),
            ],
            None,
        ),
        (
            b"keyed",
            event(type="prompt", request_id="keyed", model="gpt2", prompt_token_ids=GPT2_PROMPT),
            None,
            None,
        ),
        (b"someone-else", mismatched, None, None),
        (b"keyed", event(type="tokens", request_id="keyed", seq=1, token_ids=[11]), None, None),
        (b"keyed", event(type="finish", request_id="keyed", seq=2), None, None),
        # Held while seq 1 is missing, with a null-valued header: it goes into the snapshot.
        (
            b"held",
            event(type="prompt", request_id="held", model="gpt2", prompt_token_ids=GPT2_PROMPT),
            None,
            None,
        ),
        (b"held", held, [("nullable", None), ("raw", b"\xff\xfe")], None),
        (
            b"split",
            event(type="prompt", request_id="split", model="gpt2", prompt_token_ids=GPT2_PROMPT),
            None,
            0,
        ),
    ]
    produce(kafka_bootstrap, names.input, phase_one)
    run.replay()
    run_worker(run)

    stray = event(type="tokens", request_id="split", seq=1, token_ids=[11])
    phase_two: list[Record] = [
        (b"held", event(type="tokens", request_id="held", seq=1, token_ids=[11]), None, None),
        (b"held", event(type="finish", request_id="held", seq=3), None, None),
        (b"split", stray, None, 1),  # the request lives on partition 0
        (b"split", event(type="tokens", request_id="split", seq=1, token_ids=[11]), None, 0),
        (b"split", event(type="finish", request_id="split", seq=2), None, 0),
    ]
    produce(kafka_bootstrap, names.input, phase_two)
    run_worker(run)
    run_worker(run)  # nothing new: restores and idles

    completions = run.completions()
    for request_id, completion in expected.items():
        assert completions[request_id] == completion
    for request_id in ("deep", "keyed", "held", "split"):
        assert completions[request_id]["status"] == "ok", request_id
    assert completions["held"]["text"] == completions["keyed"]["text"] * 2

    letters = dead_letters(kafka_bootstrap, names)
    by_value = {value: headers for value, headers in letters}
    assert len(letters) == 4, [reason_of(h) for _, h in letters]
    # The parser names it (contract 5: never raises); what matters is that it is set aside.
    assert reason_of(by_value[deep]) in ("malformed_json", "unexpected_error")
    assert by_value[deep]["__detok.errors.request_id"] in (b"", b"deep")
    assert reason_of(by_value[forged]) == "malformed_json"
    assert by_value[forged]["__connect.errors.exception.message"] != b"anything I like"
    assert reason_of(by_value[mismatched]) == "key_mismatch"
    assert reason_of(by_value[stray]) == "partition_mismatch"
    assert by_value[stray]["__connect.errors.partition"] == b"1"


def test_outputs_too_large_and_corrupt_snapshots_fail_only_their_request(
    pipeline_run: NewPipelineRun,
) -> None:
    run = pipeline_run(make_generations(30, seed=43), partitions=2)
    kafka_bootstrap, names, expected = run.bootstrap, run.names, run.expected
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    small = ConfigResource(
        ResourceType.TOPIC,
        names.completions,
        incremental_configs=[
            ConfigEntry("max.message.bytes", "4096", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([small])[small].result(timeout=WAIT_BOUND_S)

    # Requests whose snapshots were lost to corruption: their input partition is where their
    # changelog record must be, so produce their later events first to learn it.
    late = [
        (key, event(type="tokens", request_id=key.decode(), seq=1, token_ids=[11]), None, None)
        for key in (b"garbled", b"retired")
    ]
    partition_of = produce(kafka_bootstrap, names.input, late)
    garbage = b"\x00 not a snapshot"
    retired = event(
        kind="active",
        model="a-model-no-longer-served",
        stream={},
        prompt_tokens=2,
        next_seq=1,
        delta_start=1,
        generated_tokens=0,
        text="",
        metric_sent=False,
        at=0.0,
        held=[],
    )
    produce(
        kafka_bootstrap,
        names.changelog,
        [
            (b"garbled", garbage, None, partition_of[b"garbled"]),
            (b"retired", retired, None, partition_of[b"retired"]),
        ],
    )
    big = [
        (
            b"big",
            event(type="prompt", request_id="big", model="gpt2", prompt_token_ids=GPT2_PROMPT),
            None,
            None,
        ),
        (b"big", event(type="tokens", request_id="big", seq=1, token_ids=[THE] * 2000), None, None),
        (b"big", event(type="finish", request_id="big", seq=2), None, None),
    ]
    produce(kafka_bootstrap, names.input, big)
    run.replay()
    run_worker(run)
    run_worker(run)

    completions = run.completions()
    for request_id, completion in expected.items():
        assert completions[request_id] == completion
    assert completions["big"]["status"] == "failed"

    letters = dead_letters(kafka_bootstrap, names)
    reasons = sorted((reason_of(h), h["__detok.errors.request_id"].decode()) for _, h in letters)
    assert ("output_too_large", "big") in reasons
    restore_failures = [(v, h) for v, h in letters if reason_of(h) == "restore_failed"]
    # Once each: the failed marker written in their place is what the second run restores.
    assert sorted(v for v, _ in restore_failures) == sorted([garbage, retired])
    for _, headers in restore_failures:
        assert headers["__connect.errors.topic"] == names.changelog.encode()
    assert reasons.count(("request_already_failed", "garbled")) == 1
    assert reasons.count(("request_already_failed", "retired")) == 1
