"""The chat-output stage: reasoning and tool calls split out of a request's text as it streams.

Chosen for every request of a model with a reasoning parser, and for a request that offers
`tools` when its model has a tool parser (`ChatParsers`: docs/chat-outputs.md). It runs after
stop strings, on the text they release (at a stop, the text up to the cut), as vLLM parses
what its detokenizer returns; the request's `pipeline.chat.ChatParser` turns each delta's text
into what each field gained:

- `text` is the content gained, `text_offset` the content characters before it;
- `reasoning` the reasoning gained, `reasoning_offset` the reasoning characters before it;
- `tool_calls` the call pieces in OpenAI's `ChoiceDeltaToolCall` shape, each with
  `arguments_offset`, its call's argument characters before it.

Every delta of such a request carries all three fields, empty ("" or []) where it gained
nothing; a delta that gains nothing in any field (its text all held back as a possible
marker) is not published, unless it is the last. Logprob entries stay per token, their
`text_offset` counting the generated text as decoded (markers included).

The completion's `text` is the content ("" when vLLM's would be None), with `reasoning`,
`tool_calls` (`[]` when none) and `finish_reason` "tool_calls" when a call was parsed (vLLM's
non-streaming rule, whatever the engine's reason was). `reasoning_tokens` counts the generated
ids inside reasoning by the markers' ids (vLLM's `count_reasoning_tokens`), when the markers
are single ids of the tokenizer; else None.

The snapshot field (`request_state.ChatFields`) holds the parser names, the prompt's reasoning
state and the token count; the parser is rebuilt by feeding it the text deltas carried
(`state.text()` less what stop strings hold) once, when the stage is made for a restored
request: its deltas after a restore are those it would have published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.chat import (
    ChatDelta,
    ChatParser,
    ReasoningFormat,
    ToolFormat,
    prompt_reasoning_state,
    reasoning_format,
    tool_format,
)
from pipeline.request_state import ActiveRequest, ChatFields
from pipeline.requests.work import Work
from pipeline.results import Delta, merge_tool_calls
from pipeline.stages.base import Chunk, StageConfig, StageKind, TextStage
from pipeline.tokenizer_registry import ModelTokenizer
from schemas.events import PROMPT_TAIL_IDS
from schemas.fast_events import ParsedPrompt


@dataclass(frozen=True, slots=True)
class Formats:
    """One model's parser formats, resolved once (`mistral` reads the tokenizer's vocabulary),
    and the reasoning markers' ids: (start, end, implicit end or None), or None when the start
    or end marker is not a single id."""

    reasoning: ReasoningFormat | None
    tools: ToolFormat | None
    marker_ids: tuple[int, int, int | None] | None


class Chat(StageKind):
    """Which requests are parsed, and each model's formats (cached per model and names)."""

    __slots__ = ("parsers", "registry", "formats")

    def __init__(self, config: StageConfig) -> None:
        self.parsers = config.chat_parsers
        self.registry = config.registry
        self.formats: dict[tuple[str, str | None, str | None], Formats] = {}

    def opened(self, event: ParsedPrompt, model: ModelTokenizer) -> Mapping[str, Any]:
        parsers = self.parsers
        if not parsers:
            return {}
        reasoning = parsers.reasoning.get(model.name)
        tools = parsers.tools.get(model.name) if event.tools else None
        if reasoning is None and tools is None:
            return {}
        formats = self.formats_of(model.name, reasoning, tools)
        prompt = None
        if formats.reasoning is not None:
            # The prompt's tail as a producer may send it: the markers are near its end.
            tail = event.prompt_token_ids[-PROMPT_TAIL_IDS:]
            text = model.tokenizer.decode(tail, skip_special_tokens=False)
            prompt = prompt_reasoning_state(text, formats.reasoning)
        counted = formats.reasoning is not None and formats.marker_ids is not None
        fields = ChatFields(
            reasoning=reasoning,
            tools=tools,
            prompt=prompt,
            reasoning_tokens=0 if counted else None,
            counting=counted and prompt != "closed",
        )
        return {"chat": fields}

    def choose(self, request_id: str, state: ActiveRequest, entry: Work | None) -> TextStage | None:
        fields = state.chat
        if fields is None:
            return None
        formats = self.formats_of(state.model, fields.reasoning, fields.tools)
        stage = CountingChatStage if fields.counting else ChatStage
        return stage(formats, request_id, state)

    def formats_of(self, model: str, reasoning: str | None, tools: str | None) -> Formats:
        key = (model, reasoning, tools)
        found = self.formats.get(key)
        if found is None:
            tokenizer = self.registry.get(model).tokenizer
            vocab = tokenizer.get_vocab() if tools == "mistral" else None
            fmt = reasoning_format(reasoning) if reasoning is not None else None
            ids = None
            if fmt is not None:
                start, end = tokenizer.token_to_id(fmt.start), tokenizer.token_to_id(fmt.end)
                implicit = tokenizer.token_to_id(fmt.implicit_end) if fmt.implicit_end else None
                if start is not None and end is not None:
                    ids = (start, end, implicit)
            tool_fmt = tool_format(tools, vocab) if tools is not None else None
            found = self.formats[key] = Formats(fmt, tool_fmt, ids)
        return found


class ChatStage(TextStage):
    """One request's parser, and where each of its fields stands in the deltas published."""

    __slots__ = ("fields", "formats", "parser", "content_at", "reasoning_at", "arguments_at")

    def __init__(self, formats: Formats, request_id: str, state: ActiveRequest) -> None:
        fields = state.chat
        assert fields is not None
        self.fields = fields
        self.formats = formats
        self.parser = ChatParser(
            formats.reasoning,
            formats.tools,
            request_id=request_id,
            offers_tools=fields.tools is not None,
            prompt_state=fields.prompt,
        )
        self.content_at = self.reasoning_at = 0
        self.arguments_at: list[int] = []
        published = state.text_chars - len(state.stop_held)
        if published:  # a restored request: its deltas so far, fed once
            content, reasoning, calls = self.parser.feed(state.text()[:published])
            self.content_at, self.reasoning_at = len(content), len(reasoning)
            self._placed(calls)

    def publish(self, state: ActiveRequest, delta: Delta) -> None:
        parser = self.parser
        text = delta.text
        if parser.done:
            split = _NOTHING
        else:
            split = parser.feed(text) if text else _NOTHING
            if delta.final:
                split = _joined(split, parser.finish()[0])
        content, reasoning, calls = split
        delta.text_offset = self.content_at
        delta.reasoning_offset = self.reasoning_at
        self.content_at += len(content)
        self.reasoning_at += len(reasoning)
        delta.text, delta.reasoning = content, reasoning
        delta.tool_calls = self._placed(calls) if calls else []

    def complete(self, state: ActiveRequest, fields: dict[str, Any]) -> None:
        result = self.parser.result()
        fields["text"] = result.content or ""
        fields["reasoning"] = result.reasoning
        fields["tool_calls"] = result.tool_calls
        fields["reasoning_tokens"] = self._reasoning_tokens()
        if fields["status"] == "ok" and result.tool_calls:
            fields["finish_reason"] = "tool_calls"

    def _placed(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The call pieces, each given its `arguments_offset`; the positions move past them."""
        at = self.arguments_at
        for piece in calls:
            index = piece["index"]
            if index == len(at):
                at.append(0)
            piece["arguments_offset"] = at[index]
            at[index] += len(piece["function"].get("arguments") or "")
        return calls

    def _reasoning_tokens(self) -> int | None:
        fields = self.fields
        reasoning = self.parser.reasoning
        if reasoning is not None and reasoning.implicit == "ended":
            return fields.at_implicit  # None when the implicit end's marker is not an id
        return fields.reasoning_tokens


class CountingChatStage(ChatStage):
    """A chat stage that also counts reasoning tokens (its markers are ids of the tokenizer):
    its own class, so the decode calls `decoded` only for requests that count."""

    __slots__ = ()

    def decoded(self, state: ActiveRequest, chunk: Chunk, count: int) -> None:
        """Count the ids inside reasoning: those before the first end marker's id, the first
        start marker's id excepted (the text's split: docs/chat-outputs.md)."""
        fields = self.fields
        if not fields.counting:
            return
        ids = chunk.ids if count == len(chunk.ids) else chunk.ids[:count]
        start, end, implicit = self.formats.marker_ids  # type: ignore[misc]  # counting: set
        counted = fields.reasoning_tokens or 0
        watch_implicit = implicit is not None and fields.at_implicit is None
        if end in ids or start in ids or (watch_implicit and implicit in ids):
            for token in ids:
                if token == end:
                    fields.counting = False
                    break
                if token == start and not fields.started:
                    fields.started = True
                    continue
                if token == implicit and fields.at_implicit is None:
                    fields.at_implicit = counted
                counted += 1
        else:
            counted += len(ids)
        fields.reasoning_tokens = counted


_NOTHING = ChatDelta("", "", [])


def _joined(first: ChatDelta, second: ChatDelta) -> ChatDelta:
    if not first:
        return second
    if not second:
        return first
    calls = merge_tool_calls(first.tool_calls, second.tool_calls)
    return ChatDelta(first.content + second.content, first.reasoning + second.reasoning, calls)
