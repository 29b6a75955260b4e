"""The chat-output stage through `RequestProcessor` (docs/chat-outputs.md), on the byte-level
tokenizer (one id per byte), for any chunking of the generated ids:

- the completion is `ChatParser`'s one-shot result on the whole text (which
  tests/unit/test_chat_vllm_cases.py ties to vLLM's parsers), and the deltas, each field
  placed by its offset, give it back exactly;
- no marker fragment reaches any delta field on well-formed outputs;
- a restore from the changelog between any two chunks gives the same deltas after it and
  the same completion;
- stop strings apply first (the parser gets the text up to the stop), logprob entries stay
  per token on the text as decoded;
- which requests are parsed: tools offered or not, a model without parsers, the prompt's tail.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Completion, TextDelta
from schemas.fast_events import ParsedPrompt
from tests.unit.chat_stage_runs import (
    TOOLS,
    check_against,
    chunked,
    expected,
    parsers,
    placed,
    stream,
)
from tests.unit.request_events import bytes_registry, ids, run, tokens
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_chat_properties import CONFIGS, texts, well_formed

SETTINGS = settings(max_examples=int(os.environ.get("CHAT_EXAMPLES", "150")), deadline=None)
# "mistral" on the byte-level tokenizer (no `[ARGS]` in its vocabulary) is the pre-v11 format.
STAGE_CONFIGS = [c for c in CONFIGS if c[1] != "mistral_pre_v11"]
PROMPT = ids("Hi")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> TokenizerRegistry:
    return bytes_registry(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def marker_registry(tmp_path_factory) -> TokenizerRegistry:
    """The byte-level tokenizer with the reasoning markers as (non-special) added tokens."""
    tok = Tokenizer.from_str(byte_level().to_str())
    tok.add_tokens([AddedToken(m, special=False) for m in ("</think>", "<tool_call>")])
    path = tmp_path_factory.mktemp("markers") / "tokenizer.json"
    tok.save(str(path))
    registry = TokenizerRegistry()
    registry.register("m", path, model_vocab_size=20_000)
    return registry


@given(st.sampled_from(STAGE_CONFIGS), texts(), st.lists(st.integers(0, 400), max_size=10))
@SETTINGS
def test_the_completion_is_the_parsers_and_the_deltas_give_it_back(registry, config, text, cuts):
    reasoning, tools = config
    chunks = chunked(ids(text), cuts)
    done = stream(registry, parsers("bytes", reasoning, tools), chunks, prompt_ids=PROMPT)
    check_against(done, expected(registry, reasoning, tools, text))
    for delta in done.deltas:  # every field present, empty where it gained nothing
        assert delta.reasoning is not None and delta.tool_calls is not None
        TextDelta.model_validate_json(delta.to_wire_json())
    Completion.model_validate_json(done.completion.model_dump_json())  # type: ignore[union-attr]


@given(
    st.sampled_from([c for c in STAGE_CONFIGS if c[1] in (None, "hermes")]).flatmap(
        lambda config: st.tuples(st.just(config), well_formed(config))
    ),
    st.lists(st.integers(0, 400), max_size=12),
)
@SETTINGS
def test_no_marker_character_in_any_delta_of_a_well_formed_output(registry, pair, cuts):
    (reasoning, tools), text = pair
    chunks = chunked(ids(text), cuts)
    done = stream(registry, parsers("bytes", reasoning, tools), chunks, prompt_ids=PROMPT)
    for delta in done.deltas:
        for piece in (delta.text, delta.reasoning or ""):
            assert not set(piece) & set("<>[]|/"), (text, piece)
        for call in delta.tool_calls or []:
            assert not set(call["function"]["arguments"]) & set("<>[]|"), (text, call)


@given(st.sampled_from(STAGE_CONFIGS), texts(), st.lists(st.integers(0, 400), max_size=8))
@settings(max_examples=40, deadline=None)
def test_a_restore_between_any_two_chunks_changes_nothing(registry, config, text, cuts):
    reasoning, tools = config
    config_ = parsers("bytes", reasoning, tools)
    chunks = chunked(ids(text), cuts)
    whole = stream(registry, config_, chunks, prompt_ids=PROMPT)
    for at in range(len(chunks) + 1):
        restored = stream(registry, config_, chunks, prompt_ids=PROMPT, restore_at=at)
        assert restored.completion == whole.completion
        assert [repr(d) for d in restored.deltas] == [repr(d) for d in whole.deltas]


@given(texts(), st.sampled_from(["}", "b c", "</", "_call>"]), st.lists(st.integers(0, 400)))
@settings(max_examples=80, deadline=None)
def test_stop_strings_cut_the_text_before_it_is_parsed(registry, text, stop, cuts):
    chunks = chunked(ids(text), cuts)
    config = parsers("bytes", "qwen3", "hermes")
    done = stream(registry, config, chunks, prompt_ids=PROMPT, stop=[stop])
    at = text.find(stop)
    cut = text if at < 0 else text[:at]
    check_against(done, expected(registry, "qwen3", "hermes", cut), "length" if at < 0 else "stop")
    if at >= 0:
        assert done.completion.stop_reason == stop  # type: ignore[union-attr]


@given(st.sampled_from(STAGE_CONFIGS), texts(), st.lists(st.integers(0, 400), max_size=8))
@settings(max_examples=60, deadline=None)
def test_logprob_entries_stay_per_token_on_the_text_as_decoded(registry, config, text, cuts):
    reasoning, tools = config
    chunks = chunked(ids(text), cuts)
    done = stream(
        registry, parsers("bytes", reasoning, tools), chunks, prompt_ids=PROMPT, logprobs=True
    )
    check_against(done, expected(registry, reasoning, tools, text))
    if not text:
        return  # no ids: no entries
    entries = done.completion.logprobs.entries()  # type: ignore[union-attr]
    assert len(entries) == len(ids(text))
    assert "".join(entry.token for entry in entries) == text


def test_a_request_without_tools_gets_no_tool_parsing(registry):
    text = 'ok.</think><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    config = parsers("bytes", "qwen3", "hermes")
    done = stream(registry, config, [ids(text)], prompt_ids=PROMPT, offers_tools=False)
    completion = done.completion
    assert completion is not None
    assert (completion.reasoning, completion.text) == ("ok.", text.partition("</think>")[2])
    assert completion.tool_calls == [] and completion.finish_reason == "length"
    assert all(delta.tool_calls == [] for delta in done.deltas)


def test_a_model_without_parsers_is_not_parsed(registry):
    text = "a</think>b"
    done = stream(registry, parsers("other", "qwen3", "hermes"), [ids(text)], prompt_ids=PROMPT)
    completion = done.completion
    assert completion is not None and completion.text == text
    assert (completion.reasoning, completion.tool_calls, completion.reasoning_tokens) == (
        None, None, None,
    )  # fmt: skip
    assert all(d.reasoning is None and d.tool_calls is None for d in done.deltas)


@pytest.mark.parametrize(
    ("prompt_text", "reasoning", "content"),
    [
        ("<|im_start|>assistant\n<think>\n", "plan", "answer"),
        ("<think>\nok\n</think>\n\n", None, "plan</think>answer"),
        ("Hi", "plan", "answer"),
    ],
)
def test_the_prompts_tail_says_whether_reasoning_is_open(registry, prompt_text, reasoning, content):
    done = stream(
        registry, parsers("bytes", "deepseek_r1", None), [ids("plan</think>answer")],
        prompt_ids=ids(prompt_text),
    )  # fmt: skip
    completion = done.completion
    assert completion is not None
    assert (completion.reasoning, completion.text) == (reasoning, content)


@pytest.mark.parametrize(
    ("prompt_text", "generated", "count"),
    [
        ("Hi", ["<think>", "ab", "</think>", "c"], 2),
        ("x<think>\n", ["abc", "</think>", "de"], 3),  # open in the prompt: counted from 0
        ("x<think>\n", ["abc"], 3),  # never closed: every id is reasoning
        ("<think></think>", ["ab"], 0),  # closed in the prompt: no reasoning
        ("Hi", ["<think>a", "<think>", "b</think>c</think>"], 3),  # a 2nd start is reasoning
    ],
)
def test_reasoning_tokens_are_the_ids_inside_reasoning(
    marker_registry, prompt_text, generated, count
):
    tok = marker_registry.get("m").tokenizer
    pieces = [tok.encode(piece, add_special_tokens=False).ids for piece in generated]
    for split in (pieces, [sum(pieces, [])], [[i] for i in sum(pieces, [])]):
        done = stream(
            marker_registry, parsers("m", "qwen3", None), split, model="m",
            prompt_ids=tok.encode(prompt_text, add_special_tokens=False).ids,
        )  # fmt: skip
        assert done.completion is not None
        assert done.completion.reasoning_tokens == count


def test_reasoning_tokens_end_at_qwen3s_implicit_end(marker_registry):
    tok = marker_registry.get("m").tokenizer
    text = "ab<tool_call><function=f>x"
    done = stream(
        marker_registry, parsers("m", "qwen3", None), [tok.encode(text).ids], model="m",
        prompt_ids=ids("Hi"),
    )  # fmt: skip
    completion = done.completion
    assert completion is not None and completion.reasoning == "ab"
    assert completion.reasoning_tokens == 2


def test_reasoning_tokens_are_none_when_the_markers_are_not_ids(registry):
    done = stream(registry, parsers("bytes", "qwen3", None), [ids("a</think>b")], prompt_ids=PROMPT)
    assert done.completion is not None and done.completion.reasoning == "a"
    assert done.completion.reasoning_tokens is None


def test_a_failed_request_carries_the_split_its_deltas_carried(registry):
    processor = RequestProcessor(registry, chat_parsers=parsers("bytes", "qwen3", "hermes"))
    prompt = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=PROMPT, tools=TOOLS)
    first = run(processor, prompt, tokens(1, "think</think>answer <too"))
    result = processor.expire(float("inf"))
    (completion,) = result.completions
    assert completion.status == "failed" and completion.finish_reason is None
    assert (completion.reasoning, completion.text) == ("think", "answer ")
    assert placed(first.deltas + result.deltas)["content"] == completion.text


def test_the_snapshot_holds_the_parser_state_not_its_text(registry):
    processor = RequestProcessor(registry, chat_parsers=parsers("bytes", "qwen3", "hermes"))
    prompt = ParsedPrompt(request_id="r", model="bytes", prompt_token_ids=PROMPT, tools=TOOLS)
    run(processor, prompt, tokens(1, "reasoning words</think>content words"))
    records = dict(processor.changelog_records("r"))
    head = records[b"r"]
    assert b"words" not in head and b'"chat"' in head
    assert b"reasoning words</think>content words" in records[b"r\xff0"]
