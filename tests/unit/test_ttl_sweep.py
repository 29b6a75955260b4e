"""The TTL sweep's filter (issue 15 item 4, the sweep at a million open requests): with `latest`
(no reference is later) the sweep looks only at requests that may be due, and ends exactly the
requests the full walk ends, in the same order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.results import EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.request_events import bytes_registry, finish, prompt, tokens
from workers.runtime.expiry_sweep import (
    EXPIRE_INTERVAL_S,
    EXPIRE_LIMIT,
    SWEEP_SPACING,
    next_sweep_interval,
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def opened(registry: TokenizerRegistry, times: list[tuple[float, bool]]) -> RequestProcessor:
    processor = RequestProcessor(registry, request_ttl_s=100.0, finished_retention_s=30.0)
    for index, (at, finished) in enumerate(times):
        rid = f"r{index}"
        events = [prompt(rid), tokens(1, "hi", rid)] + ([finish(2, rid)] if finished else [])
        origins = [EventOrigin("t", 0, i, b"x", timestamp_ms=int(at * 1000)) for i in range(3)]
        processor.process(list(zip(events, origins, strict=False)), now=1_000.0)
    return processor


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 999), st.booleans()), max_size=30),
    st.floats(0, 1_000),
    st.integers(1, 40),
)
def test_filtered_sweep_ends_what_the_full_walk_ends(registry, times, skew, limit) -> None:
    def reference(request_id: str) -> float:  # per-request references, none past `latest`
        return 1_000.0 - (skew if int(request_id[1:]) % 2 else 0.0)

    full = opened(registry, times)
    filtered = opened(registry, times)
    a = full.expire(reference, limit=limit)
    b = filtered.expire(reference, limit=limit, latest=1_000.0)
    assert [c.request_id for c in a.completions] == [c.request_id for c in b.completions]
    assert a.touched == b.touched
    assert [(d.request_id, d.reason) for d in a.dead_letters] == [
        (d.request_id, d.reason) for d in b.dead_letters
    ]
    assert full.requests.keys() == filtered.requests.keys()


def test_a_sweep_that_hit_its_limit_is_followed_at_once_by_the_next() -> None:
    """20k requests expiring together on a loaded host: each 5,000-request sweep took over a
    second, and spacing the next one 50 sweep-times later left the last 5,000 unpublished a
    minute on (a CI failure). A sweep with more left due is followed after the base interval; a
    scan that ended fewer is spaced by its cost."""
    assert next_sweep_interval(1.5, ended=EXPIRE_LIMIT) == EXPIRE_INTERVAL_S
    assert next_sweep_interval(1.5, ended=EXPIRE_LIMIT - 1) == 1.5 * SWEEP_SPACING
    assert next_sweep_interval(0.001, ended=0) == EXPIRE_INTERVAL_S
