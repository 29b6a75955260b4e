"""One decode round for many streams: the batched form of `DecodeStream.push` (spec §9.7).

Each stream's push runs as a generator of decode requests (`DecodeStream.push_steps`). A round
advances every generator to its next request, then answers all pending requests with ONE
`Tokenizer.decode_batch` per (tokenizer, skip_special_tokens) group, as SGLang's detokenizer does:
`decode_batch` releases the GIL and spreads rows over both cores. Most chunks need one decode, so a
round is usually one FFI call per group; probes and (non-ByteLevel) prefix re-decodes add a second
or third pass only for the rows that need them.

Streams whose tokenizer has a pure Python decoder never yield, so they cost no FFI call at all.
The text of every stream is exactly what `push` would give: the generator is the same code.
A stream whose chunk fails gets its error (and the partial text) in its own `ChunkResult`; the
others in the batch are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.decode_stream import (
    DecodeRequest,
    DecodeStream,
    InvalidTokenIdError,
    PushSteps,
    StrictDecodeError,
)


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """The text a stream produced for its chunk (the partial text on error) and its error."""

    text: str
    error: StrictDecodeError | InvalidTokenIdError | None = None


_EMPTY = ChunkResult("")


def decode_round(work: Sequence[tuple[DecodeStream, Sequence[int]]]) -> list[ChunkResult]:
    """Push one chunk into each stream; results in the order of `work`.

    A stream may appear at most once per round (its generator holds the stream's state while it
    waits). Streams may use different tokenizers and skip flags; empty chunks are allowed.
    """
    results: list[ChunkResult | None] = [None] * len(work)
    waiting: list[tuple[int, DecodeStream, PushSteps, DecodeRequest]] = []
    for index, (stream, chunk) in enumerate(work):
        steps = stream.push_steps(chunk)
        _advance(index, stream, steps, None, results, waiting)
    while waiting:
        answers = _decode_grouped(waiting)
        current, waiting = waiting, []
        for (index, stream, steps, _), texts in zip(current, answers, strict=True):
            _advance(index, stream, steps, texts, results, waiting)
    return results  # type: ignore[return-value]  # every slot was filled by _advance


def _advance(
    index: int,
    stream: DecodeStream,
    steps: PushSteps,
    texts: list[str] | None,
    results: list[ChunkResult | None],
    waiting: list[tuple[int, DecodeStream, PushSteps, DecodeRequest]],
) -> None:
    """Run one stream's push until it needs decodes (queue it) or finishes (record it)."""
    try:
        request = next(steps) if texts is None else steps.send(texts)
    except StopIteration as done:
        results[index] = ChunkResult(done.value) if done.value else _EMPTY
    except StrictDecodeError as error:
        results[index] = ChunkResult(error.partial_text, error)
    except InvalidTokenIdError as error:
        results[index] = ChunkResult("", error)
    else:
        waiting.append((index, stream, steps, request))


def _decode_grouped(
    waiting: list[tuple[int, DecodeStream, PushSteps, DecodeRequest]],
) -> list[list[str]]:
    """Answer every waiting request with one decode_batch per (tokenizer, skip flag)."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for position, (_, stream, _, _) in enumerate(waiting):
        key = (id(stream.tokenizer), stream.skip_special_tokens)
        groups.setdefault(key, []).append(position)
    answers: list[list[str]] = [[] for _ in waiting]
    for (_, skip), positions in groups.items():
        tokenizer = waiting[positions[0]][1].tokenizer
        rows = [seq for p in positions for seq in waiting[p][3]]
        texts = tokenizer.decode_batch(rows, skip_special_tokens=skip)
        offset = 0
        for p in positions:
            count = len(waiting[p][3])
            answers[p] = texts[offset : offset + count]
            offset += count
    return answers
