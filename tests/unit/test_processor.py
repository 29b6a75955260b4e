"""The request lifecycle: sequence rules, one decode round per batch, endings and snapshots.

Uses the byte-level test tokenizer (see `tests.unit.request_events`) so every expected text is
plain bytes arithmetic.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.processor import MAX_HELD_EVENTS, Delta, RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import DeadLetterReason, TextDelta
from schemas.fast_events import ParsedPrompt
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
from tests.unit.small_tokenizers import UNKNOWN_ID


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def test_a_request_yields_contiguous_deltas_and_one_completion(registry) -> None:
    processor = RequestProcessor(registry)
    first = run(processor, prompt(), tokens(1, " wor"), tokens(2, "ld ✓"))
    second = run(processor, tokens(3, "!"), finish(4))
    deltas = first.deltas + second.deltas
    assert [(d.seq_start, d.seq_end) for d in deltas] == [(1, 2), (3, 4)]
    assert "".join(d.text for d in deltas) == " world ✓!"
    assert deltas[-1].final and not deltas[0].final
    (completion,) = second.completions
    assert completion.text == " world ✓!" and completion.status == "ok"
    assert completion.prompt_tokens == len(ids("Hello there"))
    assert completion.generated_tokens == len(ids(" world ✓!"))
    assert completion.finish_reason == "stop"
    assert first.decoded_tokens + second.decoded_tokens == completion.generated_tokens


def test_a_character_split_across_events_is_held_then_emitted_whole(registry) -> None:
    processor = RequestProcessor(registry)
    euro = ids("€")
    first = run(processor, prompt(), tokens(1, euro[:2]))
    assert first.deltas == []
    second = run(processor, tokens(2, euro[2:]), finish(3))
    assert [(d.seq_start, d.seq_end, d.text) for d in second.deltas] == [(1, 3, "€")]


def test_batching_does_not_change_the_completion(registry) -> None:
    events = [prompt(), tokens(1, "a€"), tokens(2, "b😀c"), finish(3)]
    together = run(RequestProcessor(registry), *events).completions
    apart = RequestProcessor(registry)
    separate = [c for e in events for c in run(apart, e).completions]
    assert together == separate


def test_zero_generated_tokens_give_an_empty_completion(registry) -> None:
    (completion,) = run(RequestProcessor(registry), prompt(), finish(1)).completions
    assert completion.text == "" and completion.generated_tokens == 0


def test_duplicates_are_counted_not_dead_lettered(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, prompt(), prompt(), tokens(1, "x"), tokens(1, "x"))
    assert result.duplicates == 2 and result.dead_letters == []
    done = run(processor, finish(2), finish(2), tokens(1, "x"))
    assert done.duplicates == 2 and done.dead_letters == []
    assert [c.text for c in done.completions] == ["x"]


def test_out_of_order_events_wait_for_the_gap(registry) -> None:
    processor = RequestProcessor(registry)
    early = run(processor, prompt(), tokens(3, "c"), tokens(2, "b"))
    assert early.deltas == []  # seq 1 has not arrived
    late = run(processor, tokens(1, "a"), finish(4))
    assert [c.text for c in late.completions] == ["abc"]


def test_a_gap_that_outgrows_the_buffer_fails_the_request(registry) -> None:
    processor = RequestProcessor(registry)
    held = [tokens(seq, "x") for seq in range(2, 3 + MAX_HELD_EVENTS)]
    result = run(processor, prompt(), *held)
    assert reasons(result) == ["sequence_gap"] * len(held)
    (completion,) = result.completions
    assert completion.status == "failed"
    assert reasons(run(processor, tokens(1, "a"))) == ["request_already_failed"]


def test_events_without_a_prompt_or_after_finish_are_dead_lettered(registry) -> None:
    processor = RequestProcessor(registry)
    assert reasons(run(processor, tokens(1, "x", request_id="orphan"))) == ["missing_prompt"]
    same_batch = run(processor, prompt(), finish(1), tokens(2, "y"))
    assert reasons(same_batch) == ["event_after_finish"]
    assert reasons(run(processor, tokens(3, "z"))) == ["event_after_finish"]


def test_unknown_model_and_out_of_range_prompt_fail_the_request(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(processor, prompt(model="nope"), tokens(1, "x"))
    assert reasons(result) == ["unknown_model", "request_already_failed"]
    assert "bytes" in result.dead_letters[0].message  # names the models it does know
    bad = ParsedPrompt(request_id="big", model="bytes", prompt_token_ids=[72, 20_000])
    assert reasons(run(processor, bad)) == ["token_id_out_of_range"]
    assert result.completions == []


def test_strict_decode_failure_keeps_the_text_before_it(registry) -> None:
    processor = RequestProcessor(registry)
    result = run(
        processor,
        prompt(),
        tokens(1, "ok "),
        tokens(2, [*ids("so far"), UNKNOWN_ID, 65]),
        tokens(3, "z"),
        finish(4),
    )
    assert reasons(result) == [
        "strict_decode_failure",
        "request_already_failed",
        "request_already_failed",
    ]
    strict = result.dead_letters[0]
    assert (strict.seq, strict.origin.value) == (2, b"raw-2")
    assert str(UNKNOWN_ID) in strict.message
    (completion,) = result.completions
    assert (completion.status, completion.text) == ("failed", "ok so far")
    assert completion.generated_tokens == len(ids("ok so far"))
    assert "".join(d.text for d in result.deltas) == "ok so far"
    assert reasons(run(processor, tokens(5, "late"))) == ["request_already_failed"]


def test_skip_policy_decodes_around_unknown_generated_ids(registry) -> None:
    processor = RequestProcessor(registry, unknown_generated_ids="skip")
    result = run(processor, prompt(), tokens(1, [65, UNKNOWN_ID, 66]), finish(2))
    assert result.dead_letters == []
    assert [c.text for c in result.completions] == ["AB"]


def test_unknown_prompt_ids_are_filtered_once_and_reported(registry) -> None:
    # The unknown id sits in the seeding window (the last 4..6 prompt ids), where it is dropped.
    processor = RequestProcessor(registry)
    event = ParsedPrompt(
        request_id="r", model="bytes", prompt_token_ids=[*ids("Hello "), UNKNOWN_ID, *ids("you")]
    )
    first = run(processor, event, tokens(1, "!"))
    (metric,) = first.filtered_ids
    assert (metric.filtered_ids, metric.filtered_count, metric.prompt_tokens) == (
        [UNKNOWN_ID],
        1,
        10,
    )
    second = run(processor, tokens(2, "?"), finish(3))
    assert second.filtered_ids == []
    assert second.completions[0].filtered_prompt_ids == [UNKNOWN_ID]


def test_idle_requests_expire_and_markers_are_forgotten(registry) -> None:
    processor = RequestProcessor(registry, request_ttl_s=10, finished_retention_s=5)
    run(
        processor,
        prompt("idle"),
        tokens(1, "so", request_id="idle"),
        tokens(3, "x", "idle"),
        now=100.0,
    )
    run(processor, prompt("done"), finish(1, "done"), now=100.0)
    assert processor.expire(104.0).dead_letters == []
    expired = processor.expire(110.0)
    assert sorted(reasons(expired)) == ["sequence_gap", "ttl_expired"]
    ttl = next(d for d in expired.dead_letters if d.reason is DeadLetterReason.TTL_EXPIRED)
    assert ttl.origin is None and json.loads(ttl.value)["request_id"] == "idle"
    assert [(c.request_id, c.status, c.text) for c in expired.completions] == [
        ("idle", "failed", "so")
    ]
    assert "done" not in processor.requests and {"idle", "done"} <= expired.touched


def test_snapshot_restore_continues_exactly(registry) -> None:
    original = RequestProcessor(registry)
    run_records(original, prompt(), tokens(1, "ab€"[:2]), tokens(3, "held"))
    run_records(original, tokens(2, ids("€")[:1]))
    snapshot = original.snapshot("r")
    restored = RequestProcessor(registry)
    restored.restore("r", snapshot)
    tail = [tokens(4, ids("€")[1:] + ids("!")), finish(5)]
    assert run(restored, *tail).completions == run(original, *tail).completions
    assert json.loads(original.snapshot("r"))["state"]["kind"] == "finished"
    restored.restore("r", None)
    assert "r" not in restored.requests


@given(text=st.text(), final=st.booleans(), seq=st.integers(0, 2**40), offset=st.integers(0, 2**40))
def test_a_delta_encodes_as_the_text_delta_model(
    text: str, final: bool, seq: int, offset: int
) -> None:
    delta = Delta("r-1", "gpt2", seq, seq + 3, offset, text, final)
    wire = TextDelta.model_validate_json(delta.to_wire_json())
    assert wire == TextDelta(
        request_id="r-1",
        model="gpt2",
        seq_start=seq,
        seq_end=seq + 3,
        text_offset=offset,
        text=text,
        final=final,
    )
    assert delta.to_wire_json() == wire.model_dump_json().encode()
