"""The per-record rule on records without a broker: what is dead-lettered, with which reason,
and what the worker's request-to-partition map keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.processor import BatchResult, DeadLetter, RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from tests.unit.fake_records import FakeMessage
from tests.unit.small_tokenizers import byte_level
from workers.kafka.dead_letters import ATTEMPT_HEADER, dead_letter_headers
from workers.kafka.origin import KafkaOrigin
from workers.runtime.record_handling import handle_batch

NOW = 1_700_000_000.0


@pytest.fixture
def processor(tmp_path: Path) -> RequestProcessor:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    return RequestProcessor(
        registry, unknown_generated_ids="error", request_ttl_s=3600, finished_retention_s=600
    )


def record(partition: int = 0, key: bytes | None | str = "", **event) -> FakeMessage:
    request_id = event["request_id"]
    return FakeMessage(
        json.dumps(event).encode(),
        request_id.encode() if key == "" else key,
        partition_number=partition,
    )


def prompt(request_id: str, partition: int = 0, **extra) -> FakeMessage:
    return record(
        partition,
        type="prompt",
        request_id=request_id,
        model="bytes",
        prompt_token_ids=[72],
        **extra,
    )


def tokens(request_id: str, seq: int, partition: int = 0, **extra) -> FakeMessage:
    return record(
        partition, type="tokens", request_id=request_id, seq=seq, token_ids=[105], **extra
    )


def finish(request_id: str, seq: int, partition: int = 0) -> FakeMessage:
    return record(partition, type="finish", request_id=request_id, seq=seq)


def reasons(letters: list[DeadLetter]) -> list[str]:
    return [letter.reason.value for letter in letters]


def test_orphan_events_leave_no_owner_entry(processor) -> None:
    """Issue 16 item 12: 200k orphans grew the map by 156 MB and nothing ever removed them."""
    owners: dict[str, int] = {}
    orphans = [tokens(f"orphan-{i}", 1, partition=i % 3) for i in range(5000)]
    handled = handle_batch([prompt("live"), *orphans], processor, owners, NOW)
    owners.update(handled.new_owners)
    assert reasons(handled.result.dead_letters) == ["missing_prompt"] * 5000
    assert owners == {"live": 0}, "only a request with state gets an owner"


def test_a_key_other_than_the_request_id_is_dead_lettered(processor) -> None:
    owners: dict[str, int] = {}
    batch = [
        prompt("a"),
        tokens("a", 1, key=b"b"),  # keyed for another request: lands on another's partition
        tokens("a", 1),
        finish("a", 2),
    ]
    handled = handle_batch(batch, processor, owners, NOW)
    assert reasons(handled.dead_letters) == ["key_mismatch"]
    assert handled.dead_letters[0].origin.key == b"b"
    assert [c.status for c in handled.result.completions] == ["ok"]
    assert handled.result.completions[0].text == "i"


def test_events_on_a_partition_that_does_not_own_the_request_are_dead_lettered(
    processor,
) -> None:
    owners: dict[str, int] = {}
    first = handle_batch([prompt("a", partition=0), tokens("a", 1)], processor, owners, NOW)
    owners.update(first.new_owners)
    assert owners == {"a": 0}
    second = handle_batch(
        [tokens("a", 2, partition=1), tokens("a", 2, partition=0), finish("a", 3, partition=0)],
        processor,
        owners,
        NOW,
    )
    assert reasons(second.dead_letters) == ["partition_mismatch"]
    assert second.dead_letters[0].origin.partition == 1
    assert [c.text for c in second.result.completions] == ["ii"]


def test_two_partitions_in_one_batch_the_first_claims_the_request(processor) -> None:
    handled = handle_batch(
        [prompt("a", partition=2), tokens("a", 1, partition=0)], processor, {}, NOW
    )
    assert reasons(handled.dead_letters) == ["partition_mismatch"]
    assert handled.new_owners == {"a": 2}


class ExplodingProcessor(RequestProcessor):
    """A processor with a bug that one request's events trigger."""

    def process(self, batch, now: float) -> BatchResult:
        batch = list(batch)
        if any(event.request_id == "boom" and event.type == "prompt" for event, _ in batch):
            raise RuntimeError("a bug this request triggers")
        return super().process(batch, now)


def test_an_exception_while_processing_fails_only_the_record_that_raised(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    processor = ExplodingProcessor(
        registry, unknown_generated_ids="error", request_ttl_s=3600, finished_retention_s=600
    )
    batch = [prompt("ok"), prompt("boom"), tokens("ok", 1), finish("ok", 2)]
    handled = handle_batch(batch, processor, {}, NOW)
    assert reasons(handled.dead_letters) == ["unexpected_error"]
    letter = handled.dead_letters[0]
    assert (letter.error_class, letter.message) == ("RuntimeError", "a bug this request triggers")
    assert letter.value == batch[1].value()
    assert [(c.request_id, c.text) for c in handled.result.completions] == [("ok", "i")]
    # The request is failed: its later events are set aside as such, not retried as new.
    later = handle_batch([tokens("boom", 1)], processor, handled.new_owners, NOW)
    assert reasons(later.result.dead_letters) == ["request_already_failed"]


def test_deep_nesting_is_an_unexpected_error_and_the_batch_goes_on(processor) -> None:
    """Issue 16 item 1: 2,000 nested arrays raised RecursionError out of the worker."""
    nested = (
        b'{"type": "tokens", "request_id": "a", "seq": 1, "token_ids": [105], "x": '
        + b"[" * 2000
        + b"]" * 2000
        + b"}"
    )
    batch = [prompt("a"), FakeMessage(nested, b"a"), tokens("a", 1), finish("a", 2)]
    handled = handle_batch(batch, processor, {}, NOW)
    assert len(handled.dead_letters) == 1
    assert handled.dead_letters[0].value == nested
    assert [c.text for c in handled.result.completions] == ["i"]


def test_a_tombstone_is_dead_lettered_as_a_tombstone(processor) -> None:
    """Issue 16 item 20: a null value came out of the dead-letter topic as an empty one."""
    batch = [prompt("a"), FakeMessage(None, b"a"), tokens("a", 1), finish("a", 2)]
    handled = handle_batch(batch, processor, {}, NOW)
    assert [letter.reason for letter in handled.dead_letters] == [DeadLetterReason.MALFORMED_JSON]
    assert handled.dead_letters[0].value is None
    assert [c.text for c in handled.result.completions] == ["i"]


def test_error_headers_on_the_input_are_not_taken_as_this_failures() -> None:
    """Issue 16 item 17: a producer could make a record appear with any reason and message."""
    forged = FakeMessage(
        b"garbage",
        b"k",
        [
            ("trace-id", b"abc"),
            ("__connect.errors.exception.message", b"forged message"),
            ("__detok.errors.reason", b"ttl_expired"),
            ("__detok.errors.attempt", b"2"),
            ("null-header", None),
        ],
    )
    letter = DeadLetter(
        DeadLetterReason.MALFORMED_JSON, "DecodeError", "real", None, None, KafkaOrigin(forged)
    )
    headers = dead_letter_headers(letter, "g", "i")
    by_name: dict[str, list] = {}
    for name, value in headers:
        by_name.setdefault(name, []).append(value)
    assert by_name["__detok.errors.reason"] == [b"malformed_json"]
    assert by_name["__connect.errors.exception.message"] == [b"real"]
    assert by_name["trace-id"] == [b"abc"] and by_name["null-header"] == [None]
    assert by_name[ATTEMPT_HEADER] == [b"2"], "a redriven record keeps its attempt count"

    forged.header_list = [("__detok.errors.attempt", b"not a number")]
    headers = dict(dead_letter_headers(letter, "g", "i"))
    assert headers[ATTEMPT_HEADER] == b"0"


def test_an_orphan_event_on_another_partition_does_not_turn_the_prompt_away(processor) -> None:
    handled = handle_batch(
        [tokens("a", 1, partition=1), prompt("a", partition=0), finish("a", 1, partition=0)],
        processor,
        {},
        NOW,
    )
    assert reasons(handled.dead_letters + handled.result.dead_letters) == ["missing_prompt"]
    assert handled.new_owners == {"a": 0}
    assert [c.status for c in handled.result.completions] == ["ok"]
