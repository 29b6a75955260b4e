"""Logged generations as event streams.

A logged generation (one JSONL line: prompt ids, output ids) is what an inference server would
have sent as events: a prompt, the output ids in chunks, a finish. `detok run` and `detok replay`
both cut it the same way, so offline and Kafka runs see the same events.
"""

from __future__ import annotations

from schemas.events import LoggedGeneration, Tool
from schemas.fast_events import (
    ParsedEvent,
    ParsedFinish,
    ParsedFunction,
    ParsedPrompt,
    ParsedTokens,
    ParsedTool,
)

DEFAULT_CHUNK_SIZE = 16


def generation_events(
    generation: LoggedGeneration, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[ParsedEvent]:
    """prompt (seq 0), tokens chunks (seq 1..k), finish (seq k+1)."""
    if chunk_size < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
    request_id = generation.request_id
    events: list[ParsedEvent] = [
        ParsedPrompt(
            request_id=request_id,
            model=generation.model,
            prompt_token_ids=generation.prompt_token_ids,
            skip_special_tokens=generation.skip_special_tokens,
            stop=generation.stop,
            include_stop_str_in_output=generation.include_stop_str_in_output,
            prompt_tokens=generation.prompt_tokens,
            tools=None if generation.tools is None else _parsed_tools(generation.tools),
        )
    ]
    ids = generation.output_token_ids
    logprobs = generation.output_logprobs
    top_logprobs = generation.output_top_logprobs
    for seq, start in enumerate(range(0, len(ids), chunk_size), start=1):
        end = start + chunk_size
        events.append(
            ParsedTokens(
                request_id=request_id,
                seq=seq,
                token_ids=ids[start:end],
                logprobs=None if logprobs is None else logprobs[start:end],
                top_logprobs=None if top_logprobs is None else top_logprobs[start:end],
            )
        )
    events.append(
        ParsedFinish(request_id=request_id, seq=len(events), finish_reason=generation.finish_reason)
    )
    return events


def _parsed_tools(tools: list[Tool]) -> list[ParsedTool]:
    """The generation's validated tools as the prompt event's (the same fields, the same
    bounds: nothing to check again)."""
    return [
        ParsedTool(
            type=tool.type,
            function=ParsedFunction(
                name=tool.function.name,
                description=tool.function.description,
                parameters=tool.function.parameters,
                strict=tool.function.strict,
            ),
        )
        for tool in tools
    ]
