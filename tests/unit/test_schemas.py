"""Wire models: validation, dead-letter classification, and the exported JSON Schema files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import validation
from schemas.events import (
    Completion,
    DeadLetterReason,
    FilteredIdsRecord,
    LoggedGeneration,
    Logprobs,
    TokenLogprob,
    TopLogprob,
    dump_json,
)
from schemas.export import SCHEMA_DIR, rendered_schemas
from schemas.fast_events import ParsedFinish, ParsedPrompt, ParsedTokens
from schemas.validation import Rejection, parse_event, parse_model


def test_events_are_discriminated_by_type() -> None:
    prompt = parse_event(b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[1,2]}')
    tokens = parse_event(b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[3]}')
    finish = parse_event(b'{"type":"finish","request_id":"r","seq":2,"finish_reason":"stop"}')
    assert isinstance(prompt, ParsedPrompt) and prompt.seq == 0 and prompt.skip_special_tokens
    assert isinstance(tokens, ParsedTokens) and tokens.token_ids == [3]
    assert isinstance(finish, ParsedFinish) and finish.finish_reason == "stop"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1,', "malformed_json"),
        (b"\xff\xfe not json", "malformed_json"),
        (b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[-1]}', "token_id_out_of_range"),
        (
            b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[4294967296]}',
            "token_id_out_of_range",
        ),
        (
            b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[99999999999]}',
            "token_id_out_of_range",
        ),
        (b'{"type":"tokens","request_id":"r","seq":1,"token_ids":["5"]}', "schema_violation"),
        (b'{"type":"tokens","request_id":"r","seq":0,"token_ids":[5]}', "schema_violation"),
        (
            b'{"type":"prompt","request_id":"r","model":"m","seq":3,"prompt_token_ids":[]}',
            "schema_violation",
        ),
        (b'{"type":"banana","request_id":"r"}', "schema_violation"),
        (b'{"type":"tokens","request_id":"","seq":1,"token_ids":[1]}', "schema_violation"),
        (b"[1, 2, 3]", "schema_violation"),
        (
            b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1,2],"logprobs":[-1.0]}',
            "schema_violation",
        ),
        (
            b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1],"top_logprobs":[[],[]]}',
            "schema_violation",
        ),
        (
            b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1],'
            b'"top_logprobs":[[[4294967296,-0.5]]]}',
            "token_id_out_of_range",
        ),
        (
            b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1],"logprobs":[NaN]}',
            "schema_violation",
        ),
        (
            b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[],"stop":[]}',
            "schema_violation",
        ),
        (
            b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[],"stop":[""]}',
            "schema_violation",
        ),
    ],
)
def test_bad_records_are_rejected_with_a_reason(raw: bytes, reason: str) -> None:
    parsed = parse_event(raw)
    assert isinstance(parsed, Rejection)
    assert parsed.reason == DeadLetterReason(reason)
    assert parsed.message


def test_largest_u32_id_is_accepted() -> None:
    parsed = parse_event(b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[4294967295, 0]}')
    assert isinstance(parsed, ParsedTokens)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    parsed = parse_event(b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1],"ts":1.5}')
    assert isinstance(parsed, ParsedTokens)


def test_exported_json_schemas_are_current() -> None:
    expected = rendered_schemas()
    on_disk = {path.name: path.read_text(encoding="utf-8") for path in SCHEMA_DIR.glob("*.json")}
    assert on_disk == expected, "stale schemas/json: run `python -m schemas.export`"


def test_exported_input_schema_names_every_event_type() -> None:
    schema = json.loads(rendered_schemas()["input-event.schema.json"])
    assert set(schema["discriminator"]["mapping"]) == {"prompt", "tokens", "finish"}


@given(
    text=st.text(),
    error=st.one_of(st.none(), st.text()),
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=5),
    status=st.sampled_from(["ok", "failed"]),
)
def test_dump_json_is_model_dump_json(text: str, error: str | None, ids: list[int], status) -> None:
    completion = Completion(
        request_id="r",
        model="m",
        text=text,
        status=status,
        prompt_tokens=3,
        generated_tokens=len(text),
        filtered_prompt_ids=ids,
        error=error,
    )
    metric = FilteredIdsRecord(
        request_id="r", model="m", filtered_ids=ids, filtered_count=len(ids), prompt_tokens=9
    )
    for model in (completion, metric):
        assert dump_json(model) == model.model_dump_json().encode()


def test_logged_generation_logprobs_align_with_output_ids() -> None:
    line = (
        b'{"request_id":"r","model":"m","prompt_token_ids":[1],"output_token_ids":[2,3],'
        b'"output_logprobs":[-0.5]}'
    )
    parsed = parse_model(LoggedGeneration, line)
    assert isinstance(parsed, Rejection)
    assert parsed.reason is DeadLetterReason.SCHEMA_VIOLATION
    assert "output_logprobs has 1 entries for 2 token ids" in parsed.message


@given(
    logprob=st.floats(-1e15, 0.0),
    token=st.text(max_size=4),
    raw=st.binary(max_size=4),
)
def test_dump_json_writes_nested_logprobs_like_pydantic(logprob: float, token: str, raw) -> None:
    alternative = TopLogprob(id=7, token=token, bytes=list(raw), logprob=logprob)
    entry = TokenLogprob(
        id=3,
        token=token,
        bytes=list(raw),
        text=token,
        text_offset=0,
        logprob=logprob,
        top_logprobs=[alternative],
    )
    completion = Completion(
        request_id="r",
        model="m",
        text=token,
        status="ok",
        finish_reason="stop",
        prompt_tokens=1,
        generated_tokens=1,
        stop_reason="\n",
        logprobs=Logprobs(content=[entry]),
    )
    assert dump_json(completion) == completion.model_dump_json().encode()


def test_a_deeply_nested_field_is_rejected_not_raised() -> None:
    # Issue 16 item 1: 2,000 nested arrays in an otherwise valid event made the decoder raise
    # RecursionError out of `parse_event`, and the worker exit on every restart.
    nested = b"[" * 2000 + b"]" * 2000
    event = b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1],"x":' + nested + b"}"
    generation = (
        b'{"request_id":"r","model":"m","prompt_token_ids":[1],"output_token_ids":[2],"x":'
        + nested
        + b"}"
    )
    for parsed in (parse_event(event), parse_model(LoggedGeneration, generation)):
        assert isinstance(parsed, Rejection)
        assert parsed.reason is DeadLetterReason.MALFORMED_JSON
        assert "recursion limit" in parsed.message


class PanicException(BaseException):
    """What pyo3 raises for a panic in a Rust extension (the real one is not importable)."""


@pytest.mark.parametrize(
    "raised", [RuntimeError("decoder bug"), PanicException("decoder bug"), MemoryError()]
)
def test_any_exception_while_parsing_is_a_rejection(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException
) -> None:
    def broken(raw: bytes) -> None:
        raise raised

    monkeypatch.setattr(validation, "decode_event", broken)
    monkeypatch.setattr(validation.INPUT_EVENT_ADAPTER, "validate_json", broken)
    raw = b'{"type":"tokens","request_id":"r","seq":1,"token_ids":[1]}'
    if isinstance(raised, MemoryError):  # the process's, not the record's
        with pytest.raises(MemoryError):
            parse_event(raw)
        return
    assert parse_event(raw) == Rejection(
        DeadLetterReason.UNEXPECTED_ERROR, type(raised).__name__, "decoder bug"
    )
