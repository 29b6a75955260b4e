"""Running chat-parsed requests through `RequestProcessor` (test helpers): a text's byte ids in
chosen chunks, optionally restored from the changelog between two chunks, and what a reader
makes of the deltas (each field placed by its offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.chat import ChatParser, ChatParsers, reasoning_format, tool_format
from pipeline.processor import RequestProcessor
from pipeline.results import Delta
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import Completion
from schemas.fast_events import (
    ParsedFinish,
    ParsedFunction,
    ParsedPrompt,
    ParsedTokens,
    ParsedTool,
)
from tests.unit.request_events import run

TOOLS = [ParsedTool(function=ParsedFunction(name="get_weather"))]


def parsers(model: str, reasoning: str | None, tools: str | None) -> ChatParsers:
    return ChatParsers(
        {model: reasoning} if reasoning else {}, {model: tools} if tools else {}
    )  # fmt: skip


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:], strict=False)]


@dataclass
class Run:
    """What a request published: its deltas and its completion."""

    deltas: list[Delta] = field(default_factory=list)
    completion: Completion | None = None


def stream(
    registry: TokenizerRegistry,
    config: ChatParsers,
    chunks: list[list[int]],
    *,
    prompt_ids: list[int],
    offers_tools: bool = True,
    stop: list[str] | None = None,
    logprobs: bool = False,
    restore_at: int | None = None,
    model: str = "bytes",
) -> Run:
    """One request: its prompt, one tokens event per chunk, its finish. With `restore_at`, the
    processor is replaced after that many chunks by one restored from the changelog records
    written so far (as a compacted topic holds them)."""
    processor = RequestProcessor(registry, chat_parsers=config)
    changelog: dict[bytes, bytes | None] = {}
    out = Run()
    event = ParsedPrompt(
        request_id="r",
        model=model,
        prompt_token_ids=prompt_ids,
        tools=TOOLS if offers_tools else None,
        stop=stop,
    )
    events: list[Any] = [event]
    for seq, chunk in enumerate(chunks, start=1):
        lp = [-0.5] * len(chunk) if logprobs else None
        events.append(ParsedTokens(request_id="r", seq=seq, token_ids=chunk, logprobs=lp))
    events.append(ParsedFinish(request_id="r", seq=len(chunks) + 1, finish_reason="length"))
    for index, item in enumerate(events):
        if restore_at is not None and index == restore_at + 1:
            processor = _restored(registry, config, changelog)
        result = run(processor, item)
        out.deltas += result.deltas
        for completion in result.completions:
            assert out.completion is None, "one completion per request"
            out.completion = completion
        for key, value in processor.changelog_records("r"):
            changelog[key] = value
    return out


def _restored(
    registry: TokenizerRegistry, config: ChatParsers, changelog: dict[bytes, bytes | None]
) -> RequestProcessor:
    processor = RequestProcessor(registry, chat_parsers=config)
    segments = {
        int(key.partition(b"\xff")[2]): value
        for key, value in changelog.items()
        if b"\xff" in key and value is not None
    }
    processor.restore("r", changelog.get(b"r"), segments)
    return processor


def placed(deltas: list[Delta]) -> dict[str, Any]:
    """Each field rebuilt by offset, as an at-least-once reader does (a replayed piece adds
    nothing twice): content, reasoning, and each call's id, name and arguments."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        assert delta.text_offset <= len(content)
        content = content[: delta.text_offset] + delta.text
        if delta.reasoning is not None:
            assert delta.reasoning_offset is not None
            assert delta.reasoning_offset <= len(reasoning)
            reasoning = reasoning[: delta.reasoning_offset] + delta.reasoning
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call["index"], {"arguments": ""})
            if "id" in call:
                entry.update(id=call["id"], name=call["function"]["name"])
            start = call["arguments_offset"]
            assert start <= len(entry["arguments"])
            entry["arguments"] = entry["arguments"][:start] + call["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": calls}


def expected(
    registry: TokenizerRegistry,
    reasoning: str | None,
    tools: str | None,
    text: str,
    *,
    model: str = "bytes",
    offers_tools: bool = True,
    prompt_state: Any = None,
):
    """The parser's one-shot result on the whole text, with the formats the stage resolves."""
    vocab = registry.get(model).tokenizer.get_vocab()
    parser = ChatParser(
        reasoning_format(reasoning) if reasoning else None,
        tool_format(tools, vocab) if tools else None,
        request_id="r",
        offers_tools=offers_tools,
        prompt_state=prompt_state,
    )
    parser.feed(text)
    return parser.finish()[1]


def check_against(run_: Run, result, finish_reason: str = "length") -> None:
    """The completion is the parser's result, and the deltas placed give it back."""
    completion = run_.completion
    assert completion is not None and completion.status == "ok"
    assert completion.text == (result.content or "")
    assert completion.reasoning == result.reasoning
    calls = [call.model_dump() for call in completion.tool_calls or []]
    assert calls == result.tool_calls
    want = "tool_calls" if result.tool_calls else finish_reason
    assert completion.finish_reason == want
    got = placed(run_.deltas)
    assert got["content"] == completion.text
    assert got["reasoning"] == (completion.reasoning or "")
    streamed = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": args}}
        for _, c in sorted(got["calls"].items())
        for args in [c["arguments"]]
    ]
    assert streamed == calls
