"""vLLM's non-streaming chat parsers, ported line by line as the tests' reference.

Each function follows the vLLM file named in its docstring (vLLM 0.33's behaviour as read
from its source: `extract_reasoning` / `extract_tool_calls`) on the whole text, without the
engine's streaming; the serving layer's order is kept: reasoning first, tool calls in the
content it leaves. The stream's result must equal this except where docs/chat-outputs.md
says a stream cannot (`divergence` names those cases).
"""

from __future__ import annotations

import json
import re

THINK, END = "<think>", "</think>"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")


def deepseek_r1(text: str) -> tuple[str | None, str | None]:
    """vllm/reasoning/basic_parsers.py BaseThinkingReasoningParser.extract_reasoning."""
    parts = text.partition(THINK)
    text = parts[2] if parts[1] else parts[0]
    if END not in text:
        return text, None
    reasoning, _, content = text.partition(END)
    return reasoning, content or None


def qwen3(text: str) -> tuple[str | None, str | None]:
    """vllm/reasoning/qwen3_reasoning_parser.py extract_reasoning (thinking enabled)."""
    parts = text.partition(THINK)
    text = parts[2] if parts[1] else parts[0]
    if END in text:
        reasoning, _, content = text.partition(END)
        return reasoning, content or None
    index = text.find("<tool_call>")
    if index != -1 and _FUNCTION_OPEN.match(text[index + len("<tool_call>") :].lstrip()):
        return text[:index] or None, text[index:] or None
    return text, None


def _call(name: object, arguments: object) -> dict:
    if not isinstance(name, str):
        raise TypeError("name")
    args = json.dumps(arguments, ensure_ascii=False)
    return {"type": "function", "function": {"name": name, "arguments": args}}


def hermes(text: str) -> tuple[str | None, list[dict], bool]:
    """vllm/tool_parsers/hermes_tool_parser.py extract_tool_calls."""
    if "<tool_call>" not in text:
        return text, [], False
    try:
        found = re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
        raw = [json.loads(a if a else b) for a, b in found]
        for obj in raw:
            if isinstance(obj["arguments"], str):
                try:
                    decoded = json.loads(obj["arguments"])
                except ValueError:
                    decoded = None
                if isinstance(decoded, dict):
                    obj["arguments"] = decoded
        calls = [_call(obj["name"], obj["arguments"]) for obj in raw]
    except Exception:
        return text, [], False
    content = text[: text.find("<tool_call>")]
    return content or None, calls, True


def mistral(text: str) -> tuple[str | None, list[dict], bool]:
    """vllm/tool_parsers/mistral_tool_parser.py extract_tool_calls, tokenizer v11+."""
    if "[TOOL_CALLS]" not in text:
        return text, [], False
    content, *raws = text.split("[TOOL_CALLS]")
    calls = []
    for raw in raws:
        if "{" not in raw:
            continue
        end = raw.find("{")
        name = raw[:end].replace("[ARGS]", "")
        calls.append({"type": "function", "function": {"name": name, "arguments": raw[end:]}})
    return content or None, calls, True


def mistral_pre_v11(text: str) -> tuple[str | None, list[dict], bool]:
    """vllm/tool_parsers/mistral_tool_parser.py extract_tool_calls, tokenizer before v11."""
    if "[TOOL_CALLS]" not in text:
        return text, [], False
    content, *raws = text.split("[TOOL_CALLS]")
    if len(raws) != 1:
        raise ValueError("Only one BOT token should have been outputted")
    body = raws[0].strip()
    try:
        items, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        try:
            items = json.loads(re.findall(r"\[{.*}\]", body, re.DOTALL)[0])
        except (IndexError, json.JSONDecodeError):
            return body, [], False
    calls = [_call(item["name"], item.get("arguments", {})) for item in items]
    return content or None, calls, True


def llama3_json(text: str) -> tuple[str | None, list[dict], bool]:
    """vllm/tool_parsers/llama_tool_parser.py extract_tool_calls, with its newer tests'
    rule that an object which is not a call after a call is skipped."""
    if not ("<|python_tag|>" in text or "{" in text):
        return text, [], False
    end_index = -1
    calls = []
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start <= end_index:
            continue
        try:
            obj, size = decoder.raw_decode(text[start:])
            end_index = start + size
            name = obj["name"]
            arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append(_call(name, arguments))
        except Exception:
            # Newer vLLM keeps the calls already read when trailing text has a brace
            # (test_extract_tool_calls_brace_in_trailing_text).
            if calls:
                continue
            return text, [], False
    if calls:
        return None, calls, True
    return text, [], False


REASONING = {"deepseek_r1": deepseek_r1, "qwen3": qwen3}
TOOLS = {
    "hermes": hermes,
    "mistral": mistral,
    "mistral_pre_v11": mistral_pre_v11,
    "llama3_json": llama3_json,
}


def parse(text: str, reasoning: str | None, tools: str | None) -> dict:
    """The serving layer's order: reasoning, then tool calls in the content it leaves."""
    if reasoning:
        reasoning_text, content = REASONING[reasoning](text)
    else:
        reasoning_text, content = None, text
    calls: list[dict] = []
    called = False
    if tools:
        content, calls, called = TOOLS[tools](content or "")
        content = content or None
    return {"reasoning": reasoning_text, "content": content, "tool_calls": calls, "called": called}
