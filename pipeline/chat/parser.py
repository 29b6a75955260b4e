"""One request's chat-output parser: reasoning first, then tool calls in what is left.

vLLM's serving layer runs the reasoning parser on the generated text and the tool parser on
the content it leaves, so text inside reasoning never becomes a call; this chains the two
stages the same way. `feed` takes text deltas of any size (a character, a token's text, the
whole output) and returns what each field gained; `finish` flushes and gives the result, which
is the same for every chunking and equal to the concatenated deltas. The state is plain values
(`snapshot`, `ChatParser.restore`), so a restored stream ends with the same result and ids.
"""

from __future__ import annotations

from typing import Any

from pipeline.chat.calls import call_id
from pipeline.chat.formats import ReasoningFormat, ToolFormat
from pipeline.chat.output import ChatDelta, ChatResult, DeltaBuilder
from pipeline.chat.reasoning import PromptState, ReasoningStage
from pipeline.chat.tools import ToolStage

SNAPSHOT_VERSION = 1


class ChatParser:
    """Streaming split of one request's output into reasoning, content and tool calls."""

    __slots__ = ("request_id", "reasoning", "tools", "content_text", "reasoning_text", "done")

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

    def feed(self, text: str) -> ChatDelta:
        """What `text` (the next piece of generated text) makes final in each field."""
        if self.done:
            raise RuntimeError("feed after finish")
        return self._step(text, final=False)

    def finish(self) -> tuple[ChatDelta, ChatResult]:
        """The last delta (what was held back) and the stream's result."""
        if self.done:
            raise RuntimeError("finish called twice")
        delta = self._step("", final=True)
        self.done = True
        return delta, self.result()

    def _step(self, text: str, final: bool) -> ChatDelta:
        out = DeltaBuilder()
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning:
                out.reasoning.append(reasoning)
        if self.tools is not None:
            self.tools.feed(text, out, final)
        else:
            out.content.append(text)
        delta = out.build()
        if delta.content:
            self.content_text.append(delta.content)
        if delta.reasoning:
            self.reasoning_text.append(delta.reasoning)
        return delta

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
        return parser


def prompt_reasoning_state(prompt_tail: str, fmt: ReasoningFormat) -> PromptState:
    """Whether a prompt leaves reasoning open ("open": its last marker is the start marker),
    closed ("closed": the end marker; vLLM's `is_reasoning_end` on the prompt), or neither."""
    start, end = prompt_tail.rfind(fmt.start), prompt_tail.rfind(fmt.end)
    if start < 0 and end < 0:
        return None
    return "open" if start > end else "closed"
