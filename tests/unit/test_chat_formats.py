"""Chat outputs in the file formats (issue 30): the `tools` a logged generation offers reach its
prompt event from JSONL and Parquet (a bad one dead-letters its row), and `reasoning`,
`tool_calls` and `reasoning_tokens` reach JSONL, Parquet, `openai-chat` and `openai-batch`;
the OpenAI shapes judged by the `openai` package's own models. A completion without chat fields
writes, in Parquet, the columns it had before them."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import openai.types
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.chat import ChatCompletion

from pipeline.generations import generation_events
from schemas.events import (
    Completion,
    DeadLetterReason,
    FunctionCall,
    LoggedGeneration,
    Logprobs,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from schemas.fast_events import ParsedPrompt
from schemas.validation import Rejection
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_reader_faults import parquet_file, row
from tests.unit.test_run_command import detok_run, generation, read_jsonl
from workers.formats import completion_writer
from workers.formats.base import Destination
from workers.formats.jsonl import completion_line, jsonl_records
from workers.formats.openai import batch_line, chat_completion_object
from workers.formats.parquet import parquet_records, read_completions
from workers.io.replay import replay_events, write_completions

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# The columns a completion file had before chat outputs (and has still without them).
PLAIN_COLUMNS = [
    "request_id", "model", "text", "status", "finish_reason", "prompt_tokens",
    "generated_tokens", "filtered_prompt_ids", "error", "stop_reason", "logprobs",
]  # fmt: skip


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


def prompt_of(generation_: LoggedGeneration) -> ParsedPrompt:
    first = generation_events(generation_)[0]
    assert isinstance(first, ParsedPrompt)
    return first


def tools_of(prompt: ParsedPrompt) -> list[dict] | None:
    """The prompt event's tools as JSON, the fields not given left out."""
    if prompt.tools is None:
        return None
    return [
        {"type": tool.type, "function": {
            key: value for key, value in msgspec.structs.asdict(tool.function).items()
            if value is not None
        }}
        for tool in prompt.tools
    ]  # fmt: skip


# -- inputs ---------------------------------------------------------------------------------------


def test_jsonl_tools_reach_the_prompt_event_and_replay(tmp_path: Path) -> None:
    lines = [
        generation("chat", "Hi", "ok", tools=[WEATHER]).encode(),
        generation("plain", "Hi", "ok").encode(),
        generation("bad", "Hi", "ok", tools=[{"type": "function", "function": {}}]).encode(),
    ]
    chat, plain, bad = list(jsonl_records(lines))
    assert isinstance(chat.parsed, LoggedGeneration) and isinstance(plain.parsed, LoggedGeneration)
    assert tools_of(prompt_of(chat.parsed)) == [WEATHER]
    assert prompt_of(plain.parsed).tools is None
    assert isinstance(bad.parsed, Rejection)
    assert bad.parsed.reason == DeadLetterReason.SCHEMA_VIOLATION
    records = list(replay_events(jsonl_records(lines), chunk_size=16))
    events = [(key.decode(), json.loads(value)) for key, value in records if key is not None]
    prompts = {key: event for key, event in events if event["type"] == "prompt"}
    assert prompts["chat"]["tools"][0]["function"]["name"] == "get_weather"
    assert (
        prompts["chat"]["tools"][0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    )
    assert prompts["plain"]["tools"] is None
    # The rejected line passes through unkeyed, for the worker to dead-letter as it was read.
    assert [value for key, value in records if key is None] == [lines[2]]


def test_a_parquet_tools_string_column_is_read_and_a_bad_one_dead_letters_its_row(
    tmp_path: Path,
) -> None:
    rows = [
        row("chat", "Hi", "ok", tools=json.dumps([WEATHER])),
        row("plain", "Hi", "ok", tools=None),
        row("not-json", "Hi", "ok", tools="[{'type': 'function'"),
        row("not-tools", "Hi", "ok", tools=json.dumps([{"type": "function"}])),
        row("after", "Hi", "ok", tools=json.dumps([WEATHER, WEATHER])),
    ]
    path = parquet_file(tmp_path / "in.parquet", rows, [("tools", pa.string())])
    records = list(parquet_records(path))
    assert [r.position.row for r in records] == [0, 1, 2, 3, 4]
    chat, plain, not_json, not_tools, after = (r.parsed for r in records)
    assert isinstance(chat, LoggedGeneration) and tools_of(prompt_of(chat)) == [WEATHER]
    assert isinstance(plain, LoggedGeneration) and plain.tools is None
    assert isinstance(not_json, Rejection) and not_json.reason == DeadLetterReason.MALFORMED_JSON
    assert "tools is not a JSON list of tools" in not_json.message
    assert json.loads(records[2].original())["request_id"] == "not-json"
    assert isinstance(not_tools, Rejection)
    assert not_tools.reason == DeadLetterReason.SCHEMA_VIOLATION
    assert isinstance(after, LoggedGeneration) and after.tools is not None and len(after.tools) == 2


def test_a_nested_parquet_tools_column_is_read_as_its_values(tmp_path: Path) -> None:
    function = pa.struct([("name", pa.string()), ("description", pa.string())])
    tools = pa.list_(pa.struct([("type", pa.string()), ("function", function)]))
    offered = [{"type": "function", "function": {"name": "now", "description": "the time"}}]
    path = parquet_file(
        tmp_path / "in.parquet",
        [row("chat", "Hi", "ok", tools=offered), row("plain", "Hi", "ok", tools=None)],
        [("tools", tools)],
    )
    chat, plain = (r.parsed for r in parquet_records(path))
    assert isinstance(chat, LoggedGeneration) and tools_of(prompt_of(chat)) == offered
    assert isinstance(plain, LoggedGeneration) and plain.tools is None


def test_detok_run_dead_letters_a_parquet_row_with_bad_tools_and_completes_the_rest(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    rows = [
        row("a", "Hi", "one", tools=json.dumps([WEATHER])),
        row("b", "Hi", "two", tools="{"),
        row("c", "Hi", "three", tools=None),
    ]
    source = parquet_file(tmp_path / "in.parquet", rows, [("tools", pa.string())])
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    flags = ["--tool-parser", "bytes=hermes", "--dead-letter", str(dead)]
    assert detok_run(f"bytes={tokenizer_file}", source, output, *flags) == 0
    assert [(c["request_id"], c["text"]) for c in read_jsonl(output)] == [
        ("a", "one"),
        ("c", "three"),
    ]
    [letter] = read_jsonl(dead)
    assert (letter["reason"], letter["row"]) == ("malformed_json", 1)
    assert json.loads(letter["original"])["tools"] == "{"


# -- outputs --------------------------------------------------------------------------------------


def call(index: int, name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"chatcmpl-tool-{index}", function=FunctionCall(name=name, arguments=arguments)
    )


def completion(request_id: str = "r", text: str = "", **fields: object) -> Completion:
    values: dict = {
        "request_id": request_id, "model": "qwen", "text": text, "status": "ok",
        "finish_reason": "stop", "prompt_tokens": 7, "generated_tokens": 30, **fields,
    }  # fmt: skip
    return Completion(**values)


CHAT = completion(
    "chat",
    "",
    finish_reason="tool_calls",
    reasoning="Need the weather.",
    tool_calls=[call(0, "get_weather", '{"city": "Paris"}'), call(1, "now", "{}")],
    reasoning_tokens=5,
)
PLAIN = completion("plain", "Hello!")


def test_jsonl_carries_the_chat_fields() -> None:
    line = completion_line(CHAT, None)
    assert line is not None
    assert Completion.model_validate_json(line) == CHAT
    fields = json.loads(line)
    assert fields["tool_calls"][1] == {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "now", "arguments": "{}"},
    }
    assert (fields["reasoning"], fields["reasoning_tokens"]) == ("Need the weather.", 5)


def test_parquet_has_typed_chat_columns_only_when_asked(tmp_path: Path) -> None:
    chat_path, plain_path = tmp_path / "chat.parquet", tmp_path / "plain.parquet"
    for path, chat, rows in ((chat_path, True, [CHAT, PLAIN]), (plain_path, False, [PLAIN])):
        writer = completion_writer(Destination(path, "x"), "parquet", created=0, chat=chat)
        for item in rows:
            writer.write(item, None)
        writer.close()
    schema = pq.read_schema(chat_path)
    assert schema.names == [*PLAIN_COLUMNS, "reasoning", "tool_calls", "reasoning_tokens"]
    assert schema.field("reasoning_tokens").type == pa.int64()
    calls = schema.field("tool_calls").type
    assert calls.value_type.field("function").type.field("arguments").type == pa.string()
    assert list(read_completions(chat_path)) == [CHAT, PLAIN]
    assert pq.read_schema(plain_path).names == PLAIN_COLUMNS
    assert list(read_completions(plain_path)) == [PLAIN]


def test_collect_writes_chat_columns_when_a_completion_carries_them(tmp_path: Path) -> None:
    write_completions(tmp_path / "both.parquet", {"chat": CHAT, "plain": PLAIN}, "parquet")
    write_completions(tmp_path / "plain.parquet", {"plain": PLAIN}, "parquet")
    assert "tool_calls" in pq.read_schema(tmp_path / "both.parquet").names
    assert pq.read_schema(tmp_path / "plain.parquet").names == PLAIN_COLUMNS
    assert list(read_completions(tmp_path / "both.parquet")) == [CHAT, PLAIN]


def test_openai_chat_is_a_chat_completion_with_reasoning_and_tool_calls() -> None:
    body = chat_completion_object(CHAT, created=1_700_000_000)
    parsed = ChatCompletion.model_validate(body)
    assert (parsed.id, parsed.object, parsed.model) == ("chatcmpl-chat", "chat.completion", "qwen")
    [choice] = parsed.choices
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.role == "assistant" and message.content is None  # empty, with calls: as vLLM
    assert body["choices"][0]["message"]["reasoning"] == "Need the weather."
    assert message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("chatcmpl-tool-0", "get_weather", '{"city": "Paris"}'),
        ("chatcmpl-tool-1", "now", "{}"),
    ]
    assert parsed.usage is not None and parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 5
    assert (parsed.usage.prompt_tokens, parsed.usage.total_tokens) == (7, 37)


def test_openai_chat_of_a_completion_without_chat_fields_is_its_text() -> None:
    body = chat_completion_object(completion("p", "Hi", finish_reason="abort"), created=0)
    parsed = ChatCompletion.model_validate(body)
    message = parsed.choices[0].message
    assert (message.content, message.tool_calls, parsed.choices[0].finish_reason) == (
        "Hi", [], "stop"
    )  # fmt: skip
    assert body["choices"][0]["message"]["reasoning"] is None
    assert parsed.usage is not None and parsed.usage.completion_tokens_details is None
    empty = chat_completion_object(completion("e", ""), created=0)
    assert empty["choices"][0]["message"]["content"] == ""  # nothing parsed: the text as it is
    only_reasoning = chat_completion_object(completion("t", "", reasoning="Hmm"), created=0)
    assert only_reasoning["choices"][0]["message"]["content"] is None


def test_openai_chat_logprobs_are_the_chat_shape() -> None:
    def top(id_: int, token: str, logprob: float) -> TopLogprob:
        return TopLogprob(id=id_, token=token, bytes=list(token.encode()), logprob=logprob)

    entries = [
        TokenLogprob(id=1, token="<think>", bytes=list(b"<think>"), text="", text_offset=0,
                     logprob=-0.25, top_logprobs=[top(1, "<think>", -0.25), top(2, "Ho", -2.0)]),
        TokenLogprob(id=3, token="!", bytes=[33], text="!", text_offset=0, logprob=-0.5,
                     top_logprobs=[]),
    ]  # fmt: skip
    item = completion("l", "!", reasoning="", logprobs=Logprobs(content=entries))
    parsed = ChatCompletion.model_validate(chat_completion_object(item, created=0))
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(e.token, e.logprob, e.bytes) for e in logprobs.content] == [
        ("<think>", -0.25, list(b"<think>")),
        ("!", -0.5, [33]),
    ]
    assert [(t.token, t.logprob) for t in logprobs.content[0].top_logprobs] == [
        ("<think>", -0.25),
        ("Ho", -2.0),
    ]
    assert (
        "text_offset" not in chat_completion_object(item, 0)["choices"][0]["logprobs"]["content"][0]
    )


def test_openai_batch_bodies_are_chat_completions_for_chat_parsed_requests() -> None:
    chat_line, plain_line = batch_line(CHAT, None, 0), batch_line(PLAIN, None, 0)
    assert chat_line is not None and plain_line is not None
    assert (chat_line["custom_id"], chat_line["response"]["status_code"]) == ("chat", 200)
    body = ChatCompletion.model_validate(chat_line["response"]["body"])
    assert body.choices[0].message.tool_calls is not None
    text = openai.types.Completion.model_validate(plain_line["response"]["body"])
    assert text.object == "text_completion" and text.choices[0].text == "Hello!"


def test_detok_run_writes_openai_chat(tmp_path: Path, tokenizer_file: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        generation("a", "Hi", "Hello!", finish_reason="stop", tools=[WEATHER]) + "\n"
        + generation("b", "Hi", "Bye", finish_reason="length") + "\n"
    )  # fmt: skip
    output = tmp_path / "chat.jsonl"
    assert (
        detok_run(f"bytes={tokenizer_file}", source, output, "--output-format", "openai-chat") == 0
    )
    lines = [ChatCompletion.model_validate(line) for line in read_jsonl(output)]
    assert [(c.id, c.choices[0].message.content, c.choices[0].finish_reason) for c in lines] == [
        ("chatcmpl-a", "Hello!", "stop"),
        ("chatcmpl-b", "Bye", "length"),
    ]
