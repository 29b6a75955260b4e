"""The chat parser behind the real decode path: generated ids decoded token by token (and in
chunks of several tokens) through DecodeStream, the text deltas fed to the parser.

qwen2-from-tiktoken has none of the markers as tokens, so they are spelled as plain text over
several tokens; a second load adds them as (non-special) added tokens, as Qwen2.5/Qwen3's
tokenizers have them. gpt2 and llama-spm spell them as text. For every chunking the result
equals vLLM's non-streaming parsers (tests/unit/chat_vllm_reference.py) on the decoded text,
and no delta holds a marker character.
"""

from __future__ import annotations

from functools import cache

import pytest
from tokenizers import AddedToken, Tokenizer

from pipeline.chat import ChatParser, reasoning_format, tool_format
from pipeline.decode_stream import DecodeStream
from tests.conftest import real_tokenizer_path
from tests.unit import chat_vllm_reference as vllm

pytestmark = pytest.mark.conformance
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
REASONING = "\nThe user wants 你好 weather for Zürich 👋🏽 and Tōkyō; two calls.\n"
HERMES_TEXT = (
    f"<think>{REASONING}</think>\n\nChecking both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "days": [1, 2]}}\n'
    "</tool_call>"
)
MISTRAL_TEXT = (
    f"{REASONING}</think>Checking.[TOOL_CALLS]get_weather"
    '{"city": "Zürich"}[TOOL_CALLS]get_time{"tz": "Asia/Tokyo"}'
)
LLAMA_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
    '{"name": "get_time", "parameters": {"tz": "東京"}}'
)
CASES = [
    ("qwen3", "hermes", HERMES_TEXT, ["get_weather", "get_weather"]),
    ("deepseek_r1", "mistral", MISTRAL_TEXT, ["get_weather", "get_time"]),
    (None, "llama3_json", LLAMA_TEXT, ["get_weather", "get_time"]),
]


@cache
def load(name: str, *, markers_as_tokens: bool = False) -> Tokenizer:
    tok = Tokenizer.from_file(str(real_tokenizer_path(name)))  # its own object and profile
    if markers_as_tokens:
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    return tok


def decoded_deltas(tok: Tokenizer, ids: list[int], size: int, skip: bool) -> list[str]:
    stream = DecodeStream(tok, [], skip_special_tokens=skip)
    deltas = [stream.push(ids[i : i + size]) for i in range(0, len(ids), size)]
    return [*deltas, stream.flush()]


def run(case, tok: Tokenizer, size: int, skip: bool = False) -> None:
    reasoning, tools, text, names = case
    ids = tok.encode(text, add_special_tokens=False).ids
    deltas = decoded_deltas(tok, ids, size, skip)
    decoded = "".join(deltas)
    parser = ChatParser(
        reasoning and reasoning_format(reasoning), tool_format(tools), request_id="real",
        offers_tools=True,
    )  # fmt: skip
    outputs = [parser.feed(delta) for delta in deltas]
    last, result = parser.finish()
    for out in [*outputs, last]:
        for piece in (out.content, out.reasoning):
            assert not set(piece) & set("<>[]|"), piece
    want = vllm.parse(decoded, reasoning, tools)
    got = [c["function"] for c in result.tool_calls]
    assert [c["function"] for c in want["tool_calls"]] == got
    assert [c["name"] for c in got] == names
    assert (result.reasoning, result.content, result.tools_called) == (
        want["reasoning"], want["content"], want["called"],
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[1])
@pytest.mark.parametrize("name", ["gpt2", "llama-spm", "qwen2-from-tiktoken"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_markers_spelled_as_text(case, name: str, size: int) -> None:
    run(case, load(name), size)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_qwen2_with_markers_as_added_tokens(size: int, skip: bool) -> None:
    tok = load("qwen2-from-tiktoken", markers_as_tokens=True)
    ids = tok.encode(HERMES_TEXT, add_special_tokens=False).ids
    assert tok.token_to_id("<tool_call>") in ids  # one token each, as in Qwen3's tokenizer
    run(CASES[0], tok, size, skip)
