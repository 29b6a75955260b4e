"""Stop strings and logprobs through the processor on real tokenizers (docs/decode-options.md).

For random texts, stop lists and chunkings (events per chunk, events per batch, snapshot and
restore between batches), the completion is the rule computed from the per-token oracle's text
T (tests/unit/decode_oracle.py): the stop at the smallest end position, the longest string
there, the text cut at its start (or end), the ids up to the one whose text completed it; the
deltas concatenate to the completion; events after the stop produce nothing and are counted.
Logprob `text` entries concatenate to the completion text, and on byte-level and byte-fallback
tokenizers the sampled tokens' `bytes` concatenate to the UTF-8 of T.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processor import RequestProcessor
from pipeline.results import BatchResult, EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import (
    ParsedEvent,
    ParsedFinish,
    ParsedPrompt,
    ParsedTokens,
    encode_event,
)
from tests.conftest import real_tokenizer_path
from tests.unit.decode_oracle import OracleStream

pytestmark = pytest.mark.conformance
TOKENIZERS = ("gpt2", "llama-spm", "qwen2-from-tiktoken")
# Pieces that make stop strings span tokens, repeat, and begin inside multi-byte characters.
PIECES = [
    " hello",
    " world",
    "\n\n",
    "\n",
    "END",
    "###",
    "ab",
    "a",
    "b",
    ".",
    "你好",
    "é",
    "🎉",
    " 🏳️‍🌈",
]
PROMPTS = ["Question: say hello", "User: 你好\n\nAssistant:", "END### prompt only"]


@cache
def registry(name: str) -> TokenizerRegistry:
    registry = TokenizerRegistry()
    registry.register("m", real_tokenizer_path(name))
    return registry


def expected_stop(text: str, stops: list[str]) -> tuple[str, int, int] | None:
    """The rule, by brute force: (string, start, end) at the smallest end, longest there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return stop, end - len(stop), end
    return None


def stop_lists(text: str, prompt: str) -> st.SearchStrategy[list[str]]:
    """Substrings of T (spanning tokens, overlapping, prefixes of each other), strings only the
    prompt holds, and fixed pieces."""
    pools = [st.sampled_from(PIECES).map(str.strip).filter(bool)]
    if text:
        pools.append(
            st.tuples(st.integers(0, len(text) - 1), st.integers(1, 8)).map(
                lambda span: text[span[0] : span[0] + span[1]]
            )
        )
    pools.append(st.just(prompt[-5:]))
    strings = st.one_of(*pools).filter(bool)
    prefixes = strings.flatmap(lambda s: st.integers(1, len(s)).map(lambda n: [s, s[:n]]))
    return st.lists(st.one_of(strings.map(lambda s: [s]), prefixes), min_size=1, max_size=3).map(
        lambda groups: list(dict.fromkeys(s for group in groups for s in group))[:64]
    )


@st.composite
def cases(draw: Any, name: str) -> dict[str, Any]:
    tok = registry(name).get("m").tokenizer
    prompt_text = draw(st.sampled_from(PROMPTS))
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=10)))
    prompt = tok.encode(prompt_text, add_special_tokens=False).ids
    generated = tok.encode(text, add_special_tokens=False).ids
    oracle = OracleStream(tok, prompt, True)
    texts = [oracle.push_token(t) for t in generated]
    flush = oracle.flush()
    full = "".join(texts) + flush
    with_stop = draw(st.integers(0, 3)) > 0 or not full
    return {
        "prompt": prompt,
        "prompt_text": prompt_text,
        "generated": generated,
        "texts": texts,
        "full": full,
        "stop": draw(stop_lists(full, prompt_text)) if with_stop else None,
        "include": draw(st.booleans()),
        "logprobs": draw(st.booleans()),
        "chunks": draw(st.lists(st.integers(1, 5), min_size=len(generated), max_size=64)),
        "batches": draw(st.lists(st.integers(1, 4), min_size=len(generated) + 2, max_size=70)),
        "restore": draw(st.lists(st.booleans(), min_size=len(generated) + 2, max_size=70)),
    }


def events_of(case: dict[str, Any]) -> list[ParsedEvent]:
    generated = case["generated"]
    events: list[ParsedEvent] = [
        ParsedPrompt(
            request_id="r",
            model="m",
            prompt_token_ids=case["prompt"],
            stop=case["stop"],
            include_stop_str_in_output=case["include"],
        )
    ]
    start = 0
    for size in case["chunks"]:
        if start >= len(generated):
            break
        ids = generated[start : start + size]
        logprobs = [-0.5 - i for i in range(start, start + len(ids))] if case["logprobs"] else None
        tops = [[(i, -3.0), (0, -4.0)] for i in ids] if case["logprobs"] else None
        events.append(
            ParsedTokens(
                request_id="r", seq=len(events), token_ids=ids, logprobs=logprobs, top_logprobs=tops
            )
        )
        start += size
    events.append(ParsedFinish(request_id="r", seq=len(events), finish_reason="length"))
    return events


def drive(name: str, case: dict[str, Any], events: list[ParsedEvent]) -> list[BatchResult]:
    """Feed the events in random batches, restoring from snapshots between some of them."""
    processor = RequestProcessor(registry(name))
    results = []
    position = 0
    for size, restore in zip(case["batches"], case["restore"], strict=False):
        batch = events[position : position + size]
        if not batch:
            break
        origins = [EventOrigin("in", 0, position + i, encode_event(e)) for i, e in enumerate(batch)]
        results.append(processor.process(zip(batch, origins, strict=True)))
        position += size
        if restore:
            snapshot = processor.snapshot("r")
            processor = RequestProcessor(registry(name))
            processor.restore("r", snapshot)
    assert position >= len(events)
    return results


def check_case(name: str, case: dict[str, Any]) -> None:
    events = events_of(case)
    results = drive(name, case, events)
    deltas = [d for r in results for d in r.deltas]
    completions = [c for r in results for c in r.completions]
    assert [d for r in results for d in r.dead_letters] == []
    (completion,) = completions
    assert completion.status == "ok"
    full, texts, generated = case["full"], case["texts"], case["generated"]
    found = expected_stop(full, case["stop"]) if case["stop"] else None
    after_stop = sum(r.events_after_stop for r in results)
    if found is None:
        assert completion.text == full
        assert completion.finish_reason == "length" and completion.stop_reason is None
        assert completion.generated_tokens == len(generated)
        assert after_stop == 0
    else:
        stop, start, end = found
        assert completion.text == full[: end if case["include"] else start]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        reached, count = 0, len(generated)
        for index, text in enumerate(texts):
            reached += len(text)
            if reached >= end:
                count = index + 1
                break
        assert completion.generated_tokens == count
        # Every event after the one holding the completing id is consumed without output.
        holding, consumed = len(events) - 1, 0
        for index, event in enumerate(events):
            if isinstance(event, ParsedTokens) and reached >= end:
                consumed += len(event.token_ids)
                if consumed >= count:
                    holding = index
                    break
        assert after_stop == len(events) - 1 - holding
    assert "".join(d.text for d in deltas) == completion.text
    assert deltas[-1].final and sum(d.final for d in deltas) == 1
    offset = 0
    for delta in deltas:
        assert delta.text_offset == offset
        offset += len(delta.text)
    if not case["logprobs"] or not generated:  # no tokens event: nothing says it had logprobs
        assert completion.logprobs is None
        return
    content = completion.logprobs.entries()
    assert [e.id for e in content] == generated[: completion.generated_tokens]
    assert "".join(e.text for e in content) == completion.text
    assert all(
        e.text_offset == sum(len(x.text) for x in content[:i]) for i, e in enumerate(content)
    )
    assert [e.logprob for e in content] == [-0.5 - i for i in range(len(content))]
    assert [[a.id for a in e.top_logprobs] for e in content] == [[e.id, 0] for e in content]
    carried = [entry for d in deltas for entry in d.logprobs or []]
    assert carried == completion.logprobs.content  # the same entries, built once
    if found is None:
        raw = b"".join(bytes(e.bytes) for e in content)
        assert raw == full.encode()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_strings_and_logprobs_follow_the_rule_for_every_chunking(name: str) -> None:
    registry(name)

    @settings(max_examples=60, deadline=None)
    @given(cases(name))
    def check(case: dict[str, Any]) -> None:
        check_case(name, case)

    check()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_stop_string_in_the_prompt_only_never_stops(name: str) -> None:
    tok = registry(name).get("m").tokenizer
    case = {
        "prompt": tok.encode("END### prompt", add_special_tokens=False).ids,
        "generated": tok.encode(" and the answer", add_special_tokens=False).ids,
        "stop": ["###", "prompt"],
        "include": False,
        "logprobs": True,
    }
    oracle = OracleStream(tok, case["prompt"], True)
    case["texts"] = [oracle.push_token(t) for t in case["generated"]]
    case["full"] = "".join(case["texts"]) + oracle.flush()
    case |= {"chunks": [2] * 10, "batches": [1] * 20, "restore": [True] * 20, "prompt_text": ""}
    check_case(name, case)
