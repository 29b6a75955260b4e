"""What a feed produces (a delta per field) and what a finished stream is (the result).

Tool-call deltas are in OpenAI's `ChoiceDeltaToolCall` shape: a call's first delta carries
`index`, `id`, `type: "function"` and the function `name` (with `arguments` ""), later ones
`index` and a piece of `arguments`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class ChatDelta(NamedTuple):
    """The text each field gained in one feed (empty when nothing became final).

    A tuple: one is made per feed, and a tuple is the cheapest object to make.
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = []  # never mutated: a fresh list when there are calls

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ChatResult:
    """A finished stream, as vLLM's non-streaming parsers report it.

    `content` and `reasoning` are None when absent (reasoning can be "" when the model closed
    it at once, as in vLLM); `tools_called` makes the finish reason "tool_calls".
    """

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    tools_called: bool

    @property
    def finish_reason(self) -> str | None:
        """The finish reason: "tool_calls" when calls were parsed, else None (the stream keeps
        its own)."""
        return "tool_calls" if self.tools_called else None


class DeltaBuilder:
    """Collects the tool stage's output of one feed; argument pieces of one call merge."""

    __slots__ = ("content", "tool_calls")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []

    def start_call(self, index: int, call_id: str, name: str, arguments: str = "") -> None:
        function = {"name": name, "arguments": arguments}
        self.tool_calls.append(
            {"index": index, "id": call_id, "type": "function", "function": function}
        )

    def add_arguments(self, index: int, piece: str) -> None:
        if not piece:
            return
        calls = self.tool_calls
        if calls and calls[-1]["index"] == index:
            calls[-1]["function"]["arguments"] += piece
        else:
            calls.append({"index": index, "function": {"arguments": piece}})
