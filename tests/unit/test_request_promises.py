"""Issue 32's processor findings: every request that opened ends with one completion, and every
record has one fate, under the inputs a hostile producer sends (logprob shapes, held events with
large headers, clocks that lag the wall clock)."""

from __future__ import annotations

import pytest

from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import ParsedPrompt, ParsedTokens
from tests.unit.request_events import bytes_registry, finish, ids, reasons, run


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


def plain_prompt(request_id: str = "r") -> ParsedPrompt:
    return ParsedPrompt(request_id=request_id, model="bytes", prompt_token_ids=ids("Hi"))


def logprob_tokens(seq: int, text: str, request_id: str = "r", top: int = 1) -> ParsedTokens:
    token_ids = ids(text)
    return ParsedTokens(
        request_id=request_id,
        seq=seq,
        token_ids=token_ids,
        logprobs=[-1.0] * len(token_ids),
        top_logprobs=[[(i + k, -2.0 - k) for k in range(top)] for i in token_ids],
    )


def empty_tokens(seq: int, request_id: str = "r") -> ParsedTokens:
    return ParsedTokens(request_id=request_id, seq=seq, token_ids=[])


# -- item 8: an empty tokens event without logprobs ---------------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_an_empty_tokens_event_without_logprobs_is_no_fault(registry, first: bool) -> None:
    """`token_ids: []` carries no ids, so it owes no logprobs, wherever it comes in the chunk."""
    processor = RequestProcessor(registry)
    events = [logprob_tokens(1, "ab"), empty_tokens(2), logprob_tokens(3, "cd")]
    if first:
        events = [empty_tokens(1), logprob_tokens(2, "ab"), logprob_tokens(3, "cd")]
    result = run(processor, plain_prompt(), *events, finish(4))
    assert reasons(result) == []
    (completion,) = result.completions
    assert completion.status == "ok" and completion.text == "abcd"
    assert [e.text for e in completion.logprobs.entries()] == list("abcd")
