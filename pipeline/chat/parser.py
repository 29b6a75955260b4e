"""One request's chat-output parser: reasoning first, then tool calls in what is left.

vLLM's serving layer runs the reasoning parser on the generated text and the tool parser on
the content it leaves, so text inside reasoning never becomes a call; this chains the two
stages the same way. `feed` takes text deltas of any size (a character, a token's text, the
whole output) and returns what each field gained; `finish` flushes and gives the result, which
is the same for every chunking and equal to the concatenated deltas. The state is plain values
(`snapshot`, `ChatParser.restore`), so a restored stream ends with the same result and ids.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

from pipeline.chat.calls import call_id
from pipeline.chat.formats import ReasoningFormat, ToolFormat
from pipeline.chat.output import ChatDelta, ChatResult
from pipeline.chat.reasoning import PromptState, ReasoningStage
from pipeline.chat.tools import ToolStage

SNAPSHOT_VERSION = 1


class ChatParser:
    """Streaming split of one request's output into reasoning, content and tool calls."""

    __slots__ = (
        "request_id", "reasoning", "tools", "content_text", "reasoning_text", "done", "_clear",
        "_fast",
    )  # fmt: skip

    def __init__(
        self,
        reasoning: ReasoningFormat | None,
        tools: ToolFormat | None,
        *,
        request_id: str,
        offers_tools: bool = False,
        prompt_state: PromptState = None,
    ) -> None:
        """`offers_tools`: the request lists tools (vLLM parses calls only then).
        `prompt_state`: "open" if the prompt ends in the start marker, "closed" if it ended
        reasoning already (see `prompt_reasoning_state`), None if it has neither."""
        self.request_id = request_id
        self.reasoning = ReasoningStage(reasoning, prompt_state) if reasoning else None
        self.tools = ToolStage(tools, request_id) if tools and offers_tools else None
        self.content_text: list[str] = []
        self.reasoning_text: list[str] = []
        self.done = False
        # The fast path: while no marker can start in a piece and nothing is held, the piece
        # belongs whole to the current region; `_fast` is that region's handler, set after
        # every full step (None: take the full step).
        self._clear = _could_hold_marker(_markers(reasoning) + _markers(tools))
        self._fast = self._fast_handler()

    def feed(self, text: str) -> ChatDelta:
        """What `text` (the next piece of generated text) makes final in each field."""
        fast = self._fast
        if fast is not None and self._clear(text) is None:
            return fast(self, text)
        if self.done:
            raise RuntimeError("feed after finish")
        delta = self._step(text, final=False)
        self._fast = self._fast_handler()
        return delta

    def finish(self) -> tuple[ChatDelta, ChatResult]:
        """The last delta (what was held back) and the stream's result."""
        if self.done:
            raise RuntimeError("finish called twice")
        delta = self._step("", final=True)
        self.done, self._fast = True, None
        return delta, self.result()

    def _step(self, text: str, final: bool) -> ChatDelta:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final)
        if text:
            self.content_text.append(text)
        if reasoning:
            self.reasoning_text.append(reasoning)
        return ChatDelta(text, reasoning, calls)

    def _fast_handler(self) -> Callable[[ChatParser, str], ChatDelta] | None:
        reasoning, tools = self.reasoning, self.tools
        if self.done:
            return None
        if reasoning is not None and reasoning.in_reasoning:
            if reasoning.held or reasoning.lead is not None:
                return None
            return _fast_reasoning
        if tools is None:
            return _fast_content
        if tools.held:
            return None
        return _FAST_TOOL_REGIONS.get(tools.region)

    def result(self) -> ChatResult:
        """The result so far (final after `finish`)."""
        content = "".join(self.content_text)
        reasoning = "".join(self.reasoning_text)
        calls: list[dict[str, Any]] = []
        called = False
        if self.tools is not None:
            style = self.tools.fmt.id_style
            calls = [
                {
                    "id": call_id(self.request_id, index, style),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for index, (name, arguments) in enumerate(self.tools.calls)
            ]
            called = self.tools.called
        return ChatResult(
            content=content or None,
            reasoning=self.reasoning.result(reasoning) if self.reasoning else None,
            tool_calls=calls,
            tools_called=called,
        )

    def snapshot(self) -> dict[str, Any]:
        """The parser's state as plain values (msgpack/JSON-ready)."""
        return {
            "v": SNAPSHOT_VERSION,
            "reasoning_format": self.reasoning.fmt.name if self.reasoning else None,
            "tool_format": self.tools.fmt.body if self.tools else None,
            "reasoning": self.reasoning.snapshot() if self.reasoning else None,
            "tools": self.tools.snapshot() if self.tools else None,
            "content": "".join(self.content_text),
            "reasoning_text": "".join(self.reasoning_text),
            "done": self.done,
        }

    @classmethod
    def restore(
        cls,
        state: dict[str, Any],
        reasoning: ReasoningFormat | None,
        tools: ToolFormat | None,
        *,
        request_id: str,
    ) -> ChatParser:
        """The parser a snapshot was taken of, given the same formats."""
        if state.get("v") != SNAPSHOT_VERSION:
            raise ValueError(f"chat parser snapshot version {state.get('v')!r} is not supported")
        if (reasoning.name if reasoning else None) != state["reasoning_format"] or (
            tools.body if tools and state["tools"] is not None else None
        ) != state["tool_format"]:
            raise ValueError("chat parser snapshot was taken with other formats")
        parser = cls(reasoning, tools, request_id=request_id, offers_tools=bool(state["tools"]))
        if parser.reasoning is not None:
            parser.reasoning.restore(state["reasoning"])
        if parser.tools is not None:
            parser.tools.restore(state["tools"])
        parser.content_text = [state["content"]] if state["content"] else []
        parser.reasoning_text = [state["reasoning_text"]] if state["reasoning_text"] else []
        parser.done = state["done"]
        parser._fast = parser._fast_handler()
        return parser


def _markers(fmt: ReasoningFormat | ToolFormat | None) -> tuple[str, ...]:
    if isinstance(fmt, ReasoningFormat):
        return (fmt.start, fmt.end, fmt.implicit_end or "")
    if isinstance(fmt, ToolFormat):
        return (fmt.open, fmt.close, fmt.args_start, "{" if fmt.body == "json_objects" else "")
    return ()


@cache
def _could_hold_marker(markers: tuple[str, ...]) -> Callable[[str], object]:
    """A search that finds every place a marker could start in a text: a marker's first two
    characters anywhere, or its first character at the very end. Text it finds nothing in
    holds no marker and no marker prefix at its end ("a < b" passes for `<think>`)."""
    markers = tuple(m for m in markers if m)
    if not markers:
        return re.compile("(?!)").search
    heads = sorted({re.escape(m[:2]) for m in markers}, key=len, reverse=True)
    firsts = "".join(sorted({re.escape(m[0]) for m in markers}))
    return re.compile("|".join(heads) + "|[" + firsts + r"]\Z").search


_NO_CALLS: list[dict[str, Any]] = []
# NamedTuple's own constructor is a Python function; the fast paths make one per feed.
_new = tuple.__new__
_EMPTY = ChatDelta("", "", _NO_CALLS)


def _fast_reasoning(parser: ChatParser, text: str) -> ChatDelta:
    if not text:
        return _EMPTY
    parser.reasoning_text.append(text)
    return _new(ChatDelta, ("", text, _NO_CALLS))


def _fast_content(parser: ChatParser, text: str) -> ChatDelta:
    if not text:
        return _EMPTY
    parser.content_text.append(text)
    return _new(ChatDelta, (text, "", _NO_CALLS))


def _fast_buffer(parser: ChatParser, text: str) -> ChatDelta:
    parser.tools.buf.append(text)  # type: ignore[union-attr]
    return _EMPTY


def _fast_drop(parser: ChatParser, text: str) -> ChatDelta:
    return _EMPTY


def _fast_arguments(parser: ChatParser, text: str) -> ChatDelta:
    if not text:
        return _EMPTY
    calls = parser.tools.calls  # type: ignore[union-attr]
    calls[-1][1] += text
    return ChatDelta("", "", [{"index": len(calls) - 1, "function": {"arguments": text}}])


_FAST_TOOL_REGIONS: dict[str, Callable[[ChatParser, str], ChatDelta]] = {
    "text": _fast_content,
    "plain": _fast_content,
    "call": _fast_buffer,
    "name": _fast_buffer,
    "body": _fast_buffer,
    "between": _fast_drop,
    "args": _fast_arguments,
}


def prompt_reasoning_state(prompt_tail: str, fmt: ReasoningFormat) -> PromptState:
    """Whether a prompt leaves reasoning open ("open": its last marker is the start marker),
    closed ("closed": the end marker; vLLM's `is_reasoning_end` on the prompt), or neither."""
    start, end = prompt_tail.rfind(fmt.start), prompt_tail.rfind(fmt.end)
    if start < 0 and end < 0:
        return None
    return "open" if start > end else "closed"
