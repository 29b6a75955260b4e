"""The msgspec input events against the pydantic contract they mirror.

`parse_event` trusts msgspec's acceptance; so whatever msgspec accepts, pydantic must accept with
the same values. (What msgspec refuses, pydantic judges: that direction cannot drift.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas.events import (
    INPUT_EVENT_ADAPTER,
    MAX_PROMPT_TOKENS,
    MAX_TOKEN_ID,
    LoggedGeneration,
    encode_json,
)
from schemas.fast_events import (
    ParsedFinish,
    ParsedPrompt,
    ParsedTokens,
    decode_event,
    encode_event,
    event_from_json,
    event_to_json,
)
from schemas.validation import Rejection, parse_event

MISSING = object()

# Values near every bound the models set, and values of the wrong JSON type.
ints = st.one_of(
    st.sampled_from(
        [-1, 0, 1, 2, MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS + 1]
        + [MAX_TOKEN_ID, MAX_TOKEN_ID + 1, 2**63, 2**64, -(2**63) - 1]
    ),
    st.integers(0, 200_000),
    st.integers(),
)
wrong_types = st.sampled_from([None, True, False, 1.0, 0.0, 1.5, "1", [], {}])
bounded_strings = st.builds(
    lambda char, size: char * size,
    st.sampled_from(["a", "é", "\U0001f600", "\x00"]),
    st.sampled_from([0, 1, 255, 256, 257, 511, 512, 513]),
)
strings = st.one_of(st.text(max_size=20), bounded_strings)
id_lists = st.one_of(
    st.lists(ints, max_size=6),
    st.lists(st.one_of(ints, wrong_types), max_size=4),
    wrong_types,
)
# Floats near the bounds JSON and the models set (json.dumps writes inf/nan as Infinity/NaN).
floats = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, -9999.0, 1e308, -1e308, float("inf"), float("nan")]),
    st.integers(-3, 3),
    wrong_types,
)
float_lists = st.one_of(st.lists(floats, max_size=6), wrong_types)
pairs = st.one_of(
    st.tuples(ints, floats).map(list),
    st.lists(st.one_of(ints, floats), max_size=3),
    wrong_types,
)
pair_lists = st.one_of(
    st.lists(st.lists(pairs, max_size=3), max_size=6),
    st.lists(st.lists(st.tuples(st.integers(0, 9), st.floats(-5, 0)), min_size=19, max_size=21)),
    wrong_types,
)
stop_lists = st.one_of(
    st.lists(strings, max_size=4),
    st.lists(st.sampled_from(["a", "\U0001f600" * 1024, "b" * 1025]), max_size=3),
    st.lists(st.just("x"), min_size=63, max_size=65),
    wrong_types,
)


def field(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value; one time in ten of the wrong type, one in twenty absent."""
    return st.integers(0, 19).flatmap(
        lambda roll: wrong_types if roll < 2 else st.just(MISSING) if roll == 2 else values
    )


records = st.builds(
    lambda fields, extra, order: _ordered(fields, extra, order),
    st.fixed_dictionaries(
        {
            "type": field(st.sampled_from(["prompt", "tokens", "finish", "delta", "Prompt"])),
            "request_id": field(strings),
            "model": field(strings),
            "seq": field(ints),
            "prompt_token_ids": field(id_lists),
            "token_ids": field(id_lists),
            "skip_special_tokens": field(st.booleans()),
            "finish_reason": field(st.one_of(st.none(), strings)),
            "stop": field(st.one_of(st.none(), stop_lists)),
            "include_stop_str_in_output": field(st.booleans()),
            "logprobs": field(st.one_of(st.none(), float_lists)),
            "top_logprobs": field(st.one_of(st.none(), pair_lists)),
            "prompt_tokens": field(st.one_of(st.none(), ints, st.integers(0, 8))),
        }
    ),
    st.dictionaries(st.sampled_from(["ts", "extra", "x"]), st.integers(), max_size=2),
    st.randoms(use_true_random=False),
)


valid_ids = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=8)
valid_text = st.text(min_size=1, max_size=12)


def _tokens(request_id: str, seq: int, ids: list[int], with_logprobs: bool, top: int) -> Any:
    """A tokens event, with logprob lists aligned to its ids when asked."""
    if not with_logprobs:
        return ParsedTokens(request_id=request_id, seq=seq, token_ids=ids)
    return ParsedTokens(
        request_id=request_id,
        seq=seq,
        token_ids=ids,
        logprobs=[-0.25 * i for i in range(len(ids))],
        top_logprobs=[[(i, -1.5)] * top for i in ids],
    )


valid_records = st.builds(
    lambda event, extra, order: _ordered(event_to_json(event), extra, order),
    st.one_of(
        st.builds(
            ParsedPrompt,
            request_id=valid_text,
            model=valid_text,
            prompt_token_ids=valid_ids,
            stop=st.one_of(st.none(), st.lists(valid_text, min_size=1, max_size=3)),
            include_stop_str_in_output=st.booleans(),
        ),
        valid_ids.flatmap(
            lambda ids: st.builds(
                ParsedPrompt,
                request_id=valid_text,
                model=valid_text,
                prompt_token_ids=st.just(ids),
                prompt_tokens=st.integers(len(ids), MAX_PROMPT_TOKENS),
            )
        ),
        st.builds(
            _tokens,
            valid_text,
            st.integers(1, 2**40),
            valid_ids,
            st.booleans(),
            st.integers(0, 20),
        ),
        st.builds(
            ParsedFinish,
            request_id=valid_text,
            seq=st.integers(1, 2**40),
            finish_reason=st.one_of(st.none(), st.text(max_size=8)),
        ),
    ),
    st.dictionaries(st.sampled_from(["ts", "extra", "x"]), st.integers(), max_size=2),
    st.randoms(use_true_random=False),
)


def _ordered(fields: dict[str, Any], extra: dict[str, Any], order: Any) -> bytes:
    items = [(k, v) for k, v in fields.items() if v is not MISSING] + list(extra.items())
    order.shuffle(items)
    return json.dumps(dict(items), ensure_ascii=order.random() < 0.5).encode()


def _contract(raw: bytes) -> dict[str, Any] | None:
    try:
        return INPUT_EVENT_ADAPTER.validate_json(raw).model_dump(mode="json")
    except ValidationError:
        return None


@settings(max_examples=1500)
@given(st.one_of(records, valid_records))
def test_msgspec_accepts_only_what_the_contract_accepts(raw: bytes) -> None:
    contract = _contract(raw)
    try:
        fast = _plain(decode_event(raw))
    except Exception:
        fast = None
    if fast is not None:
        assert fast == contract
    parsed = parse_event(raw)
    if contract is None:
        assert isinstance(parsed, Rejection)
    else:
        assert _plain(parsed) == contract


def _plain(event: Any) -> Any:
    """Every field of the event as JSON values, defaults included (the encoder leaves absent
    logprobs out; a top-logprob pair is a tuple in the Struct, a list in JSON)."""
    fields = {name: getattr(event, name) for name in event.__struct_fields__}
    return json.loads(encode_json({"type": event.type, **fields}))


@given(st.binary(max_size=40).map(lambda tail: b'{"type":"tokens","request_id":"r",' + tail))
def test_damaged_bytes_are_judged_alike(raw: bytes) -> None:
    assert isinstance(parse_event(raw), Rejection) == (_contract(raw) is None)


def test_inputs_only_the_contract_accepts_still_parse() -> None:
    repeated = b'{"type":"tokens","type":"finish","request_id":"r","seq":1}'
    float_seq = b'{"type":"prompt","request_id":"r","model":"m","seq":0.0,"prompt_token_ids":[]}'
    assert parse_event(repeated) == ParsedFinish(request_id="r", seq=1)
    assert parse_event(float_seq) == ParsedPrompt(request_id="r", model="m", prompt_token_ids=[])


def test_encoding_is_what_the_contract_writes() -> None:
    events = [
        ParsedPrompt(request_id="r", model="m", prompt_token_ids=[1, 2]),
        ParsedPrompt(
            request_id="r",
            model="m",
            prompt_token_ids=[1],
            stop=["\n\n", "END"],
            include_stop_str_in_output=True,
        ),
        ParsedPrompt(request_id="r", model="m", prompt_token_ids=[1, 2], prompt_tokens=70_000),
        ParsedTokens(request_id="r", seq=1, token_ids=[3]),
        ParsedTokens(
            request_id="r", seq=1, token_ids=[3, 4], logprobs=[-0.5, 0.0], top_logprobs=[[], []]
        ),
        ParsedFinish(request_id="r", seq=2, finish_reason="stop"),
    ]
    for event in events:
        wire = encode_event(event)
        model = INPUT_EVENT_ADAPTER.validate_json(wire)
        # A tokens event leaves out absent logprobs; every other field is written as is.
        omitted = {
            name
            for name in ("logprobs", "top_logprobs")
            if isinstance(event, ParsedTokens) and getattr(model, name) is None
        }
        assert wire == model.model_dump_json(exclude=omitted).encode()
        assert event_from_json(event_to_json(event)) == event


def test_prompt_tokens_below_the_ids_sent_is_refused_by_both() -> None:
    """`prompt_tokens` is the prompt's full length: fewer than the ids sent is a schema
    violation, equal (the whole prompt, counted) or more (a tail) is accepted."""
    prompt = b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[1,2,3],'
    short = parse_event(prompt + b'"prompt_tokens":2}')
    assert isinstance(short, Rejection) and short.reason == "schema_violation"
    assert "prompt_tokens" in short.message
    assert _contract(prompt + b'"prompt_tokens":2}') is None
    for count in (3, 500_000):
        event = parse_event(prompt + b'"prompt_tokens":%d}' % count)
        assert isinstance(event, ParsedPrompt) and event.prompt_tokens == count


def test_prompt_tokens_past_the_sizes_a_model_can_have_is_refused_by_both() -> None:
    """A count at 2**63 passed once and then broke Parquet's int64 column (issue 32 item 9):
    the wire event and the logged generation bound it at MAX_PROMPT_TOKENS."""
    prompt = b'{"type":"prompt","request_id":"r","model":"m","prompt_token_ids":[1],'
    for count in (MAX_PROMPT_TOKENS + 1, 2**63, 2**64 - 1):
        raw = prompt + b'"prompt_tokens":%d}' % count
        refused = parse_event(raw)
        assert isinstance(refused, Rejection) and refused.reason == "schema_violation"
        assert _contract(raw) is None
        generation = (
            b'{"request_id":"r","model":"m","prompt_token_ids":[1],"output_token_ids":[],'
            b'"prompt_tokens":%d}' % count
        )
        with pytest.raises(ValidationError):
            LoggedGeneration.model_validate_json(generation)
    at_bound = parse_event(prompt + b'"prompt_tokens":%d}' % MAX_PROMPT_TOKENS)
    assert isinstance(at_bound, ParsedPrompt) and at_bound.prompt_tokens == MAX_PROMPT_TOKENS
