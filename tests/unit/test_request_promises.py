"""Issue 32's processor findings: every request that opened ends with one completion, and every
record has one fate, under the inputs a hostile producer sends (logprob shapes, held events with
large headers, clocks that lag the wall clock)."""

from __future__ import annotations

import json

import pytest

from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedPrompt, ParsedTokens
from tests.unit.fake_records import FakeMessage
from tests.unit.request_events import (
    bytes_registry,
    finish,
    ids,
    origin,
    reasons,
    run,
    run_records,
    tokens,
)
from tests.unit.test_output_writer import LIMIT, NAMES, RecordingProducer, writer
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest
from workers.runtime.checkpointing import Output
from workers.runtime.output_limits import HELD_SHARE_OF_LIMIT
from workers.runtime.record_handling import process_guarded


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def plain_prompt(request_id: str = "r") -> ParsedPrompt:
    return ParsedPrompt(request_id=request_id, model="bytes", prompt_token_ids=ids("Hi"))


def logprob_tokens(seq: int, text: str, request_id: str = "r", top: int = 1) -> ParsedTokens:
    token_ids = ids(text)
    return ParsedTokens(
        request_id=request_id,
        seq=seq,
        token_ids=token_ids,
        logprobs=[-1.0] * len(token_ids),
        top_logprobs=[[(i + k, -2.0 - k) for k in range(top)] for i in token_ids],
    )


def empty_tokens(seq: int, request_id: str = "r") -> ParsedTokens:
    return ParsedTokens(request_id=request_id, seq=seq, token_ids=[])


# -- item 8: an empty tokens event without logprobs ---------------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_an_empty_tokens_event_without_logprobs_is_no_fault(registry, first: bool) -> None:
    """`token_ids: []` carries no ids, so it owes no logprobs, wherever it comes in the chunk."""
    processor = RequestProcessor(registry)
    events = [logprob_tokens(1, "ab"), empty_tokens(2), logprob_tokens(3, "cd")]
    if first:
        events = [empty_tokens(1), logprob_tokens(2, "ab"), logprob_tokens(3, "cd")]
    result = run(processor, plain_prompt(), *events, finish(4))
    assert reasons(result) == []
    (completion,) = result.completions
    assert completion.status == "ok" and completion.text == "abcd"
    assert [e.text for e in completion.logprobs.entries()] == list("abcd")


# -- item 1: every path that fails a request publishes its failed completion --------------------


def stop_prompt(request_id: str = "r") -> ParsedPrompt:
    return ParsedPrompt(
        request_id=request_id, model="bytes", prompt_token_ids=ids("Hi"), stop=["STOP"]
    )


def test_mark_failed_publishes_one_failed_completion_with_the_text_so_far(registry) -> None:
    processor = RequestProcessor(registry)
    # "ST" is held back (it may begin "STOP"), seq 3 is held (seq 2 missing).
    run_records(processor, stop_prompt(), tokens(1, "Hello ST"), tokens(3, "x"))
    failed = processor.mark_failed("r", DeadLetterReason.OUTPUT_TOO_LARGE, message="too big")
    (completion,) = failed.completions
    assert (completion.status, completion.text, completion.error) == (
        "failed",
        "Hello ST",
        "too big",
    )
    assert [d.text for d in failed.deltas] == ["ST"] and failed.deltas[0].final
    assert reasons(failed) == ["request_already_failed"]  # the held seq 3: one fate
    assert failed.touched == {"r"}
    again = processor.mark_failed("r", DeadLetterReason.UNEXPECTED_ERROR)
    assert again.completions == [] and again.dead_letters == [], "exactly one completion"
    assert reasons(run(processor, tokens(2, "y"))) == ["request_already_failed"]


def test_mark_failed_on_a_restored_request_publishes_its_text(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, plain_prompt(), tokens(1, "Hello"))
    log = dict(processor.changelog_records("r"))
    restored = RequestProcessor(registry)
    restored.restore("r", log[b"r"], {0: log[b"r\xff0"]})
    (completion,) = restored.mark_failed("r", DeadLetterReason.UNEXPECTED_ERROR).completions
    assert (completion.status, completion.text) == ("failed", "Hello")


def test_a_head_that_does_not_restore_gets_a_failed_completion(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, plain_prompt(), tokens(1, "Hello"))
    log = dict(processor.changelog_records("r"))
    del log[b"r\xff0"]  # its segment lost: the head cannot be restored
    run(processor, plain_prompt("done"), tokens(1, "x", "done"), finish(2, "done"))
    log[b"done"] = dict(processor.changelog_records("done"))[b"done"]
    log[b"done"] = log[b"done"].replace(b'"finished"', b'"finished","last_seq":"x"')  # garbage
    latest = {k: FakeMessage(v, k, [(PROCESSED_OFFSET_HEADER, b"0")], 0) for k, v in log.items()}
    target = RequestProcessor(registry)
    restored = apply_latest(latest, target, None)
    assert sorted(letter.request_id for letter in restored.failed) == ["done", "r"]
    # The live request's completion; the finished one had its own already.
    (completion,) = restored.failed_requests.completions
    assert (completion.request_id, completion.status, completion.text) == ("r", "failed", "")
    assert completion.generated_tokens == 5 and "segment 0" in completion.error


def test_a_changelog_record_too_large_publishes_the_failed_completion(registry) -> None:
    """What the worker calls when the changelog refuses a request's record (the writer)."""
    processor = RequestProcessor(registry)
    run(processor, plain_prompt(), tokens(1, "Hello"))
    producer = RecordingProducer()
    out = writer(producer, processor)
    out.write(Output(NAMES.changelog, b"r\xff0", b"s" * LIMIT, partition=3, request_id="r"))
    by_topic = {}
    for record in producer.records:
        by_topic.setdefault(record["topic"], []).append(record)
    (completion,) = by_topic[NAMES.completions]
    assert json.loads(completion["value"])["status"] == "failed"
    assert json.loads(completion["value"])["text"] == "Hello"
    assert json.loads(by_topic[NAMES.changelog][-1]["value"])["state"]["kind"] == "failed"


class RaisingProcessor(RequestProcessor):
    """A processor with a bug that raises out of `process` for any batch holding seq 2."""

    def process(self, batch, now=0.0):
        if any(event.seq == 2 for event, _ in batch):
            raise RuntimeError("processor bug")
        return super().process(batch, now)


def test_a_batch_that_raises_fails_its_request_with_a_completion(registry) -> None:
    processor = RaisingProcessor(registry)
    run(processor, plain_prompt(), tokens(1, "Hello"))
    batch = [(e, origin(i, e)) for i, e in enumerate([tokens(2, "x"), tokens(3, "y")])]
    letters: list = []
    result = process_guarded(processor, batch, 0.0, letters)
    assert [letter.reason.value for letter in letters] == ["unexpected_error"]
    (completion,) = result.completions
    assert (completion.status, completion.text) == ("failed", "Hello")
    # seq 3 was held (seq 2 never decoded): one fate, dead-lettered with the request.
    assert reasons(result) == ["request_already_failed"]


# -- item 2: held events are counted as stored, headers included --------------------------------


def test_held_events_with_large_headers_never_outgrow_the_changelog(registry) -> None:
    """Out-of-order events with tiny values and ~900 KB of headers between them: the request
    fails on its gap (one failed completion, every held record dead-lettered) before its head
    outgrows the changelog's limit; each record has one fate."""
    changelog_limit = 1_000_000
    processor = RequestProcessor(registry, max_held_bytes=changelog_limit // HELD_SHARE_OF_LIMIT)
    run(processor, plain_prompt(), tokens(1, "Hi"))
    headers = (("trace", b"t" * 128_000),)
    fates = 0
    failed = None
    for seq in range(3, 10):  # seq 2 never comes: seven held events
        result = processor.process(
            [(tokens(seq, "x"), origin(seq, tokens(seq, "x"), headers=headers))]
        )
        fates += len(result.dead_letters)
        failed = failed or result.completions
        head = dict(processor.changelog_records("r")).get(b"r")
        assert head is None or len(head) <= changelog_limit
    assert [c.status for c in failed] == ["failed"] and failed[0].text == "Hi"
    assert fates == 7, "every held record dead-lettered once"


# -- item 3: idleness in one clock per request --------------------------------------------------

TTL = 30.0


def stamped(processor: RequestProcessor, event, record_time: float, now: float):
    """`event` in a record stamped `record_time` (its producer's clock), consumed at `now`."""
    record = origin(0, event, timestamp_ms=int(record_time * 1000))
    return processor.process([(event, record)], now)


@pytest.mark.parametrize(
    "skew",
    [
        121.0,  # a producer whose clock runs two minutes slow
        3 * 86_400.0,  # a backfill replaying three-day-old logs with their original CreateTime
    ],
)
def test_a_request_fed_every_second_never_expires_whatever_its_records_say(
    registry, skew: float
) -> None:
    processor = RequestProcessor(registry, request_ttl_s=TTL)
    wall = 10_000_000.0
    ended = []
    stamped(processor, plain_prompt(), wall - skew, wall)
    # The sweep lands right after the prompt, with the partition caught up (wall clock).
    ended += processor.expire(wall + 0.5, latest=wall + 0.5).completions
    for seq in range(1, 100):
        wall += 1.0
        ended += stamped(processor, tokens(seq, "x"), wall - skew, wall).completions
        # Caught up now and then: the wall clock; else the partition's newest record time.
        reference = wall + 0.5 if seq % 3 else wall - skew
        ended += processor.expire(reference, latest=wall + 0.5).completions
    assert ended == [], "a live request was expired"
    done = stamped(processor, finish(100), wall - skew, wall + 1.0)
    assert [(c.status, c.text) for c in done.completions] == [("ok", "x" * 99)]


def test_a_producer_that_stops_expires_after_the_ttl_in_the_consumers_clock(registry) -> None:
    processor = RequestProcessor(registry, request_ttl_s=TTL)
    wall = 10_000_000.0
    stamped(processor, plain_prompt(), wall - 3_600.0, wall)
    stamped(processor, tokens(1, "so"), wall - 3_600.0, wall)
    assert processor.expire(wall + TTL - 1, latest=wall + TTL - 1).completions == []
    expired = processor.expire(wall + TTL, latest=wall + TTL)
    assert [(c.status, c.text) for c in expired.completions] == [("failed", "so")]


def test_a_record_time_ahead_of_the_wall_clock_never_expires_early(registry) -> None:
    """A producer whose clock runs fast raises its partition's newest record time (the worker's
    reference during a backlog) past the wall clock: it counts as the wall clock."""
    processor = RequestProcessor(registry, request_ttl_s=TTL)
    wall = 10_000_000.0
    stamped(processor, plain_prompt(), wall, wall)
    stamped(processor, tokens(1, "so"), wall, wall)
    fast = wall + 3_600.0  # another producer's record, an hour ahead
    assert processor.expire(fast, latest=wall + 1.0).completions == []
