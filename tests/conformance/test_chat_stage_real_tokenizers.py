"""The chat-output stage on real tokenizers, through `RequestProcessor`: each case's text
encoded by gpt2, llama-spm and qwen2 (markers spelled as text, and on qwen2 as added tokens),
its ids sent in events of 1, 3, 16 ids and all at once. The completion is the parser's result
on the whole decoded text and vLLM's (tests/unit/chat_vllm_reference.py; `mistral` resolves to
its pre-v11 format on these vocabularies, as in vLLM), the deltas placed by their offsets give
it back, and no delta holds a marker character.
"""

from __future__ import annotations

from functools import cache

import pytest
from tokenizers import AddedToken, Tokenizer

from pipeline.decode_stream import DecodeStream
from pipeline.tokenizer_registry import TokenizerRegistry
from tests.conformance.test_chat_real_tokenizers import CASES, HERMES_TEXT, MARKERS, REASONING
from tests.conftest import real_tokenizer_path
from tests.unit import chat_vllm_reference as vllm
from tests.unit.chat_stage_runs import check_against, expected, parsers, stream

pytestmark = pytest.mark.conformance
NAMES = ["gpt2", "llama-spm", "qwen2-from-tiktoken"]
# None of these vocabularies has `[ARGS]`: `mistral` is its pre-v11 format, one JSON list.
MISTRAL_PRE_V11_TEXT = (
    f"{REASONING}</think>Checking.[TOOL_CALLS] "
    '[{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
    '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]'
)
STAGE_CASES = [
    *(case for case in CASES if case[1] != "mistral"),
    ("deepseek_r1", "mistral", MISTRAL_PRE_V11_TEXT, ["get_weather", "get_time"]),
]


@cache
def registry(name: str) -> TokenizerRegistry:
    loaded = TokenizerRegistry()
    loaded.register(name, real_tokenizer_path(name))
    return loaded


@pytest.fixture(scope="module")
def qwen2_with_markers(tmp_path_factory) -> TokenizerRegistry:
    """qwen2 with the markers as (non-special) added tokens, as Qwen2.5/Qwen3's tokenizers."""
    tok = Tokenizer.from_file(str(real_tokenizer_path("qwen2-from-tiktoken")))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    path = tmp_path_factory.mktemp("qwen2-markers") / "tokenizer.json"
    tok.save(str(path))
    loaded = TokenizerRegistry()
    loaded.register("qwen2-from-tiktoken", path)
    return loaded


def run_case(loaded: TokenizerRegistry, name: str, case, size: int):
    reasoning, tools, text, names = case
    tok = loaded.get(name).tokenizer
    ids = tok.encode(text, add_special_tokens=False).ids
    chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
    prompt = tok.encode("Hello", add_special_tokens=False).ids
    done = stream(loaded, parsers(name, reasoning, tools), chunks, prompt_ids=prompt, model=name)
    # The text as the request's stream decodes it (after its prompt).
    decoder = DecodeStream(tok, prompt)
    decoded = decoder.push(ids) + decoder.flush()
    result = expected(loaded, reasoning, tools, decoded, model=name)
    check_against(done, result)
    assert [c["function"]["name"] for c in result.tool_calls] == names
    want = vllm.parse(decoded, reasoning, "mistral_pre_v11" if tools == "mistral" else tools)
    assert (result.reasoning, result.content) == (want["reasoning"], want["content"])
    assert [c["function"] for c in result.tool_calls] == [c["function"] for c in want["tool_calls"]]
    for delta in done.deltas:
        for piece in (delta.text, delta.reasoning or ""):
            assert not set(piece) & set("<>[]|"), piece
    return done


@pytest.mark.parametrize("case", STAGE_CASES, ids=lambda c: c[1])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", [1, 3, 16, 100_000])
def test_markers_spelled_as_text(case, name: str, size: int) -> None:
    done = run_case(registry(name), name, case, size)
    assert done.completion.reasoning_tokens is None or case[0] is None  # type: ignore[union-attr]


@pytest.mark.parametrize("size", [1, 3, 16, 100_000])
def test_qwen2_with_markers_as_added_tokens(qwen2_with_markers, size: int) -> None:
    name = "qwen2-from-tiktoken"
    loaded = qwen2_with_markers
    done = run_case(loaded, name, CASES[0], size)
    tok = loaded.get(name).tokenizer
    ids = tok.encode(HERMES_TEXT, add_special_tokens=False).ids
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert ids[0] == start
    assert done.completion.reasoning_tokens == ids.index(end) - 1  # type: ignore[union-attr]
