"""Properties of the chat parser over random texts built from marker pieces, random chunkings
and snapshot points (docs/chat-outputs.md):

(a) no fragment of a swallowed marker reaches any field: on well-formed outputs no delta holds
    a marker character at all; on any output the result equals vLLM's (reference port), which
    has no swallowed marker in it, except in the documented cases where a stream differs;
(b) each field's deltas concatenate to the result's field, each call's pieces to its call;
(c) the result does not depend on the chunking (equal to the one-shot result);
(d) a snapshot taken at any point, serialized and restored, ends with the same result.
"""

from __future__ import annotations

import json
import os
import re

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.chat import ChatParser, reasoning_format, tool_format
from pipeline.chat.calls import tagged_json_call
from pipeline.chat.formats import MISTRAL_PRE_V11
from tests.unit import chat_vllm_reference as vllm

SETTINGS = settings(max_examples=int(os.environ.get("CHAT_EXAMPLES", "300")), deadline=None)
CONFIGS = [
    ("deepseek_r1", None),
    ("qwen3", None),
    ("deepseek_r1", "hermes"),
    ("qwen3", "hermes"),
    (None, "hermes"),
    (None, "mistral"),
    ("qwen3", "mistral"),
    (None, "mistral_pre_v11"),
    (None, "llama3_json"),
    ("deepseek_r1", "llama3_json"),
]
CALLS = [
    '{"name": "f", "arguments": {"x": 1}}',
    '{"name": "g", "parameters": {"s": "a}{\\"b"}}',
    '{"name": "h", "arguments": "{\\"k\\": [1, 2]}"}',
    '[{"name": "f", "arguments": {"y": null}}]',
    'f{"a": 3.5}',
    "get[ARGS]{}",
]
PIECES = [
    "a", "b c", " ", "\n", "word", "<", ">", "{", "}", '"', "[", "]", "/", "|", ";", "\\",
    "<think>", "</think>", "<thi", "nk>", "</", "<tool_call>", "</tool_call>", "<tool",
    "_call>", "<function=bash>", "<func", "[TOOL_CALLS]", "[TOOL", "_CALLS]", "[ARGS]",
    "<|python_tag|>", "<|py", *CALLS,
]  # fmt: skip


def make(config: tuple[str | None, str | None], request_id: str = "req") -> ChatParser:
    reasoning, tools = config
    fmt = MISTRAL_PRE_V11 if tools == "mistral_pre_v11" else tools and tool_format(tools)
    return ChatParser(
        reasoning and reasoning_format(reasoning), fmt or None, request_id=request_id,
        offers_tools=True,
    )  # fmt: skip


def texts() -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(PIECES), max_size=14).map("".join)


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def collect(parser: ChatParser, chunks: list[str], fields: dict) -> None:
    """Feed `chunks` and append every delta to `fields` (content, reasoning, calls by index)."""
    for chunk in chunks:
        add(parser.feed(chunk), fields)


def add(delta, fields: dict) -> None:
    fields["content"] += delta.content
    fields["reasoning"] += delta.reasoning
    for call in delta.tool_calls:
        entry = fields["calls"].setdefault(call["index"], {"arguments": ""})
        if "id" in call:
            assert "name" not in entry, "a call's first delta came twice"
            entry.update(id=call["id"], name=call["function"]["name"], type=call["type"])
        entry["arguments"] += call["function"]["arguments"]


def empty() -> dict:
    return {"content": "", "reasoning": "", "calls": {}}


def finish(parser: ChatParser, fields: dict):
    delta, result = parser.finish()
    add(delta, fields)
    return result


def check_concatenation(fields: dict, result) -> None:
    assert fields["content"] == (result.content or "")
    assert fields["reasoning"] == (result.reasoning or "")
    streamed = [
        {"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": args}}
        for _, c in sorted(fields["calls"].items())
        for args in [c["arguments"]]
    ]
    assert streamed == result.tool_calls


def one_shot(config, text: str):
    parser = make(config)
    parser.feed(text)
    return parser.finish()[1]


@given(st.sampled_from(CONFIGS), texts(), st.lists(st.integers(0, 400), max_size=12))
@SETTINGS
def test_deltas_concatenate_and_chunking_does_not_matter(config, text, cuts) -> None:
    parser, fields = make(config), empty()
    collect(parser, chunked(text, cuts), fields)
    result = finish(parser, fields)
    check_concatenation(fields, result)
    assert result == one_shot(config, text)


@given(st.sampled_from(CONFIGS), texts(), st.lists(st.integers(0, 400), max_size=30))
@SETTINGS
def test_snapshot_restore_anywhere_gives_the_same_result(config, text, cuts) -> None:
    chunks = chunked(text, cuts)
    expected = one_shot(config, text)
    for at in range(len(chunks) + 1):  # a snapshot after every chunk
        parser, fields = make(config), empty()
        collect(parser, chunks[:at], fields)
        wire = msgspec.json.encode(parser.snapshot())  # plain values only
        reasoning, tools = parser.reasoning, parser.tools
        restored = ChatParser.restore(
            msgspec.json.decode(wire),
            reasoning.fmt if reasoning else None,
            tools.fmt if tools else None,
            request_id="req",
        )
        del parser
        collect(restored, chunks[at:], fields)
        result = finish(restored, fields)
        check_concatenation(fields, result)
        assert result == expected


def stream_differs(config, text: str, result) -> bool:
    """The cases docs/chat-outputs.md lists where a stream cannot give vLLM's result."""
    reasoning, tools = config
    if reasoning:
        first = text.find("<think>")
        if first > 0 and text[:first].strip():
            return True  # vLLM drops the text before the first <think>
        body = text.partition("<think>")[2] or text
        tag = body.find("<tool_call>")
        if reasoning == "qwen3" and 0 <= tag < body.find("</think>"):
            after = body[tag + len("<tool_call>") :].lstrip()
            if re.match(r"<function[\s=]", after):
                return True  # an implicit end the stream took before a later </think>
        content = vllm.REASONING[reasoning](text)[1] or ""
    else:
        content = text
    if tools == "hermes":
        found = re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", content, re.DOTALL)
        valid = [tagged_json_call(a or b) is not None for a, b in found]
        return bool(valid) and valid[0] and not all(valid)
    if tools == "llama3_json":
        lead = content.lstrip()
        starts = lead.startswith("{") or lead.startswith("<|python_tag|>")
        if not starts:
            return bool(vllm.llama3_json(content)[1])  # a call after text
        return skipped_bad_json_after_call(content)
    if tools == "mistral_pre_v11":
        before = content.partition("[TOOL_CALLS]")[0]
        # On a failure vLLM's content drops `before`, which the stream has sent.
        try:
            vllm.mistral_pre_v11(content)
        except Exception:
            return True  # vLLM raises (two markers, items that are not objects)
        return bool(before) and not result.tools_called
    return False


@given(st.sampled_from(CONFIGS), texts())
@SETTINGS
def test_result_is_vllms_except_where_a_stream_differs(config, text) -> None:
    result = one_shot(config, text)
    if stream_differs(config, text, result):
        return
    reasoning, tools = config
    want = vllm.parse(text, reasoning, tools)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in want["tool_calls"]]  # fmt: skip
    got = [c["function"] for c in result.tool_calls]
    assert (result.reasoning, result.content, got, result.tools_called) == (
        want["reasoning"], want["content"], calls, want["called"],
    )  # fmt: skip


def skipped_bad_json_after_call(text: str) -> bool:
    """vLLM's llama3_json, after a call, tries every `{` inside text that is not JSON; the
    stream skips such text to its matching brace (docs/chat-outputs.md)."""
    decoder, end, calls = json.JSONDecoder(), -1, 0
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue
        try:
            obj, size = decoder.raw_decode(text[match.start() :])
        except ValueError:
            return bool(calls)
        end = match.start() + size
        calls += isinstance(obj, dict) and "name" in obj
    return False


WORDS = st.text(alphabet="abc xyz\n", min_size=0, max_size=12)


@st.composite
def well_formed(draw, config) -> str:
    """A reasoning block, content, then calls: every marker in a place the format swallows."""
    reasoning, tools = config
    parts = []
    if reasoning:
        parts += [draw(st.sampled_from(["<think>", ""])), draw(WORDS), "</think>"]
    parts.append(draw(WORDS))
    calls = draw(st.lists(st.sampled_from(['{"x": 1}', '{"s": "a b"}', "{}"]), max_size=3))
    for i, args in enumerate(calls):
        if tools == "hermes":
            parts.append(f'<tool_call>{{"name": "t{i}", "arguments": {args}}}</tool_call>')
        elif tools == "mistral":
            parts.append(f"[TOOL_CALLS]t{i}[ARGS]{args}")
    return "".join(parts)


@given(
    st.sampled_from([c for c in CONFIGS if c[1] in (None, "hermes", "mistral")]).flatmap(
        lambda config: st.tuples(st.just(config), well_formed(config))
    ),
    st.lists(st.integers(0, 400), max_size=12),
)
@SETTINGS
def test_no_marker_character_in_any_delta_of_a_well_formed_output(pair, cuts) -> None:
    config, text = pair
    parser = make(config)
    for chunk in chunked(text, cuts) + [None]:
        delta = parser.finish()[0] if chunk is None else parser.feed(chunk)
        for piece in (delta.content, delta.reasoning):
            assert not set(piece) & set("<>[]|/"), (text, piece)
        for call in delta.tool_calls:
            assert not set(call["function"]["arguments"]) & set("<>[]|"), (text, call)
