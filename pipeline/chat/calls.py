"""Reading one tool call's body as vLLM does, and naming calls so a restored stream agrees.

Each reader returns (name, arguments) pairs, arguments as vLLM's non-streaming parsers write
them (`json.dumps(value, ensure_ascii=False)`), or None where vLLM's parser gives up and the
text becomes content (it catches every error there; so does this).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

Call = tuple[str, str]
_DECODER = json.JSONDecoder()
_LIST_FALLBACK = re.compile(r"\[{.*}\]", re.DOTALL)
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def call_id(request_id: str, index: int, style: str) -> str:
    """A call's id from (request id, call index): the same after a restore, unlike vLLM's
    random ids (`chatcmpl-tool-<hex>`, Mistral's 9 letters and digits), whose shape it keeps."""
    digest = hashlib.blake2b(f"{request_id}\x00{index}".encode(), digest_size=16).digest()
    if style == "mistral":
        number = int.from_bytes(digest, "big")
        chars = []
        for _ in range(9):
            number, rest = divmod(number, len(_ALNUM))
            chars.append(_ALNUM[rest])
        return "".join(chars)
    return "chatcmpl-tool-" + digest.hex()


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tagged_json_call(body: str) -> Call | None:
    """hermes: `json.loads(body)`, then `obj["name"]` and `obj["arguments"]`.

    Arguments the model wrote as a JSON string holding an object are that object, not
    encoded twice (vLLM's tests/tool_parsers/test_hermes_tool_parser.py,
    test_hermes_parser_non_streaming_serialized_arguments); any other string is a string.
    """
    try:
        obj = json.loads(body)
        name, arguments = obj["name"], obj["arguments"]
    except Exception:
        return None
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    # vLLM builds a pydantic FunctionCall(name: str): anything else fails the same way.
    return (name, _arguments(arguments)) if isinstance(name, str) else None


def json_object_call(text: str) -> Call | None:
    """llama3_json: one object from a `{`, `name` and `arguments` (else `parameters`)."""
    try:
        obj, end = _DECODER.raw_decode(text)
        name = obj["name"]
        arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
    except Exception:
        return None
    if end != len(text) or not isinstance(name, str):
        return None
    return name, _arguments(arguments)


def json_list_calls(body: str) -> list[Call] | None:
    """mistral before v11: the first JSON value of the stripped body, else the text matching
    `\\[{.*}\\]`; each item's `name` and `arguments` (default {})."""
    text = body.strip()
    try:
        try:
            items, _ = _DECODER.raw_decode(text)
        except json.JSONDecodeError:
            items = json.loads(_LIST_FALLBACK.findall(text)[0])
        calls = [(item["name"], _arguments(item.get("arguments", {}))) for item in items]
    except Exception:
        return None
    return calls if all(isinstance(name, str) for name, _ in calls) else None
