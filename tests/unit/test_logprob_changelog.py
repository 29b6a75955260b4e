"""Logprob columns in the incremental changelog (issue 32 items 6 and 1).

A request's logprob entries go to its changelog segments as its text does: each commit writes
the entries gained since the previous one, the head carries none of them. So the changelog bytes
of a logprob request stay within twice its completion plus a constant (they were quadratic: the
head carried every entry so far), and a restore from the compacted log at any commit rebuilds
the same columns, so the request goes on to the completion it would have had without a crash.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.changelog_bytes import measure
from pipeline.processor import RequestProcessor
from pipeline.request_state import ActiveRequest
from pipeline.results import BatchResult
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import dump_json
from schemas.fast_events import ParsedEvent, ParsedPrompt, ParsedTokens
from tests.unit.fake_records import FakeMessage
from tests.unit.request_events import bytes_registry, finish, ids, run
from workers.runtime.changelog import PROCESSED_OFFSET_HEADER, apply_latest

WORDS = ["Hello", " world", " 你好", " 👋🏽", " é", "\n", " the"]
# What a head and a commit's framing may add per commit (a head is a few hundred bytes); the
# runs below make 41 commits.
PER_COMMIT = 1_000


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("top", [5, 20])
def test_changelog_bytes_are_at_most_twice_the_completion(registry, top: int) -> None:
    """2,000 tokens, one per event, a commit every 50 events (500 events/s, 100 ms commits)."""
    corpus = ids("The sky is blue, 你好 👋🏽 and the sea is green. ")
    figures = []
    for count in (2_000, 4_000):
        generated = (corpus * (count // len(corpus) + 1))[:count]
        processor = RequestProcessor(registry)
        figures.append(
            measure(processor, generated, top, commit_every=50, vocab=256, model="bytes")
        )
    for figure in figures:
        assert figure.changelog_bytes <= 2 * figure.completion_bytes + PER_COMMIT * figure.commits
    # Linear: twice the tokens, about twice the bytes (quadratic was four times).
    assert figures[1].changelog_bytes <= 2.2 * figures[0].changelog_bytes


def lp_tokens(seq: int, text: str, top: int) -> ParsedTokens:
    token_ids = ids(text)
    return ParsedTokens(
        request_id="r",
        seq=seq,
        token_ids=token_ids,
        logprobs=[-0.5 - (i % 5) / 7 for i in token_ids],
        top_logprobs=[[((i + k) % 256, -1.0 - k / 3) for k in range(top)] for i in token_ids],
    )


def commit(processor: RequestProcessor, log: dict[bytes, bytes | None]) -> None:
    for key, value in processor.changelog_records("r"):
        log[key] = value


def restored_from(registry: TokenizerRegistry, log: dict[bytes, bytes | None]) -> RequestProcessor:
    """A fresh processor restored from the compacted log (what a worker does after kill -9)."""
    latest = {k: FakeMessage(v, k, [(PROCESSED_OFFSET_HEADER, b"0")], 0) for k, v in log.items()}
    processor = RequestProcessor(registry)
    assert not apply_latest(latest, processor, None).failed
    return processor


def columns(state: ActiveRequest) -> tuple:
    return (
        list(state.lp_ids),
        list(state.lp_values),
        [[tuple(pair) for pair in tops] for tops in state.lp_tops],
        list(state.lp_offsets),
        state.lp_sent,
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(WORDS), max_size=5), min_size=1, max_size=12),
    st.integers(0, 4),
    st.data(),
)
def test_a_restore_at_any_commit_rebuilds_the_same_logprobs(registry, chunks, top, data) -> None:
    """kill -9 equivalence: the crashed worker's successor restores from the compacted log at
    its last commit, gets the events after it again, and publishes what the uninterrupted
    request publishes."""
    events: list[ParsedEvent] = [
        ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"))
    ]
    events += [lp_tokens(seq, "".join(w), top) for seq, w in enumerate(chunks, start=1)]
    events.append(finish(len(chunks) + 1))
    reference = run(RequestProcessor(registry), *events).completions

    processor = RequestProcessor(registry)
    log: dict[bytes, bytes | None] = {}
    committed = 0  # events the last commit covers
    for index, event in enumerate(events[:-1]):
        run(processor, event)
        if data.draw(st.booleans()):
            commit(processor, log)
            committed = index + 1
            head = json.loads(log[b"r"])["state"]
            assert all(not head.get(name) for name in ("lp_ids", "lp_tops")), "columns in segments"
            copy = restored_from(registry, log)
            assert columns(copy.state("r")) == columns(processor.state("r"))
            assert copy.snapshot("r") == processor.snapshot("r")
    successor = restored_from(registry, log) if committed else RequestProcessor(registry)
    later = BatchResult()
    for event in events[committed:]:
        later = run(successor, event)
    assert [dump_json(c) for c in later.completions] == [dump_json(c) for c in reference]


def test_a_version_2_head_with_its_columns_inline_still_restores(registry) -> None:
    """What a worker before version 3 wrote: every column in the head, bare text segments."""
    processor = RequestProcessor(registry)
    prompt = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=ids("Hi"))
    run(processor, prompt, lp_tokens(1, "Hello 你", 2), lp_tokens(2, "好!", 2))
    value = json.loads(processor.snapshot("r"))
    state = value["state"]
    segment, state["text"] = state["text"].encode(), ""
    value["version"], state["text_segments"] = 2, 1
    restored = RequestProcessor(registry)
    restored.restore("r", json.dumps(value).encode(), {0: segment})
    assert columns(restored.state("r")) == columns(processor.state("r"))
    assert restored.snapshot("r") == processor.snapshot("r")
    ended = run(restored, finish(3)).completions
    assert [dump_json(c) for c in ended] == [
        dump_json(c) for c in run(processor, finish(3)).completions
    ]
