"""Logprob entries written as JSON directly (`pipeline.logprobs.build_entries`) are the pydantic
models' own JSON: the bytes the encoders wrote when entries were models, and JSON-equal to the
models' `model_dump_json`, for any ids (known, unknown, special, byte-fallback), any text (quotes,
backslashes, control characters, non-ASCII) and any float (non-finite ones are `null`)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pipeline.logprobs import build_entries, logprobs_model, token_info
from pipeline.results import Delta
from pipeline.vocab_tables import profile_for
from schemas.events import Completion, Logprobs, TextDelta, TokenLogprob, TopLogprob, encode_json
from tests.unit.small_tokenizers import UNKNOWN_ID, byte_fallback, byte_level, metaspace

TOKENIZERS = {"byte_level": byte_level, "metaspace": metaspace, "byte_fallback": byte_fallback}
# Every id of the small vocabularies, their added tokens, and unknown ids.
IDS = st.integers(0, 300) | st.integers(UNKNOWN_ID, UNKNOWN_ID + 3)
LOGPROBS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, -9999.0, 1e17])
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=4) | st.sampled_from(
    ['"', "\\", "\x00\x1f\x7f", "\u2028", "€😀", "</script>"]
)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 8))
    return {
        "tokenizer": draw(st.sampled_from(sorted(TOKENIZERS))),
        "ids": draw(st.lists(IDS, min_size=count, max_size=count)),
        "values": draw(st.lists(LOGPROBS, min_size=count, max_size=count)),
        "tops": draw(
            st.lists(st.lists(st.tuples(IDS, LOGPROBS), max_size=5), min_size=count, max_size=count)
        ),
        "texts": draw(st.lists(TEXT, min_size=count, max_size=count)),
        "first": draw(st.integers(0, count - 1)),
        "prefix": draw(TEXT),
    }


def model_of(tokenizer: Tokenizer, token_id: int, text: str, offset: int, logprob: float,
             tops: list[tuple[int, float]]) -> TokenLogprob:  # fmt: skip
    """The entry as the models hold it, built field by field (what the pipeline built before)."""
    profile = profile_for(tokenizer)
    token, raw = token_info(profile, token_id)
    alternatives = []
    for alt_id, alt_logprob in tops:
        alt_token, alt_raw = token_info(profile, alt_id)
        alternatives.append(
            TopLogprob(id=alt_id, token=alt_token, bytes=list(alt_raw), logprob=alt_logprob)
        )
    return TokenLogprob(
        id=token_id,
        token=token,
        bytes=list(raw),
        text=text,
        text_offset=offset,
        logprob=logprob,
        top_logprobs=alternatives,
    )


@given(requests())
def test_entries_are_the_models_json(case: dict[str, Any]) -> None:
    tokenizer = TOKENIZERS[case["tokenizer"]]()
    texts, first = case["texts"], case["first"]
    # The request's text: the prefix, then each token's text; the tail starts at token `first`.
    offsets, offset = [], len(case["prefix"])
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    tail_start = offsets[first]
    tail = "".join(texts[first:])
    count = len(texts)
    entries = build_entries(profile_for(tokenizer), case["ids"], case["values"], case["tops"],
                            offsets, first, count, tail, tail_start, offset)  # fmt: skip

    models = [
        model_of(
            tokenizer, case["ids"][i], texts[i], offsets[i], case["values"][i], case["tops"][i]
        )
        for i in range(first, count)
    ]
    assert len(entries) == len(models)
    for entry, model in zip(entries, models, strict=True):
        # Byte for byte what the encoder wrote of the model itself, and JSON-equal to pydantic's.
        assert bytes(entry) == encode_json(model)
        assert json.loads(bytes(entry)) == json.loads(model.model_dump_json())
    # In the records that carry them: a delta and a completion, pydantic's dumps included.
    delta = Delta("r", "m", 1, 2, 0, tail, True, entries)
    assert json.loads(delta.to_wire_json()) == json.loads(
        TextDelta(
            request_id="r",
            model="m",
            seq_start=1,
            seq_end=2,
            text_offset=0,
            text=tail,
            final=True,
            logprobs=Logprobs(content=models),
        ).model_dump_json()  # fmt: skip
    )
    built = logprobs_model(entries)
    assert json.loads(built.model_dump_json()) == json.loads(
        Logprobs(content=models).model_dump_json()
    )
    completion = Completion(request_id="r", model="m", text=tail, status="ok", prompt_tokens=1,
                            generated_tokens=count, logprobs=built)  # fmt: skip
    assert completion.model_dump()["logprobs"] == json.loads(
        Logprobs(content=models).model_dump_json()
    )
    finite = all(v == v and abs(v) != float("inf") for v in case["values"]) and all(
        v == v and abs(v) != float("inf") for pairs in case["tops"] for _, v in pairs
    )
    if finite:  # a null reads back as None, not as the float the models hold
        assert built.entries() == models
