"""Generated records through the worker's real record handling and restore: nothing raises out.

The per-record rule (workers/runtime/record_handling.py, workers/runtime/changelog.py): any record,
however built (deep nesting, huge arrays, odd keys and headers, corrupt snapshots), either becomes
an event or a dead letter; the batch it came in still completes, and every dead letter can be
written with its original bytes and error headers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from schemas.validation import parse_event
from tests.unit.fake_records import FakeMessage
from tests.unit.small_tokenizers import byte_level
from workers.kafka.dead_letters import dead_letter_headers
from workers.kafka.origin import KafkaOrigin
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest
from workers.runtime.record_handling import handle_batch

REQUEST_IDS = ["r0", "r1", "r2"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    path: Path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path)
    return registry


def new_processor(registry: TokenizerRegistry) -> RequestProcessor:
    return RequestProcessor(
        registry, unknown_generated_ids="error", request_ttl_s=3600, finished_retention_s=600
    )


def deep(depth: int) -> bytes:
    """A valid tokens event with an extra field nested `depth` arrays deep."""
    return (
        b'{"type": "tokens", "request_id": "r0", "seq": 1, "token_ids": [65], "x": '
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
events = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("prompt"),
            "request_id": st.sampled_from(REQUEST_IDS),
            "model": st.sampled_from(["bytes", "nope"]),
            "prompt_token_ids": st.lists(st.integers(-5, 300), max_size=8),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tokens"),
            "request_id": st.sampled_from(REQUEST_IDS),
            "seq": st.integers(-1, 6),
            "token_ids": st.lists(st.integers(-5, 2**33), max_size=8),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("finish"),
            "request_id": st.sampled_from(REQUEST_IDS),
            "seq": st.integers(0, 6),
        },
        optional={"finish_reason": json_values},
    ),
)
values = st.one_of(
    events.map(lambda e: json.dumps(e).encode()),
    st.dictionaries(st.text(max_size=10), json_values).map(lambda e: json.dumps(e).encode()),
    st.binary(max_size=64),
    st.integers(100, 3000).map(deep),
    st.integers(10_000, 100_000).map(
        lambda n: json.dumps(
            {"type": "tokens", "request_id": "r1", "seq": 1, "token_ids": [66] * n}
        ).encode()
    ),
    st.none(),
)
header_lists = st.one_of(
    st.none(),
    st.lists(
        st.tuples(
            st.one_of(
                st.text(max_size=12),
                st.sampled_from(
                    [
                        "__connect.errors.exception.message",
                        "__detok.errors.reason",
                        "__detok.errors.attempt",
                    ]
                ),
            ),
            st.one_of(st.none(), st.binary(max_size=16), st.just(b"\xff\xfe not utf-8")),
        ),
        max_size=4,
    ),
)
keys = st.one_of(
    st.none(), st.sampled_from([r.encode() for r in REQUEST_IDS]), st.binary(max_size=8)
)
records = st.builds(
    FakeMessage,
    values,
    keys,
    header_lists,
    st.integers(0, 2),
    st.integers(0, 10**9),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(records, min_size=1, max_size=8), min_size=1, max_size=4))
def test_no_record_raises_out_of_handling_or_restore(registry, batches) -> None:
    processor = new_processor(registry)
    owners: dict[str, int] = {}
    touched: set[str] = set()
    for batch in batches:
        handled = handle_batch(batch, processor, owners, now=1_700_000_000.0)
        owners.update(handled.new_owners)
        touched |= handled.result.touched
        letters = handled.dead_letters + handled.result.dead_letters
        for letter in letters:
            headers = dead_letter_headers(letter, "group", "instance")
            reasons = [v for k, v in headers if k == "__detok.errors.reason"]
            assert reasons == [letter.reason.value.encode()], "exactly this failure's reason"
        assert handled.records == len(batch)
    # Everything the batches left behind snapshots and restores into a fresh processor.
    changelog = {
        request_id.encode(): FakeMessage(
            processor.snapshot(request_id),
            request_id.encode(),
            [(PROCESSED_OFFSET_HEADER, b"1")],
            owners.get(request_id, 0),
            topic_name="detok.state-changelog",
        )
        for request_id in touched
    }
    restored = apply_latest(changelog, new_processor(registry), committed_input=None)
    assert restored.failed == []


snapshot_corruptions = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.just(b"null"),
    st.dictionaries(st.text(max_size=12), json_values).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["active", "failed", "finished", "future"])},
        optional={
            "model": st.one_of(st.just("bytes"), st.just("removed-model"), json_values),
            "stream": json_values,
            "text": json_values,
            "held": json_values,
            "next_seq": json_values,
            "reason": json_values,
            "last_seq": json_values,
            "at": json_values,
        },
    ).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=120, deadline=None)
@given(
    value=snapshot_corruptions,
    key=st.one_of(st.just(b"r0"), st.binary(max_size=6), st.none()),
    offset_header=st.one_of(st.just(b"5"), st.just(b"x"), st.none(), st.binary(max_size=4)),
    at_least_once=st.booleans(),
)
def test_a_corrupt_changelog_record_fails_its_request_not_the_restore(
    registry, value, key, offset_header, at_least_once
) -> None:
    processor = new_processor(registry)
    good = new_processor(registry)
    good.process([_prompt_event("good")], now=1.0)
    changelog = {
        key: FakeMessage(value, key, [(PROCESSED_OFFSET_HEADER, offset_header)], 0),
        b"good": FakeMessage(good.snapshot("good"), b"good", [(PROCESSED_OFFSET_HEADER, b"0")], 0),
    }
    restored = apply_latest(changelog, processor, {0: 10} if at_least_once else None)
    assert restored.owners.get("good") == 0, "the good record restores whatever the other holds"
    for letter in restored.failed:
        assert letter.reason is DeadLetterReason.RESTORE_FAILED
        assert letter.value == (value or b""), "the changelog record's original bytes"
        dead_letter_headers(letter, "group", "instance")
        if letter.request_id is not None:
            assert processor.snapshot(letter.request_id) is not None, "marked failed"


def _prompt_event(request_id: str) -> tuple[object, KafkaOrigin]:
    value = json.dumps(
        {"type": "prompt", "request_id": request_id, "model": "bytes", "prompt_token_ids": [72]}
    ).encode()
    return parse_event(value), KafkaOrigin(FakeMessage(value, request_id.encode()))
