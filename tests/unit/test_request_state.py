"""Request snapshots: the versioned changelog value, what it keeps, and what it refuses.

Covers issue 16 items 2 (a held event's snapshot stores its record once), 3 (null header values)
and 4 (a value that cannot be restored raises `SnapshotError`, never anything else).
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import SnapshotError
from pipeline.processor import RequestProcessor
from pipeline.request_state import (
    SNAPSHOT_VERSION,
    ActiveRequest,
    FailedRequest,
    json_prefix,
    json_size,
)
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from tests.unit.request_events import (
    bytes_registry,
    finish,
    ids,
    prompt,
    reasons,
    run,
    run_records,
    tokens,
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def held_request(registry: TokenizerRegistry, **origin_fields) -> RequestProcessor:
    """A request "r" with text "ab" decoded and seq 3 held (seq 2 missing)."""
    processor = RequestProcessor(registry)
    run_records(processor, prompt(), tokens(1, "ab"), tokens(3, "held"), **origin_fields)
    return processor


def test_snapshot_is_versioned_and_every_kind_round_trips(registry) -> None:
    processor = held_request(registry)
    run(processor, prompt("done"), finish(1, "done"), prompt("bad", model="nope"))
    for request_id, kind in (("r", "active"), ("done", "finished"), ("bad", "failed")):
        value = processor.snapshot(request_id)
        decoded = json.loads(value)
        assert decoded["version"] == SNAPSHOT_VERSION and decoded["state"]["kind"] == kind
        restored = RequestProcessor(registry)
        restored.restore(request_id, value)
        assert restored.snapshot(request_id) == value
    assert processor.snapshot("missing") is None


def test_a_restored_request_keeps_its_held_events_and_text(registry) -> None:
    original = held_request(registry)
    restored = RequestProcessor(registry)
    restored.restore("r", original.snapshot("r"))
    tail = [tokens(2, "c"), finish(4)]
    expected = run(original, *tail)
    got = run(restored, *tail)
    assert got.completions == expected.completions
    assert [c.text for c in got.completions] == ["abcheld"]
    assert [(d.text_offset, d.text) for d in got.deltas] == [(2, "cheld")]


def test_a_held_record_is_stored_once_as_text(registry) -> None:
    # Issue 16 item 2: the held event's JSON plus its record in base64 made a 450 KB tokens
    # event a ~1 MB snapshot (2.3x), past the broker's default record size.
    processor = RequestProcessor(registry)
    big = tokens(3, [i % 10_000 for i in range(90_000)])
    result = run_records(processor, prompt(), big)
    assert result.dead_letters == []
    (record_size,) = [len(h.origin.value) for h in processor.requests["r"].held.values()]
    assert record_size > 400_000
    assert len(processor.snapshot("r")) < record_size * 1.01 + 2_000


def test_a_held_event_with_a_null_header_value_snapshots_and_restores(registry) -> None:
    # Issue 16 item 3: a Kafka header may have a null value; the snapshot raised TypeError.
    headers = (("trace", b"\x00\xff"), ("empty", None))
    original = held_request(registry, headers=headers, key=b"r", timestamp_ms=1_700_000_000_000)
    restored = RequestProcessor(registry)
    restored.restore("r", original.snapshot("r"))
    (held,) = restored.state("r").held.values()
    assert held.origin.headers == headers and held.origin.key == b"r"
    assert held.origin.timestamp_ms == 1_700_000_000_000
    assert restored.snapshot("r") == original.snapshot("r")


def _snapshot_of(processor: RequestProcessor, request_id: str = "r") -> dict:
    return json.loads(processor.snapshot(request_id))


def _corruptions(registry: TokenizerRegistry) -> list[bytes]:
    active = _snapshot_of(held_request(registry))
    missing_field = json.loads(json.dumps(active))
    del missing_field["state"]["next_seq"]  # has a default: still valid
    del missing_field["state"]["model"]
    wrong_type = json.loads(json.dumps(active))
    wrong_type["state"]["generated_tokens"] = "2"
    unknown_model = json.loads(json.dumps(active))
    unknown_model["state"]["model"] = "removed"
    future = dict(active, version=SNAPSHOT_VERSION + 1)
    bad_stream = json.loads(json.dumps(active))
    bad_stream["state"]["stream"] = {"version": 999}
    bad_held = json.loads(json.dumps(active))
    bad_held["state"]["held"][0]["value"] = "not json"
    other_request = json.loads(json.dumps(active))
    other_request["state"]["held"][0]["value"] = (
        '{"type":"tokens","request_id":"x","seq":3,"token_ids":[]}'
    )
    return [
        b"",
        b"\xff\xfe garbage",
        b"[1, 2]",
        b'{"version": 1}',
        json.dumps(active["state"]).encode(),  # the format before versions: a bare state
        *(
            json.dumps(value).encode()
            for value in (missing_field, wrong_type, unknown_model, future, bad_stream, bad_held)
        ),
        json.dumps(other_request).encode(),
    ]


def test_every_unrestorable_value_raises_snapshot_error_and_mark_failed_takes_over(
    registry,
) -> None:
    # Issue 16 item 4: a garbage record, a missing field or a removed model crashed the restore.
    processor = RequestProcessor(registry)
    for value in _corruptions(registry):
        with pytest.raises(SnapshotError):
            processor.restore("r", value)
        assert "r" not in processor.requests  # nothing half-restored
    processor.mark_failed("r", DeadLetterReason.RESTORE_FAILED, now=100.0)
    later = run(processor, tokens(2, "x"), prompt())
    assert reasons(later) == ["request_already_failed"]
    assert later.duplicates == 1  # not failed at open: the prompt does not reopen it
    assert processor.requests["r"] == FailedRequest(
        model=None, reason=DeadLetterReason.RESTORE_FAILED, last_event_at=100.0
    )


@given(
    st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
            lambda children: (
                st.lists(children, max_size=4)
                | st.dictionaries(
                    st.sampled_from(["version", "state", "kind", "model", "held", "stream", "x"]),
                    children,
                    max_size=5,
                )
            ),
            max_leaves=20,
        ).map(msgspec.json.encode),
    )
)
def test_restore_raises_only_snapshot_error_on_generated_values(value: bytes) -> None:
    processor = RequestProcessor(TokenizerRegistry())
    try:
        processor.restore("r", value)
    except SnapshotError:
        return


def test_the_text_is_kept_in_parts_and_joined_once(registry) -> None:
    # Issue 16 item 13: `state.text += text` copied the whole text at every delta.
    processor = RequestProcessor(registry)
    run(processor, prompt(), tokens(1, "ab"))
    for seq in range(2, 6):
        run(processor, tokens(seq, "é"))
    state = processor.requests["r"]
    assert isinstance(state, ActiveRequest)
    assert state.text_parts == ["ab", "é", "é", "é", "é"]
    assert (state.text_chars, state.text_size) == (6, 10)
    assert state.text() == "abéééé" and state.text_parts == ["abéééé"]
    assert len(ids(state.text())) == state.text_size


@given(st.text(max_size=30), st.integers(0, 60))
def test_json_prefix_is_the_longest_prefix_within_the_size(text: str, size: int) -> None:
    prefix = json_prefix(text, size)
    assert text.startswith(prefix)
    assert json_size(prefix) <= size
    assert prefix == text or json_size(text[: len(prefix) + 1]) > size
    assert json_size(text) == len(msgspec.json.encode(text)) - 2


def test_a_future_version_is_refused_by_its_version(registry) -> None:
    value = _snapshot_of(held_request(registry))
    value["version"] = SNAPSHOT_VERSION + 1
    value["state"] = {"kind": "something new"}
    with pytest.raises(SnapshotError, match=f"version {SNAPSHOT_VERSION + 1}"):
        RequestProcessor(registry).restore("r", json.dumps(value).encode())
