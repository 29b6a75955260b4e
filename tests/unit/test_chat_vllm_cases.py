"""vLLM's own test cases for the five parsers, as data: text in, reasoning/content/calls out.

Each case names the vLLM file it comes from (tests under tests/reasoning/ and
tests/tool_parsers/ of vllm-project/vllm, or the parser's source where its tests have no such
case). The parser must give the expected result for the whole text and for every chunking;
the reference port (tests/unit/chat_vllm_reference.py) must give it too, which checks the port
against vLLM's tests. A case where a stream cannot give vLLM's non-streaming result carries
vLLM's result in `vllm` (docs/chat-outputs.md, 'Where a stream differs').
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pipeline.chat import ChatParser, reasoning_format, tool_format
from tests.unit import chat_vllm_reference as vllm

R1 = "tests/reasoning/test_deepseekr1_reasoning_parser.py"
Q3 = "tests/reasoning/test_qwen3_reasoning_parser.py"
HERMES = "tests/tool_parsers/test_hermes_tool_parser.py"
LLAMA = "tests/tool_parsers/test_llama3_json_tool_parser.py"
MISTRAL = "vllm/tool_parsers/mistral_tool_parser.py (extract_tool_calls)"
QWEN3_BODY = (
    "<tool_call>\n<function=bash>\n<parameter=command>"
    "\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
)


@dataclass(frozen=True)
class Case:
    id: str
    source: str
    text: str
    reasoning: str | None = None
    content: str | None = None
    calls: tuple[tuple[str, str], ...] = ()
    called: bool = False
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    vllm: dict | None = field(default=None)  # vLLM's result where the stream differs


def r1(id: str, text: str, reasoning: str | None, content: str | None) -> Case:
    return Case(id, R1, text, reasoning, content, reasoning_parser="deepseek_r1")


def q3(id: str, text: str, reasoning: str | None, content: str | None) -> Case:
    return Case(id, Q3, text, reasoning, content, reasoning_parser="qwen3")


def tools(name: str, id: str, source: str, text: str, content, calls=(), **kw) -> Case:
    called = kw.pop("called", bool(calls))
    return Case(id, source, text, None, content, tuple(calls), called, tool_parser=name, **kw)


CASES = [
    r1(
        "simple",
        "This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    r1("complete", "This is a reasoning section</think>", "This is a reasoning section", None),
    r1("no_content", "This is content", "This is content", None),
    r1(
        "multiple_lines",
        "This\nThat</think>This is the rest\nThat",
        "This\nThat",
        "This is the rest\nThat",
    ),
    r1("shortest", "</think>This is the rest", "", "This is the rest"),
    r1(
        "with_think",
        "<think>This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    r1(
        "complete_with_think",
        "<think>This is a reasoning section</think>",
        "This is a reasoning section",
        None,
    ),
    r1("think_no_end", "<think>This is a reasoning section", "This is a reasoning section", None),
    r1("empty", "", "", None),
    r1(
        "new_line",
        "\n<think>This is a reasoning section</think>\nThis is the rest",
        "This is a reasoning section",
        "\nThis is the rest",
    ),
    q3(
        "without_start_token",
        "This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    q3(
        "without_start_token_complete",
        "This is a reasoning section</think>",
        "This is a reasoning section",
        None,
    ),
    q3(
        "with_think",
        "<think>This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    q3("without_think", "This is the rest", "This is the rest", None),
    q3(
        "complete_reasoning",
        "<think>This is a reasoning section</think>",
        "This is a reasoning section",
        None,
    ),
    q3(
        "multiline",
        "<think>This is a reasoning\nsection</think>This is the rest\nThat",
        "This is a reasoning\nsection",
        "This is the rest\nThat",
    ),
    q3("only_open_tag", "<think>This is a reasoning section", "This is a reasoning section", None),
    q3(
        "tool_call_no_think_end",
        "I need to read the file.\n\n" + QWEN3_BODY,
        "I need to read the file.\n\n",
        QWEN3_BODY,
    ),
    q3(
        "tool_call_with_think_no_end",
        "<think>I need to read the file.\n\n" + QWEN3_BODY,
        "I need to read the file.\n\n",
        QWEN3_BODY,
    ),
    q3("start_and_end_in_one_delta_no_content", "<think>reasoning</think>", "reasoning", None),
    q3(
        "bare_tool_call_mention_stays_reasoning",
        "Use <tool_call> tags</think>ok",
        "Use <tool_call> tags",
        "ok",
    ),
    tools("hermes", "no_tool_call", HERMES, "This is not a tool call.", "This is not a tool call."),
    tools(
        "hermes",
        "between_tags",
        HERMES,
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
        None,
        [("final_answer", '{"trigger": true}')],
    ),
    tools(
        "hermes",
        "until_eos",
        HERMES,
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
        None,
        [("final_answer", '{"trigger": true}')],
    ),
    tools(
        "hermes",
        "invalid_json",
        HERMES,
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
    ),
    tools(
        "hermes",
        "serialized_arguments",
        HERMES,
        '<tool_call>\n{"name": "get_db_config", '
        '"arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
        None,
        [("get_db_config", '{"param": "max_connections"}')],
    ),
    tools(
        "hermes",
        "bare_string_arguments",
        HERMES,
        '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>',
        None,
        [("do_thing", '"hello"')],
    ),
    tools(
        "hermes",
        "content_then_tool_call",
        HERMES,
        'Sure, let me check the weather.<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "NYC"}}</tool_call>',
        "Sure, let me check the weather.",
        [("get_weather", '{"city": "NYC"}')],
    ),
    tools(
        "hermes",
        "multiple_tool_calls",
        HERMES,
        '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
        None,
        [("search", '{"q": "cats"}'), ("search", '{"q": "dogs"}')],
    ),
    tools(
        "hermes",
        "text_after_call_dropped",
        "vllm/tool_parsers/hermes_tool_parser.py",
        'a<tool_call>{"name": "f", "arguments": {}}</tool_call>b',
        "a",
        [("f", "{}")],
    ),
    tools(
        "hermes",
        "malformed_after_valid",
        "vllm/tool_parsers/hermes_tool_parser.py",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad</tool_call>',
        "<tool_call>{bad</tool_call>",
        [("f", "{}")],
        vllm={
            "content": '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
            "<tool_call>{bad</tool_call>",
            "calls": [],
            "called": False,
        },
    ),
    tools(
        "llama3_json",
        "with_arguments",
        LLAMA,
        '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
        None,
        [("searchTool", '{"query": "test query", "limit": 10}')],
    ),
    tools(
        "llama3_json",
        "no_json",
        LLAMA,
        "This is just some text without any tool calls",
        "This is just some text without any tool calls",
    ),
    tools(
        "llama3_json",
        "invalid_json",
        LLAMA,
        '{"name": "invalidTool", "parameters": {invalid json}',
        '{"name": "invalidTool", "parameters": {invalid json}',
    ),
    tools(
        "llama3_json",
        "arguments_key",
        LLAMA,
        '{"name": "searchTool", "arguments": {"query": "test"}}',
        None,
        [("searchTool", '{"query": "test"}')],
    ),
    tools(
        "llama3_json",
        "multiple_json",
        LLAMA,
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}',
        None,
        [
            ("searchTool", '{"query": "test1"}'),
            ("getOpenIncidentsTool", "{}"),
            ("searchTool", '{"query": "test2"}'),
        ],
    ),
    tools(
        "llama3_json",
        "escaped_quotes_in_nested_json",
        LLAMA,
        '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
        None,
        [("parserTool", '{"text": "He said \\"Hello {world}\\""}')],
    ),
    tools("llama3_json", "missing_name_key", LLAMA, '{"parameters": {}}', '{"parameters": {}}'),
    tools(
        "llama3_json",
        "missing_parameters_and_arguments",
        LLAMA,
        '{"name": "toolWithoutParams"}',
        '{"name": "toolWithoutParams"}',
    ),
    tools(
        "llama3_json",
        "brace_in_trailing_text",
        LLAMA,
        '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
        None,
        [("searchTool", '{"query": "test"}')],
    ),
    tools(
        "llama3_json",
        "python_tag",
        "vllm/tool_parsers/llama_tool_parser.py",
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
        None,
        [("f", '{"x": 1}')],
    ),
    tools(
        "llama3_json",
        "python_tag_without_json",
        "vllm/tool_parsers/llama_tool_parser.py",
        "<|python_tag|>print(1)",
        "<|python_tag|>print(1)",
    ),
    tools(
        "llama3_json",
        "text_before_call",
        LLAMA,
        'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
        "Would you like to know more?",
        'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
        "Would you like to know more?",
        vllm={"content": None, "calls": [("getOpenIncidentsTool", "{}")], "called": True},
    ),
    tools(
        "mistral",
        "v11_one_call",
        MISTRAL,
        'Let me add.[TOOL_CALLS]add{"a": 3.5, "b": 4}',
        "Let me add.",
        [("add", '{"a": 3.5, "b": 4}')],
    ),
    tools(
        "mistral",
        "v11_args_token_and_two_calls",
        MISTRAL,
        '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{"b":2} ',
        None,
        [("add", '{"a": 1}'), ("mul", '{"b":2} ')],
    ),
    tools(
        "mistral",
        "v11_part_without_arguments_skipped",
        MISTRAL,
        "[TOOL_CALLS]nothing",
        None,
        [],
        called=True,
    ),
    tools("mistral", "no_call", MISTRAL, "Plain answer.", "Plain answer."),
]
REASONING_AND_TOOLS = [
    Case(
        "think_then_hermes_call",
        "serving order: reasoning, then tools on its content",
        '<think>Call f? <tool_call>{"name": "g", "arguments": {}}</tool_call></think>'
        'OK<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}</tool_call>',
        'Call f? <tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "OK",
        (("f", '{"x": [1, 2]}'),),
        True,
        "qwen3",
        "hermes",
    ),
]


def run(case: Case, chunks: list[str]) -> dict:
    parser = ChatParser(
        reasoning_format(case.reasoning_parser) if case.reasoning_parser else None,
        tool_format(case.tool_parser) if case.tool_parser else None,
        request_id="case",
        offers_tools=True,
    )
    for chunk in chunks:
        parser.feed(chunk)
    _, result = parser.finish()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls]
    return {
        "reasoning": result.reasoning,
        "content": result.content,
        "calls": calls,
        "called": result.tools_called,
    }


def expected(case: Case) -> dict:
    return {
        "reasoning": case.reasoning,
        "content": case.content,
        "calls": list(case.calls),
        "called": case.called,
    }


def chunkings(text: str) -> list[list[str]]:
    sizes = [len(text) or 1, 1, 2, 3, 5, 8]
    return [[text[i : i + size] for i in range(0, len(text), size)] for size in sizes]


@pytest.mark.parametrize("case", CASES + REASONING_AND_TOOLS, ids=lambda c: c.id)
def test_vllm_case_for_every_chunking(case: Case) -> None:
    for chunks in chunkings(case.text):
        assert run(case, chunks) == expected(case), chunks


@pytest.mark.parametrize("case", CASES + REASONING_AND_TOOLS, ids=lambda c: c.id)
def test_reference_port_agrees_with_vllm_tests(case: Case) -> None:
    got = vllm.parse(case.text, case.reasoning_parser, case.tool_parser)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]]
    want = expected(case)
    if case.vllm is not None:  # where the stream differs, vLLM's own result
        want.update(case.vllm, calls=list(case.vllm["calls"]))
    assert (got["reasoning"], got["content"], calls, got["called"]) == (
        want["reasoning"],
        want["content"],
        want["calls"],
        want["called"],
    )
