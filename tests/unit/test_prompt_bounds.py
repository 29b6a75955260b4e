"""Bounded prompt work (issue 15 item 2): however long the prompt and however it ends, seeding
reads only its last `PROMPT_CONTEXT_IDS` ids, so the decode window, the request's state and its
changelog snapshot stay small on every strategy, the generic one (which keeps a fallback-seeded
prompt until its first emission) included, and the text is the per-token oracle's."""

from __future__ import annotations

import json

import pytest

from pipeline.decode_stream import PROMPT_CONTEXT_IDS, DecodeStream
from pipeline.processor import RequestProcessor
from pipeline.request_state import ActiveRequest, encode_snapshot
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.unit.decode_oracle import OracleStream
from tests.unit.request_events import bytes_registry, prompt, run, tokens
from tests.unit.small_tokenizers import UNKNOWN_ID
from tests.unit.test_decode_stream import VARIANTS, text_ids, tokenizer


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
@pytest.mark.parametrize("ending", ["unknown", "clean"])
def test_a_200k_id_prompt_leaves_at_most_64_ids_of_state(name: str, ffi: bool, ending: str) -> None:
    tok = tokenizer(name, ffi)
    words = text_ids(tok, "hello world")
    # Ending in unknown ids, no 4..6-id suffix keeps 4 known ids: the full-prompt fallback.
    tail = [UNKNOWN_ID] * 5 if ending == "unknown" else []
    long_prompt = (words * 100_000)[:200_000] + tail
    stream = DecodeStream(tok, long_prompt)
    assert len(stream.ids) <= PROMPT_CONTEXT_IDS
    assert len(json.dumps(stream.snapshot())) < 2_000
    generated = text_ids(tok, " hello world")
    ref = OracleStream(tok, long_prompt, True)
    expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
    assert stream.push(generated) + stream.flush() == expected
    assert stream.filtered_prompt_ids == tail


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def test_a_500k_id_prompt_is_a_small_request_state(registry: TokenizerRegistry) -> None:
    processor = RequestProcessor(registry)
    huge = prompt(text=" the sky is blue" * 40_000)
    assert len(huge.prompt_token_ids) >= 500_000
    run(processor, huge, tokens(1, " ok"))
    state = processor.requests["r"]
    assert isinstance(state, ActiveRequest)
    assert state.prompt_tokens == len(huge.prompt_token_ids)
    assert len(encode_snapshot(state)) < 2_000
