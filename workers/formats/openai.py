"""OpenAI shapes: Completion objects and Batch output lines out, Batch output lines in.

Out: `openai-completion` writes one legacy Completion object (`object: "text_completion"`) per
request, `openai-chat` one ChatCompletion (`object: "chat.completion"`, the chat outputs of
docs/chat-outputs.md in its message); `openai-batch` wraps either as a Batch API output line
`{id, custom_id, response: {status_code, request_id, body}, error}`, the shape OpenAI's Batch API
and vLLM's `run_batch` write, so tools that read those read detok's results. The `openai`
package's own models judge them all in the tests.

In: a Batch output file from a server that returned the token ids (vLLM with
`return_token_ids: true`) is a log of generations, so `detok replay` and `detok run` can
re-detokenize a batch job's raw ids. vLLM puts them on the completion choice:
`CompletionResponseChoice.token_ids` ("For response") and `CompletionResponseChoice.
prompt_token_ids` ("For prompt") in vllm/entrypoints/openai/protocol.py; a chat completion carries
the generated ids as `choices[].token_ids` and the prompt ids as `ChatCompletionResponse.
prompt_token_ids` on the body, so both places are read. The envelope is vLLM's
`BatchRequestOutput` / `BatchResponseData` (vllm/entrypoints/openai/run_batch.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import ValidationError

from pipeline.records import Position, SourceRecord
from schemas.events import Completion, DeadLetterReason, LoggedGeneration
from schemas.validation import MAX_MESSAGE_CHARS, Rejection, classify, is_row_fault
from workers.formats.base import LineOf, RequestFailure, carries_chat

# OpenAI's Completion admits only these finish reasons. A log without one (None) or with a
# server's own (vLLM's "abort") is written as "stop", the reason for an ending that was neither a
# length cap nor a filter; detok's own formats keep the logged value unchanged.
OPENAI_FINISH_REASONS = frozenset({"stop", "length", "content_filter"})
# OpenAI's ChatCompletion admits these; "tool_calls" is what a request whose calls were parsed
# ends with (as vLLM reports it).
CHAT_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter"})
# A failed request has no response; its error `code` is the dead-letter reason. Collect sees only
# the failed completion (its dead letter is on the dead-letter topic), so it uses this code.
FAILED_COMPLETION_CODE = "request_failed"


def completion_object(completion: Completion, created: int) -> dict[str, Any]:
    """The legacy Completion object of one request (`openai.types.Completion`)."""
    finish_reason = completion.finish_reason
    choice: dict[str, Any] = {
        "index": 0,
        "text": completion.text,
        "finish_reason": finish_reason if finish_reason in OPENAI_FINISH_REASONS else "stop",
        "logprobs": legacy_logprobs(completion),
    }
    stop_reason = getattr(completion, "stop_reason", None)
    if stop_reason is not None:
        # vLLM's extension: the stop string that ended the text.
        choice["stop_reason"] = stop_reason
    return {
        "id": f"cmpl-{completion.request_id}",
        "object": "text_completion",
        "created": created,
        "model": completion.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.generated_tokens,
            "total_tokens": completion.prompt_tokens + completion.generated_tokens,
        },
    }


def chat_completion_object(completion: Completion, created: int) -> dict[str, Any]:
    """The ChatCompletion object of one request (`openai.types.chat.ChatCompletion`), as vLLM's
    chat endpoint writes it: the assistant message's `content`, `reasoning` (vLLM's field name,
    not OpenAI's) and `tool_calls` ([] when none, as vLLM), the reasoning tokens in `usage`.

    `content` is None where vLLM's is: when the text is empty and the parsers found calls or
    reasoning (a completion without chat parsers keeps its text, "" included).
    """
    calls = completion.tool_calls or []
    chat_parsed = bool(calls) or completion.reasoning is not None
    finish_reason = completion.finish_reason
    choice: dict[str, Any] = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": completion.text or (None if chat_parsed else ""),
            "reasoning": completion.reasoning,
            "tool_calls": [call.model_dump() for call in calls],
        },
        "finish_reason": finish_reason if finish_reason in CHAT_FINISH_REASONS else "stop",
        "logprobs": chat_logprobs(completion),
    }
    if completion.stop_reason is not None:
        choice["stop_reason"] = completion.stop_reason  # vLLM's extension, as above
    usage: dict[str, Any] = {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.generated_tokens,
        "total_tokens": completion.prompt_tokens + completion.generated_tokens,
    }
    if completion.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": completion.reasoning_tokens}
    return {
        "id": f"chatcmpl-{completion.request_id}",
        "object": "chat.completion",
        "created": created,
        "model": completion.model,
        "choices": [choice],
        "usage": usage,
    }


def chat_logprobs(completion: Completion) -> dict[str, list] | None:
    """The chat logprobs `{content: [{token, logprob, bytes, top_logprobs}]}`, one entry per
    generated token whatever part of the message its text went to, or None when the input
    carried none. `token` is the token alone (special tokens shown), as vLLM's chat endpoint
    gives it; detok's own `id`, `text` and `text_offset` are left out of OpenAI's shape."""
    if completion.logprobs is None:
        return None
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": entry.bytes,
                "top_logprobs": [
                    {"token": top.token, "logprob": top.logprob, "bytes": top.bytes}
                    for top in entry.top_logprobs
                ],
            }
            for entry in completion.logprobs.entries()
        ]
    }


def response_body(completion: Completion, created: int) -> dict[str, Any]:
    """A Batch output line's body: a ChatCompletion for a request a chat parser read (its
    completion carries a chat field), else a legacy Completion. A Batch output line does not
    say which endpoint its request went to (the input's `url` is not in a logged generation);
    a request with reasoning or tool calls came from a chat endpoint."""
    if carries_chat(completion):
        return chat_completion_object(completion, created)
    return completion_object(completion, created)


def legacy_logprobs(completion: Completion) -> dict[str, list] | None:
    """The legacy completions logprobs `{tokens, token_logprobs, top_logprobs, text_offset}`
    (parallel lists, one entry per generated token), or None when the input carried none.

    `tokens` are each token's text in the completion (they concatenate to it, and `text_offset`
    indexes it); the keys of `top_logprobs` are the candidates' token strings, as vLLM writes
    them. Two candidates with one string keep the likelier.
    """
    logprobs = getattr(completion, "logprobs", None)
    if logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in logprobs.entries():
        tokens.append(entry.text)
        token_logprobs.append(entry.logprob)
        text_offset.append(entry.text_offset)
        top: dict[str, float] = {}
        for candidate in entry.top_logprobs:
            if candidate.logprob > top.get(candidate.token, float("-inf")):
                top[candidate.token] = candidate.logprob
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def batch_line(
    completion: Completion | None, failure: RequestFailure | None, created: int
) -> dict[str, Any] | None:
    """A Batch output line for one request, or None when there is nothing to say under its id.

    An ok completion is a 200 response; a failed request (a failed completion, or a dead letter
    that names its request) an error line without a response.
    """
    if completion is not None and completion.status == "ok":
        return {
            "id": f"batch_req_{completion.request_id}",
            "custom_id": completion.request_id,
            "response": {
                "status_code": 200,
                "request_id": completion.request_id,
                "body": response_body(completion, created),
            },
            "error": None,
        }
    if failure is not None:
        request_id, code, message = failure.request_id, failure.code, failure.message
    elif completion is not None:
        request_id, code = completion.request_id, FAILED_COMPLETION_CODE
        message = completion.error or "request failed"
    else:
        return None
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": request_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def completion_lines(created: int, *, chat: bool = False) -> LineOf:
    """One Completion object (a ChatCompletion with `chat`) per line for every request that
    completed; failed requests are in the dead letters (openai-batch writes them as error
    lines)."""
    shape = chat_completion_object if chat else completion_object

    def line_of(completion: Completion | None, failure: RequestFailure | None) -> str | None:
        if completion is None or completion.status != "ok":
            return None
        return json.dumps(shape(completion, created), ensure_ascii=False)

    return line_of


def batch_output_lines(created: int) -> LineOf:
    """One Batch output line per request that has an id."""

    def line_of(completion: Completion | None, failure: RequestFailure | None) -> str | None:
        line = batch_line(completion, failure, created)
        return None if line is None else json.dumps(line, ensure_ascii=False)

    return line_of


def openai_batch_records(lines: Iterable[bytes]) -> Iterator[SourceRecord]:
    """Logged generations from Batch output lines whose responses carry token ids.

    A line that is not JSON, has no successful response, or whose choice lacks the ids is
    rejected (a dead letter with its line number): without ids there is nothing to decode. Any
    other exception for one line rejects that line too, and the file goes on (issue 32).
    """
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        line = raw.rstrip(b"\r\n")
        yield SourceRecord(Position(line=number), _guarded(line), line)


def _guarded(line: bytes) -> LoggedGeneration | Rejection:
    try:
        return _generation_of(line)
    except BaseException as error:
        if not is_row_fault(error):
            raise
        return Rejection(
            DeadLetterReason.UNEXPECTED_ERROR, type(error).__name__, str(error)[:MAX_MESSAGE_CHARS]
        )


def _generation_of(line: bytes) -> LoggedGeneration | Rejection:
    try:
        envelope = json.loads(line)
    except (ValueError, RecursionError) as error:
        return Rejection(DeadLetterReason.MALFORMED_JSON, type(error).__name__, str(error))
    try:
        body = _object(_object(envelope, "the line")["response"], "response")["body"]
        choice = _object(_object(body, "response.body")["choices"][0], "choices[0]")
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is None:
            prompt_ids = body.get("prompt_token_ids")
        fields = {
            "request_id": envelope["custom_id"],
            "model": body["model"],
            "prompt_token_ids": prompt_ids,
            "output_token_ids": choice["token_ids"],
            "finish_reason": choice.get("finish_reason"),
        }
    except (KeyError, IndexError, TypeError) as error:
        return Rejection(
            DeadLetterReason.SCHEMA_VIOLATION,
            type(error).__name__,
            f"not a successful batch output line with token ids "
            "(response.body.choices[0].token_ids and prompt_token_ids): "
            f"{'missing ' if isinstance(error, KeyError) else ''}{error}",
        )
    try:
        return LoggedGeneration.model_validate(fields)
    except ValidationError as error:
        return Rejection(
            classify(error), "pydantic_core.ValidationError", str(error)[:MAX_MESSAGE_CHARS]
        )


def _object(value: Any, where: str) -> dict[str, Any]:
    """`value` if it is a JSON object; a TypeError naming `where` if not (a string or a list
    there would otherwise fail on its first `.get`)."""
    if not isinstance(value, dict):
        raise TypeError(f"{where} is {type(value).__name__}, not an object")
    return value
