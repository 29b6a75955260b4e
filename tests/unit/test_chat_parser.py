"""ChatParser's contract beyond the vLLM cases: the registry, which requests are parsed, the
prompt's reasoning state, deterministic call ids, and restore checks."""

from __future__ import annotations

import pytest

from pipeline.chat import (
    ChatParser,
    UnknownParserError,
    prompt_reasoning_state,
    reasoning_format,
    tool_format,
)
from pipeline.chat.formats import MISTRAL, MISTRAL_PRE_V11

HERMES_CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


def parse(text: str, request_id: str = "r1", **kwargs) -> tuple[list, object]:
    parser = ChatParser(
        kwargs.pop("reasoning", reasoning_format("qwen3")),
        kwargs.pop("tools", tool_format("hermes")),
        request_id=request_id,
        **kwargs,
    )
    deltas = [parser.feed(char) for char in text]
    last, result = parser.finish()
    return [*deltas, last], result


def test_unknown_names_are_refused_naming_the_valid_ones() -> None:
    with pytest.raises(UnknownParserError, match="valid: deepseek_r1, qwen3"):
        reasoning_format("deepseek")
    with pytest.raises(UnknownParserError, match="valid: hermes, llama3_json, mistral"):
        tool_format("pythonic")


def test_mistral_format_follows_the_tokenizer_like_vllm() -> None:
    assert tool_format("mistral") is MISTRAL
    assert tool_format("mistral", vocab={"[TOOL_CALLS]", "[ARGS]"}) is MISTRAL
    assert tool_format("mistral", vocab={"[TOOL_CALLS]"}) is MISTRAL_PRE_V11


def test_calls_are_parsed_only_when_the_request_offers_tools() -> None:
    _, offered = parse("</think>" + HERMES_CALL, offers_tools=True)
    _, plain = parse("</think>" + HERMES_CALL, offers_tools=False)
    assert [c["function"]["name"] for c in offered.tool_calls] == ["f"]
    assert offered.content is None and offered.finish_reason == "tool_calls"
    assert plain.tool_calls == [] and plain.content == HERMES_CALL
    assert plain.finish_reason is None


def test_a_call_inside_reasoning_stays_reasoning() -> None:
    _, result = parse("<think>" + HERMES_CALL + "</think>done", offers_tools=True)
    assert result.reasoning == HERMES_CALL and result.content == "done"
    assert result.tool_calls == [] and not result.tools_called


def test_prompt_state_from_the_prompt_tail() -> None:
    fmt = reasoning_format("deepseek_r1")
    assert prompt_reasoning_state("<|Assistant|><think>\n", fmt) == "open"
    assert prompt_reasoning_state("<think>\n\n</think>\n\n", fmt) == "closed"
    assert prompt_reasoning_state("<|im_start|>assistant\n", fmt) is None


def test_a_prompt_that_closed_reasoning_makes_everything_content() -> None:
    _, result = parse("no thinking</think>here", prompt_state="closed")
    assert result.reasoning is None and result.content == "no thinking</think>here"
    _, opened = parse("thinking</think>here", prompt_state="open")
    assert (opened.reasoning, opened.content) == ("thinking", "here")


def test_call_ids_depend_on_request_and_index_only() -> None:
    text = "</think>" + HERMES_CALL + HERMES_CALL
    _, first = parse(text, offers_tools=True)
    _, again = parse(text, offers_tools=True)
    _, other = parse(text, request_id="r2", offers_tools=True)
    ids = [c["id"] for c in first.tool_calls]
    assert ids == [c["id"] for c in again.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)
    assert set(ids).isdisjoint(c["id"] for c in other.tool_calls)
    _, mistral = parse("[TOOL_CALLS]f{}", reasoning=None, tools=MISTRAL, offers_tools=True)
    (call,) = mistral.tool_calls
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_first_delta_of_a_streamed_call_has_id_type_and_name() -> None:
    deltas, result = parse(
        '[TOOL_CALLS]add[ARGS]{"a": 1}', reasoning=None, tools=MISTRAL, offers_tools=True
    )
    pieces = [call for delta in deltas for call in delta.tool_calls]
    first, rest = pieces[0], pieces[1:]
    assert first["id"] == result.tool_calls[0]["id"] and first["type"] == "function"
    assert first["function"]["name"] == "add"
    assert len(rest) > 1 and all(set(p) == {"index", "function"} for p in rest)
    streamed = "".join(p["function"]["arguments"] for p in pieces)
    assert streamed == '{"a": 1}' == result.tool_calls[0]["function"]["arguments"]


def test_restore_refuses_other_formats_and_versions() -> None:
    parser = ChatParser(reasoning_format("qwen3"), None, request_id="r")
    parser.feed("abc")
    state = parser.snapshot()
    with pytest.raises(ValueError, match="other formats"):
        ChatParser.restore(state, reasoning_format("deepseek_r1"), None, request_id="r")
    with pytest.raises(ValueError, match="version"):
        ChatParser.restore({**state, "v": 0}, reasoning_format("qwen3"), None, request_id="r")


def test_feed_after_finish_is_an_error() -> None:
    parser = ChatParser(None, None, request_id="r")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize(
    "pieces",
    [
        [" \n", "a</think>b"],  # held leading whitespace, then reasoning
        ["ab</th", "ink>c"],  # mid end marker
        ["x<tool_call> ", "\n<func", "tion=f>"],  # mid implicit end (qwen3)
        ["<tool_call> no", " <tool_call><function=f>"],  # only the first <tool_call> counts
        ["<tool_call>\n<function=f>", "x"],  # ended at once: reasoning None, not ""
        ['</think><tool_call>{"name": "f", ', '"arguments": {}}</tool', "_call>"],
    ],
)
def test_restore_between_any_two_pieces(pieces: list[str]) -> None:
    """kill -9 between two feeds: the restored parser ends with the uncut stream's result."""
    fmts = (reasoning_format("qwen3"), tool_format("hermes"))
    _, expected = parse("".join(pieces), offers_tools=True)
    for cut in range(1, len(pieces)):
        parser = ChatParser(*fmts, request_id="r1", offers_tools=True)
        for piece in pieces[:cut]:
            parser.feed(piece)
        restored = ChatParser.restore(parser.snapshot(), *fmts, request_id="r1")
        for piece in pieces[cut:]:
            restored.feed(piece)
        assert restored.finish()[1] == expected
