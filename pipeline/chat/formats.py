"""Chat output formats as data, and the registry that names them (as vLLM's flags do).

A reasoning format is its two markers, plus for Qwen3 the implicit end vLLM added for Qwen3.5
(a `<tool_call>` followed by `<function` ends reasoning without `</think>`). A tool format is
its markers and the kind of body a call has; the engine (pipeline/chat/tools.py) has one small
reader per body kind, so a new format that reuses a body kind is a new table here and nothing
else. Each table names the vLLM file whose non-streaming result it reproduces
(docs/chat-outputs.md lists where a stream cannot, and what detok does there).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Literal

BodyKind = Literal["tagged_json", "name_then_args", "json_list", "json_objects"]


@dataclass(frozen=True)
class ReasoningFormat:
    """Reasoning between `start` and `end`; text before `end` is reasoning even without `start`.

    `implicit_end`, when set, also ends reasoning if the text right after it (past whitespace)
    begins with `implicit_follow` and one of `implicit_follow_next`; the marker then stays in
    the content, where a tool parser reads it.
    """

    name: str
    start: str
    end: str
    source: str
    implicit_end: str | None = None
    implicit_follow: str = ""
    implicit_follow_next: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """Where calls start and end in the content, and what a call's body is.

    - `tagged_json`: `open` JSON `close`, the JSON an object with `name` and `arguments`;
      text after the first call is dropped.
    - `name_then_args`: `open` name `args_start`... arguments up to the next `open` or the end,
      taken as they are (not parsed), so they stream; `name_drop` is removed from the name.
    - `json_list`: `open` then one JSON list of `{name, arguments}` objects, read at the end.
    - `json_objects`: the content starts (past whitespace) with `open` or a JSON object; every
      top-level object is a call `{name, arguments|parameters}`.
    """

    name: str
    body: BodyKind
    open: str
    source: str
    close: str = ""
    args_start: str = ""
    name_drop: str = ""
    id_style: Literal["openai", "mistral"] = "openai"


DEEPSEEK_R1 = ReasoningFormat(
    name="deepseek_r1",
    start="<think>",
    end="</think>",
    source="vllm/reasoning/deepseek_r1_reasoning_parser.py + basic_parsers.py",
)
QWEN3 = ReasoningFormat(
    name="qwen3",
    start="<think>",
    end="</think>",
    source="vllm/reasoning/qwen3_reasoning_parser.py",
    implicit_end="<tool_call>",
    implicit_follow="<function",
    implicit_follow_next="= \t\n\r\f\v",
)
HERMES = ToolFormat(
    name="hermes",
    body="tagged_json",
    open="<tool_call>",
    close="</tool_call>",
    source="vllm/tool_parsers/hermes_tool_parser.py",
)
MISTRAL = ToolFormat(
    name="mistral",
    body="name_then_args",
    open="[TOOL_CALLS]",
    args_start="{",
    name_drop="[ARGS]",
    id_style="mistral",
    source="vllm/tool_parsers/mistral_tool_parser.py (tokenizer v11+)",
)
MISTRAL_PRE_V11 = ToolFormat(
    name="mistral",
    body="json_list",
    open="[TOOL_CALLS]",
    id_style="mistral",
    source="vllm/tool_parsers/mistral_tool_parser.py (tokenizer before v11)",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    body="json_objects",
    open="<|python_tag|>",
    source="vllm/tool_parsers/llama_tool_parser.py",
)

REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (DEEPSEEK_R1, QWEN3)}
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, MISTRAL, LLAMA3_JSON)}


class UnknownParserError(ValueError):
    """A parser name no table has; the message lists the valid ones (for start-up errors)."""


def _known(kind: str, name: str, names: Container[str] | dict) -> None:
    if name not in names:
        valid = ", ".join(sorted(names))
        raise UnknownParserError(f"unknown {kind} parser {name!r}; valid: {valid}")


def reasoning_format(name: str) -> ReasoningFormat:
    """The reasoning format of a `--reasoning-parser` name."""
    _known("reasoning", name, REASONING_FORMATS)
    return REASONING_FORMATS[name]


def tool_format(name: str, vocab: Container[str] | None = None) -> ToolFormat:
    """The tool format of a `--tool-parser` name.

    `mistral` depends on the tokenizer, as in vLLM: a vocabulary without `[ARGS]` is a
    tokenizer before v11, whose calls are one JSON list. Without a vocabulary, v11+.
    """
    _known("tool", name, TOOL_FORMATS)
    if name == "mistral" and vocab is not None and "[ARGS]" not in vocab:
        return MISTRAL_PRE_V11
    return TOOL_FORMATS[name]
