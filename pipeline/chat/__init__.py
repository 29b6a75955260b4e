"""Chat outputs: reasoning and tool calls parsed from generated text as it streams.

A broker-free engine (docs/chat-outputs.md): formats are tables (`formats`), `ChatParser` is
one request's streaming parser with a plain-value snapshot.
"""

from pipeline.chat.config import ChatParsers
from pipeline.chat.formats import (
    REASONING_FORMATS,
    TOOL_FORMATS,
    ReasoningFormat,
    ToolFormat,
    UnknownParserError,
    reasoning_format,
    tool_format,
)
from pipeline.chat.output import ChatDelta, ChatResult
from pipeline.chat.parser import ChatParser, prompt_reasoning_state

__all__ = [
    "REASONING_FORMATS",
    "TOOL_FORMATS",
    "ChatDelta",
    "ChatParsers",
    "ChatParser",
    "ChatResult",
    "ReasoningFormat",
    "ToolFormat",
    "UnknownParserError",
    "prompt_reasoning_state",
    "reasoning_format",
    "tool_format",
]
