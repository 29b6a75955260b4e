"""Issue 32 items 1, 2 and 3 on a real broker: a running `detok worker` gives every request that
opened exactly one completion and every record one fate, when a producer's record timestamps lag
the wall clock (item 3), when held events carry large headers (item 2), and when a request's
changelog record outgrows the changelog topic mid-stream (item 1).

Each test plants records with a raw producer (any timestamp, any headers), runs one worker with
short configured limits (`--request-ttl`, the changelog's `max.message.bytes`) and reads what it
committed: completions, every completion record of a key (not only the latest) and dead letters.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.integration.poison_harness import (
    Pipeline,
    Record,
    WorkerProcess,
    assert_good_requests_completed,
    dead_letters,
    expected_completions,
    finish,
    generation_records,
    header_values,
    new_pipeline,
    produce,
    prompt,
    read_records,
    set_max_message_bytes,
    started_worker,
    tokens,
    wait_until_consumed,
)
from tests.integration.worker_harness import make_generations, wait_until

pytestmark = pytest.mark.integration

GPT2_HELLO_WORLD = [15496, 995]  # "Hello world"
REASON = "__detok.errors.reason"
REQUEST_ID = "__detok.errors.request_id"


def _completion_records(pipeline: Pipeline, request_id: str) -> list[dict]:
    """Every committed completion record of one request, in order (a compacted topic's reader
    may see duplicates before compaction: exactly one must ever be written)."""
    return [
        json.loads(record.value)
        for record in read_records(pipeline.bootstrap, pipeline.names.completions)
        if record.key == request_id.encode()
    ]


def _reasons_by_value(pipeline: Pipeline) -> dict[bytes | None, list[bytes | None]]:
    """Each dead-lettered value and the reasons of every dead letter holding it."""
    reasons: dict[bytes | None, list[bytes | None]] = {}
    for _, value, headers in dead_letters(pipeline):
        reasons.setdefault(value, []).extend(header_values(headers, REASON))
    return reasons


def _live_worker(worker: WorkerProcess) -> None:
    """Until the worker has restored its partitions: events produced from then on are consumed
    as they come (a live stream, not a backlog)."""
    wait_until(lambda: "restored" in worker.output(), "the worker's restore")


def _wait_exit_zero(worker: WorkerProcess) -> None:
    code = worker.wait()
    assert code == 0, f"worker exited {code}:\n{worker.tail()}"


def _ok_text(request_id: str, output_ids: list[int], tmp_path: Path) -> str:
    """`detok run`'s text for a gpt2 generation of `output_ids` after "Hello world"."""
    generation = {
        "request_id": request_id,
        "model": "gpt2",
        "prompt_token_ids": GPT2_HELLO_WORLD,
        "output_token_ids": output_ids,
        "finish_reason": "stop",
    }
    return expected_completions([generation], tmp_path)[request_id]["text"]


# -- item 3: idleness in the consumer's clock ---------------------------------------------------

TTL_S = 4
SKEW_S = 3 * 86_400  # a backfill keeping three-day-old CreateTimes
FED_EVENTS = 8  # one a second: twice the TTL
FED_IDS = [11, 995, 13, 15496, 11, 995, 13, 15496]


@pytest.mark.slow  # a paced stream of twice the TTL
def test_item3_a_request_fed_every_second_with_old_timestamps_completes_and_a_stopped_one_expires(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Records stamped three days ago, one a second for twice the TTL: the request completes
    `ok`. A request whose producer stops after its first tokens expires a TTL after that event
    was consumed (its error says idle seconds, not days), with the text so far."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    fed_text = _ok_text("fed", FED_IDS, tmp_path)
    stopped_text = _ok_text("stopped", FED_IDS[:1], tmp_path)

    def stamped(key: str, value: bytes) -> Record:
        return Record(key.encode(), value, timestamp_ms=int((time.time() - SKEW_S) * 1000))

    with started_worker(
        pipeline, "--request-ttl", str(TTL_S), "--exit-when-idle", str(2 * TTL_S)
    ) as worker:
        _live_worker(worker)
        produce(
            kafka_bootstrap,
            pipeline.names.input,
            [
                stamped("fed", prompt("fed", "gpt2", GPT2_HELLO_WORLD)),
                stamped("stopped", prompt("stopped", "gpt2", GPT2_HELLO_WORLD)),
            ],
        )
        for seq, token in enumerate(FED_IDS, start=1):
            time.sleep(1)
            records = [stamped("fed", tokens("fed", seq, [token]))]
            if seq == 1:  # its producer stops after this one
                records.append(stamped("stopped", tokens("stopped", 1, [token])))
            produce(kafka_bootstrap, pipeline.names.input, records)
        time.sleep(1)
        produce(
            kafka_bootstrap, pipeline.names.input, [stamped("fed", finish("fed", FED_EVENTS + 1))]
        )
        _wait_exit_zero(worker)

    fed = _completion_records(pipeline, "fed")
    assert [(c["status"], c["text"]) for c in fed] == [("ok", fed_text)], fed
    (stopped,) = _completion_records(pipeline, "stopped")
    assert (stopped["status"], stopped["text"]) == ("failed", stopped_text), stopped
    idle = re.search(r"no event for (\d+)s", stopped["error"])
    assert idle is not None, stopped["error"]
    # Measured in the consumer's clock: seconds past the TTL, never the records' days of lag.
    assert TTL_S <= int(idle.group(1)) < SKEW_S // 2, stopped["error"]
    letters = [
        (header_values(h, REQUEST_ID), header_values(h, REASON))
        for _, _, h in dead_letters(pipeline)
    ]
    assert letters == [([b"stopped"], [b"ttl_expired"])], letters


# -- item 2: held events counted as stored, headers included -------------------------------------

CHANGELOG_LIMIT = 1_000_000
HEADER_BYTES = 128_000  # seven held: ~1.2 MB as a snapshot stores them (base64), past the limit
HELD_SEQS = range(3, 10)  # seq 2 never comes


@pytest.mark.slow  # a worker run
def test_item2_held_events_with_large_headers_fail_their_request_once_each_one_fate(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Out-of-order tokens events with tiny values and 128 KB headers, behind a gap that never
    fills, on a changelog that takes 1 MB records: the request gets exactly one failed completion
    (its text so far), each held record is dead-lettered exactly once with its original bytes,
    the worker exits 0 and the requests around it complete as `detok run` decodes them."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    set_max_message_bytes(pipeline.bootstrap, pipeline.names.changelog, CHANGELOG_LIMIT)
    good = make_generations(10, seed=321)
    expected = expected_completions(good, tmp_path)
    text_so_far = _ok_text("hdr", [11, 995], tmp_path)
    headers = [("trace", b"t" * HEADER_BYTES)]
    held = [Record(b"hdr", tokens("hdr", seq, [13]), headers=headers) for seq in HELD_SEQS]
    first = [
        *generation_records(good[:5]),
        Record(b"hdr", prompt("hdr", "gpt2", GPT2_HELLO_WORLD)),
        Record(b"hdr", tokens("hdr", 1, [11, 995])),
    ]
    with started_worker(pipeline, "--exit-when-idle", "5") as worker:
        _live_worker(worker)  # its group's coordinator answers the offset lookups from then on
        produce(kafka_bootstrap, pipeline.names.input, first)
        wait_until_consumed(pipeline, [len(first)])  # seq 1 decoded: the text so far
        produce(kafka_bootstrap, pipeline.names.input, [*held, *generation_records(good[5:])])
        _wait_exit_zero(worker)

    assert_good_requests_completed(pipeline, expected)
    outcomes = [(c["status"], c["text"]) for c in _completion_records(pipeline, "hdr")]
    assert outcomes == [("failed", text_so_far)], outcomes
    reasons = _reasons_by_value(pipeline)
    fates = {record.value: len(reasons.get(record.value, [])) for record in held}
    assert list(fates.values()) == [1] * len(held), "each held record dead-lettered once"
    # Counted as stored, the held events fail their request before its snapshot outgrows the
    # changelog: no snapshot was refused (an `output_too_large` dead letter would say so).
    assert not any(b"output_too_large" in r for r in reasons.values()), reasons


# -- item 1: a failed completion when the changelog refuses a request's record ---------------------

SMALL_CHANGELOG_LIMIT = 20_000
WIDE_IDS = list(range(300, 1300))  # one tokens event whose top-20 logprobs outgrow the changelog


def _logprob_tokens(request_id: str, seq: int, ids: list[int]) -> bytes:
    top = [[[(i + k) % 50_000, -1.0 - k] for k in range(20)] for i in ids]
    return json.dumps(
        {
            "type": "tokens",
            "request_id": request_id,
            "seq": seq,
            "token_ids": ids,
            "logprobs": [-0.5] * len(ids),
            "top_logprobs": top,
        },
        separators=(",", ":"),
    ).encode()


@pytest.mark.slow  # a worker run over two produce rounds
def test_item1_a_changelog_record_too_large_mid_stream_gives_one_failed_completion(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A logprobs request whose changelog record outgrows a 20 KB changelog while it is live
    (its 1,000-token top-20 chunk is committed before its end arrives): exactly one `failed`
    completion with the text so far, its later events dead-lettered `request_already_failed`,
    the requests around it complete as `detok run` decodes them, the worker exits 0."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    set_max_message_bytes(pipeline.bootstrap, pipeline.names.changelog, SMALL_CHANGELOG_LIMIT)
    good = make_generations(10, seed=322)
    expected = expected_completions(good, tmp_path)
    text_so_far = _ok_text("lp", [11, 995, *WIDE_IDS], tmp_path)
    first = [
        *generation_records(good[:5]),
        Record(b"lp", prompt("lp", "gpt2", GPT2_HELLO_WORLD)),
        Record(b"lp", _logprob_tokens("lp", 1, [11, 995])),
        Record(b"lp", _logprob_tokens("lp", 2, WIDE_IDS)),
    ]
    later = [Record(b"lp", _logprob_tokens("lp", 3, [13])), Record(b"lp", finish("lp", 4))]
    with started_worker(pipeline, "--exit-when-idle", "5") as worker:
        _live_worker(worker)  # its group's coordinator answers the offset lookups from then on
        produce(kafka_bootstrap, pipeline.names.input, first)
        wait_until_consumed(pipeline, [len(first)])  # committed with the request still live
        produce(kafka_bootstrap, pipeline.names.input, [*later, *generation_records(good[5:])])
        _wait_exit_zero(worker)

    assert_good_requests_completed(pipeline, expected)
    (completion,) = _completion_records(pipeline, "lp")
    assert (completion["status"], completion["text"]) == ("failed", text_so_far), completion
    assert pipeline.names.changelog in completion["error"], "failed by the changelog's refusal"
    reasons = _reasons_by_value(pipeline)
    assert [reasons.get(record.value) for record in later] == [[b"request_already_failed"]] * 2
