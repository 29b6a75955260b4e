"""The incremental changelog (issue 15 item 3; `pipeline.request_state`, 'Incremental changelog').

Each commit writes an active request's new text as one segment and a small head; so the text
bytes written are the final text exactly once, the head does not grow with the text, a restore
from the compacted changelog (latest record per key) at any commit rebuilds the exact state, and
the request's end leaves a marker and a tombstone for every segment key. A snapshot of the format
before segments (version 1, the text inline) still restores exactly.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.request_state import ActiveRequest, split_changelog_key
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason
from tests.unit.fake_records import FakeMessage
from tests.unit.request_events import bytes_registry, finish, prompt, run, tokens
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest

WORDS = ["Hello", " world", " 你好", " 👋🏽", " é", "\n", " the", " sky"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def commit(processor: RequestProcessor, log: dict[bytes, bytes | None], written: list) -> None:
    """What the worker's commit writes for "r": its records, into a compacted view and a list."""
    for key, value in processor.changelog_records("r"):
        log[key] = value
        written.append((key, value))


def restore_from(registry: TokenizerRegistry, log: dict[bytes, bytes | None]) -> RequestProcessor:
    latest = {
        key: FakeMessage(value, key, [(PROCESSED_OFFSET_HEADER, b"0")], 0)
        for key, value in log.items()
    }
    processor = RequestProcessor(registry)
    restored = apply_latest(latest, processor, None)
    assert not restored.failed
    return processor


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(WORDS), max_size=6), min_size=1, max_size=25),
    st.data(),
)
def test_segments_carry_the_text_once_and_restore_exactly(registry, chunks, data) -> None:
    processor = RequestProcessor(registry)
    log: dict[bytes, bytes | None] = {}
    written: list[tuple[bytes, bytes | None]] = []
    run(processor, prompt())
    commit(processor, log, written)
    heads = []
    for seq, words in enumerate(chunks, start=1):
        run(processor, tokens(seq, "".join(words)))
        if data.draw(st.booleans()):  # not every batch is followed by a commit
            continue
        commit(processor, log, written)
        heads.append(len(log[b"r"] or b""))
        # A restore from the compacted log continues exactly as the original.
        restored = restore_from(registry, log)
        original, copy = processor.requests["r"], restored.state("r")
        assert isinstance(original, ActiveRequest) and isinstance(copy, ActiveRequest)
        assert copy.text() == original.text()
        assert (copy.text_chars, copy.text_size) == (original.text_chars, original.text_size)
        assert copy.text_segments == original.text_segments
        assert restored.snapshot("r") == processor.snapshot("r")
    commit(processor, log, written)
    text = processor.requests["r"].text()
    segments = [(k, v) for k, v in written if split_changelog_key(k)[1] is not None]
    assert b"".join(v for _, v in segments) == text.encode(), "each text byte written once"
    assert all(size < 1_000 for size in heads), "the head does not carry the text"

    run(processor, finish(len(chunks) + 1))
    ending = processor.changelog_records("r")
    assert sorted(k for k, v in ending if v is None) == sorted(k for k, _ in segments)
    assert json.loads(dict(ending)[b"r"])["state"]["kind"] == "finished"
    assert processor.changelog_records("r") == [(b"r", dict(ending)[b"r"])], "tombstoned once"


def test_a_version_1_snapshot_restores_and_its_text_becomes_segment_0(registry) -> None:
    processor = RequestProcessor(registry)
    run(processor, prompt(), tokens(1, "Hello"), tokens(2, " 你好"))
    value = json.loads(processor.snapshot("r"))
    value["version"] = 1
    del value["state"]["text_segments"]  # what today's (version 1) worker wrote
    restored = RequestProcessor(registry)
    restored.restore("r", json.dumps(value).encode())
    assert restored.state("r").text() == "Hello 你好"
    run(restored, tokens(3, "!"))
    records = dict(restored.changelog_records("r"))
    assert records[b"r\xff0"] == "Hello 你好!".encode()
    assert json.loads(records[b"r"])["state"]["text_segments"] == 1


def test_a_missing_segment_fails_its_request_and_its_segments_get_tombstones(registry) -> None:
    processor = RequestProcessor(registry)
    log: dict[bytes, bytes | None] = {}
    run(processor, prompt(), tokens(1, "Hello"))
    commit(processor, log, [])
    run(processor, tokens(2, " world"))
    commit(processor, log, [])
    del log[b"r\xff0"]
    latest = {k: FakeMessage(v, k, [(PROCESSED_OFFSET_HEADER, b"0")], 0) for k, v in log.items()}
    target = RequestProcessor(registry)
    restored = apply_latest(latest, target, None)
    (letter,) = restored.failed
    assert letter.reason is DeadLetterReason.RESTORE_FAILED and "segment 0" in letter.message
    records = target.changelog_records("r")
    assert (b"r\xff0", None) in records and (b"r\xff1", None) in records
    assert json.loads(dict(records)[b"r"])["state"]["kind"] == "failed"
