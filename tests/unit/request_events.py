"""Events, origins and a registry for processor tests, on the byte-level test tokenizer.

Id b <-> byte b (ids >= 10,000 unknown), so every expected text is plain bytes arithmetic.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.processor import EventOrigin, RequestProcessor
from pipeline.results import BatchResult
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt, ParsedTokens, encode_event
from tests.unit.small_tokenizers import byte_level


def bytes_registry(directory: Path, vocab_size: int = 20_000) -> TokenizerRegistry:
    """A registry with the byte-level tokenizer as model "bytes"."""
    path = directory / "tokenizer.json"
    byte_level().save(str(path))
    registry = TokenizerRegistry()
    registry.register("bytes", path, model_vocab_size=vocab_size)
    return registry


def ids(text: str) -> list[int]:
    return list(text.encode())


def prompt(request_id: str = "r", text: str = "Hello there", model: str = "bytes") -> ParsedPrompt:
    return ParsedPrompt(request_id=request_id, model=model, prompt_token_ids=ids(text))


def tokens(seq: int, text: str | list[int], request_id: str = "r") -> ParsedTokens:
    token_ids = ids(text) if isinstance(text, str) else text
    return ParsedTokens(request_id=request_id, seq=seq, token_ids=token_ids)


def finish(seq: int, request_id: str = "r") -> ParsedFinish:
    return ParsedFinish(request_id=request_id, seq=seq, finish_reason="stop")


def origin(offset: int = 0, event: ParsedEvent | None = None, **fields) -> EventOrigin:
    """An event's origin: placeholder bytes, or the event's own record when given the event
    (what a consumer's origin holds, and all a held event's snapshot keeps)."""
    value = f"raw-{offset}".encode() if event is None else encode_event(event)
    return EventOrigin(source="t", partition=0, offset=offset, value=value, **fields)


def run(processor: RequestProcessor, *events: ParsedEvent, now: float = 0.0) -> BatchResult:
    return processor.process([(e, origin(i)) for i, e in enumerate(events)], now)


def run_records(
    processor: RequestProcessor, *events: ParsedEvent, now: float = 0.0, **fields
) -> BatchResult:
    """`run` with origins that carry each event's record, as a consumer's would."""
    return processor.process([(e, origin(i, e, **fields)) for i, e in enumerate(events)], now)


def reasons(result: BatchResult) -> list[str]:
    return [letter.reason.value for letter in result.dead_letters]
