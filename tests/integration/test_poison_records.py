"""Issue 16, crash loops and misattributed input: one bad record must never stop a partition.

Each test plants a bad record among good requests on the same partition (so they share consume
batches and transactions), runs `detok worker --exit-when-idle` twice on that input, and requires
what the project promises: both runs exit 0, the good requests complete exactly as `detok run`
decodes them, and the bad record sits in the dead-letter topic with its original bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.poison_harness import (
    Pipeline,
    Record,
    assert_good_requests_completed,
    assert_runs_twice_cleanly,
    completions,
    dead_letters,
    expected_completions,
    finish,
    generation_records,
    header_values,
    new_pipeline,
    produce,
    prompt,
    reasons_of,
    run_worker_until_idle,
    set_max_message_bytes,
    tokens,
)
from tests.integration.worker_harness import make_generations

pytestmark = pytest.mark.integration

GPT2_HELLO_WORLD = [15496, 995]  # "Hello world"
GPT2_LONG_TOKEN = 38093  # " =====...=" : 66 characters, the longest gpt2 token
# The reasons a record that the JSON decoder cannot take may honestly be given.
UNPARSEABLE_REASONS = {b"unexpected_error", b"malformed_json", b"schema_violation"}


def _good(count: int, seed: int, tmp_path: Path) -> tuple[list[dict], dict[str, dict]]:
    generations = make_generations(count, seed=seed)
    return generations, expected_completions(generations, tmp_path)


def _good_and(
    count: int, seed: int, tmp_path: Path, special: dict
) -> tuple[list[dict], dict[str, dict], dict]:
    """`_good`, plus `special`'s expected completion, from the same `detok run`."""
    generations = make_generations(count, seed=seed)
    expected = expected_completions([*generations, special], tmp_path)
    return generations, expected, expected.pop(special["request_id"])


def _in_two_runs(
    pipeline: Pipeline, first: list[Record], second: list[Record], states: tuple[str, str]
) -> None:
    """Plant `first`, run a worker until idle; plant `second`, run another: both exit 0.
    `states` names what each run leaves (the first run's end is a commit over it)."""
    for attempt, (records, state) in enumerate(zip((first, second), states, strict=True), 1):
        produce(pipeline.bootstrap, pipeline.names.input, records)
        worker = run_worker_until_idle(pipeline, instance_id=f"run{attempt}")
        assert worker.process.returncode == 0, f"run {attempt} ({state}):\n{worker.tail()}"


def _completed_or_failed_alone(
    pipeline: Pipeline,
    expected: dict[str, dict],
    expected_request: dict,
    failed_as_it_should: Callable[[], bool],
    why: str,
) -> None:
    """The good requests completed, and the special one either completed as `detok run` did
    or failed alone, as `failed_as_it_should()` checks."""
    assert_good_requests_completed(pipeline, expected)
    request_id = expected_request["request_id"]
    outcome = completions(pipeline).get(request_id)
    assert outcome is not None, f"request {request_id} has no completion"
    if outcome["status"] == "ok":
        assert outcome == expected_request
    else:
        assert failed_as_it_should(), why


def _has_output_too_large(pipeline: Pipeline, request_id: str) -> bool:
    """Is there an `output_too_large` dead letter for this request?"""
    return any(
        header_values(headers, "__detok.errors.reason") == [b"output_too_large"]
        and header_values(headers, "__detok.errors.request_id") == [request_id.encode()]
        for _, _, headers in dead_letters(pipeline)
    )


@pytest.mark.slow  # two worker runs
def test_item1_deeply_nested_field_is_dead_lettered_and_its_batch_completes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    good, expected = _good(30, 161, tmp_path)
    # A valid tokens event with one extra field 2,000 brackets deep: unknown fields are allowed,
    # so only the decoder's recursion meets it.
    deep = (
        b'{"type":"tokens","request_id":"deep","seq":1,"token_ids":[11],"x":'
        + b"[" * 2000
        + b"]" * 2000
        + b"}"
    )
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [
            *generation_records(good[:15]),
            Record(b"deep", prompt("deep", "gpt2", GPT2_HELLO_WORLD)),
            Record(b"deep", deep),
            *generation_records(good[15:]),
        ],
    )

    assert_runs_twice_cleanly(pipeline)

    assert_good_requests_completed(pipeline, expected)
    reasons = reasons_of(pipeline, deep)
    assert reasons, "the nested record is not in the dead-letter topic with its original bytes"
    assert set(reasons) <= UNPARSEABLE_REASONS, reasons


@pytest.mark.slow  # two worker runs
def test_item2_oversized_malformed_record_reaches_the_dead_letter_topic_whole(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """~1,040,000 bytes: the input topic takes it under the broker's default limit, so the
    dead-letter topic (made by `detok topics ensure`) must take it plus its error headers."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    good, expected = _good(20, 162, tmp_path)
    head = b'{"type":"tokens","request_id":"huge","seq":1,"token_ids":['
    huge = head + b"7," * ((1_040_000 - len(head)) // 2)  # never closed: malformed JSON
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [*generation_records(good[:10]), Record(b"huge", huge), *generation_records(good[10:])],
    )

    assert_runs_twice_cleanly(pipeline)

    assert_good_requests_completed(pipeline, expected)
    reasons = reasons_of(pipeline, huge)
    assert reasons, "the 1 MB record is not in the dead-letter topic with its original bytes"
    assert set(reasons) <= UNPARSEABLE_REASONS, reasons


@pytest.mark.slow  # two worker runs
def test_item2_large_out_of_order_event_held_across_runs_does_not_stop_the_worker(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A ~450 KB tokens event arrives before its predecessor and is held over a commit (the
    first run ends while the gap is open); the second run gets the missing event."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    first_ids, big_ids = [11, 995], [15496] * 75_000  # "15496," is 6 bytes: ~450 KB of value
    held = {
        "request_id": "held",
        "model": "gpt2",
        "prompt_token_ids": GPT2_HELLO_WORLD,
        "output_token_ids": first_ids + big_ids,
        "finish_reason": "stop",
    }
    good, expected, expected_held = _good_and(20, 163, tmp_path, held)
    big = tokens("held", 2, big_ids)
    assert 440_000 < len(big) < 460_000
    _in_two_runs(
        pipeline,
        [
            *generation_records(good[:10]),
            Record(b"held", prompt("held", "gpt2", GPT2_HELLO_WORLD)),
            Record(b"held", big),
            *generation_records(good[10:]),
        ],
        [Record(b"held", tokens("held", 1, first_ids)), Record(b"held", finish("held", 3))],
        ("gap open", "gap filled"),
    )

    # Or refused as too large to hold: failed, with the held record set aside whole.
    _completed_or_failed_alone(
        pipeline,
        expected,
        expected_held,
        lambda: bool(reasons_of(pipeline, big)),
        "failed, but the held event is not dead-lettered",
    )


@pytest.mark.slow  # two worker runs
def test_item2_request_whose_text_passes_1mb_fails_alone_or_completes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """~1.1 MB of text from 17k ids in small records: the completion (and a full-text snapshot)
    outgrow a default-sized record. Either it completes, or only this request fails with
    `output_too_large`; never a worker exit."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    long = {
        "request_id": "long",
        "model": "gpt2",
        "prompt_token_ids": GPT2_HELLO_WORLD,
        "output_token_ids": [GPT2_LONG_TOKEN] * 17_000,
        "finish_reason": "length",
    }
    good, expected, expected_long = _good_and(20, 164, tmp_path, long)
    assert len(expected_long["text"].encode()) > 1_100_000
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [
            *generation_records(good[:10]),
            *generation_records([long], chunk_size=4000),
            *generation_records(good[10:]),
        ],
    )

    assert_runs_twice_cleanly(pipeline)

    _completed_or_failed_alone(
        pipeline,
        expected,
        expected_long,
        lambda: _has_output_too_large(pipeline, "long"),
        "failed without output_too_large",
    )


@pytest.mark.slow  # two worker runs
def test_item2_200k_id_prompt_on_a_topic_that_allows_it_is_held_over_a_commit(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """An operator raised the input topic's limit; a 200k-id prompt (~1.2 MB) opens a request
    whose first tokens come only in the second run, so its state is snapshotted in between.
    Either the request completes, or it alone fails with `output_too_large`."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    set_max_message_bytes(kafka_bootstrap, pipeline.names.input, 4_000_000)
    request = {
        "request_id": "wide",
        "model": "gpt2",
        "prompt_token_ids": [15496] * 200_000,
        "output_token_ids": [11, 995, 13],
        "finish_reason": "stop",
    }
    good, expected, expected_request = _good_and(20, 169, tmp_path, request)
    wide_prompt = prompt("wide", "gpt2", request["prompt_token_ids"])
    assert len(wide_prompt) > 1_100_000
    _in_two_runs(
        pipeline,
        [*generation_records(good[:10]), Record(b"wide", wide_prompt)],
        [
            Record(b"wide", tokens("wide", 1, request["output_token_ids"])),
            Record(b"wide", finish("wide", 2)),
            *generation_records(good[10:]),
        ],
        ("prompt open", "tokens and finish"),
    )

    _completed_or_failed_alone(
        pipeline,
        expected,
        expected_request,
        lambda: _has_output_too_large(pipeline, "wide"),
        "failed without output_too_large",
    )


@pytest.mark.slow  # two worker runs
def test_item3_held_event_with_a_null_header_value_completes_once_the_gap_fills(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Kafka headers may have a null value; the record is held (seq 2 before seq 1) over a
    commit, so whatever the worker stores for held events must carry it."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    request = {
        "request_id": "nullh",
        "model": "gpt2",
        "prompt_token_ids": GPT2_HELLO_WORLD,
        "output_token_ids": [11, 995, 15496, 995],
        "finish_reason": "stop",
    }
    good, expected, expected_request = _good_and(20, 165, tmp_path, request)
    second = tokens("nullh", 2, [15496, 995])
    _in_two_runs(
        pipeline,
        [
            *generation_records(good[:10]),
            Record(b"nullh", prompt("nullh", "gpt2", GPT2_HELLO_WORLD)),
            Record(b"nullh", second, headers=[("trace", None), ("origin", b"upstream")]),
            *generation_records(good[10:]),
        ],
        [Record(b"nullh", tokens("nullh", 1, [11, 995])), Record(b"nullh", finish("nullh", 3))],
        ("event held", "gap filled"),
    )

    _completed_or_failed_alone(
        pipeline,
        expected,
        expected_request,
        lambda: bool(reasons_of(pipeline, second)),
        "failed, but the held event is not dead-lettered",
    )


def test_item17_error_headers_planted_on_input_do_not_name_the_failure(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    good, expected = _good(10, 166, tmp_path)
    malformed = b'{"type": "tokens", "request_id": "forged", "seq": 1, "tok'
    forged_headers = [
        ("__detok.errors.reason", b"ttl_expired"),
        ("__connect.errors.exception.message", b"fake"),
    ]
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [*generation_records(good), Record(b"forged", malformed, headers=forged_headers)],
    )
    worker = run_worker_until_idle(pipeline)
    assert worker.process.returncode == 0, worker.tail()

    assert_good_requests_completed(pipeline, expected)
    letters = [headers for _, value, headers in dead_letters(pipeline) if value == malformed]
    assert len(letters) == 1, f"{len(letters)} dead letters hold the malformed record"
    headers = letters[0]
    assert header_values(headers, "__detok.errors.reason") == [b"malformed_json"], headers
    messages = header_values(headers, "__connect.errors.exception.message")
    assert messages and b"fake" not in messages, headers


def test_item19_key_different_from_request_id_is_dead_lettered_key_mismatch(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    good, expected = _good(10, 167, tmp_path)
    mismatched = [
        prompt("keyed", "gpt2", GPT2_HELLO_WORLD),
        tokens("keyed", 1, [11, 995]),
        finish("keyed", 2),
    ]
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [*generation_records(good), *(Record(b"not-keyed", value) for value in mismatched)],
    )
    worker = run_worker_until_idle(pipeline)
    assert worker.process.returncode == 0, worker.tail()

    assert_good_requests_completed(pipeline, expected)
    for value in mismatched:
        assert reasons_of(pipeline, value) == [b"key_mismatch"], value


@pytest.mark.slow  # two worker runs
def test_item19_events_of_one_request_on_a_second_partition_are_partition_mismatch(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The request opens on partition 0 (first run); its later events arrive on partition 1
    (second run): those are the misrouted ones, whatever order partitions are read in."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path, partitions=2)
    good, expected = _good(20, 168, tmp_path)
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [
            *generation_records(good[:10]),
            Record(b"split", prompt("split", "gpt2", GPT2_HELLO_WORLD), partition=0),
            Record(b"split", tokens("split", 1, [11, 995]), partition=0),
        ],
    )
    first = run_worker_until_idle(pipeline, instance_id="run1")
    assert first.process.returncode == 0, first.tail()

    misrouted = [tokens("split", 2, [15496]), finish("split", 3)]
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [
            *(Record(b"split", value, partition=1) for value in misrouted),
            *generation_records(good[10:]),
        ],
    )
    second = run_worker_until_idle(pipeline, instance_id="run2")
    assert second.process.returncode == 0, second.tail()

    assert_good_requests_completed(pipeline, expected)
    for value in misrouted:
        assert reasons_of(pipeline, value) == [b"partition_mismatch"], value
