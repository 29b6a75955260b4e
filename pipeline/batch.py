"""One decode round for many streams: the batched form of `DecodeStream.push`
(docs/decode-semantics.md, 'Batching').

Each stream's push runs as a generator of decode requests (`DecodeStream.push_steps`). A round
advances every generator to its next request, then answers all pending requests with ONE
`Tokenizer.decode_batch` per (tokenizer, skip_special_tokens) group, as SGLang's detokenizer does:
`decode_batch` releases the GIL and spreads rows over both cores. Most chunks need one decode, so a
round is usually one FFI call per group; probes and (non-ByteLevel) prefix re-decodes add a second
or third pass only for the rows that need them.

Streams whose tokenizer has a pure Python decoder (`DecodeStream.decodes_inline`) skip all of
that: the round simply calls their `push`, which decides most chunks with one table lookup and one
bytes decode, with no generator, no queueing and no FFI call. Those rows are the common case (GPT-2,
Qwen, Llama-3, OLMo, Llama-2/Mistral-v1 tokenizers), so the loop below keeps them lean. The text of
every stream is exactly what `push` would give: the generator is the same code.
A stream whose chunk fails (for any exception) gets its error (and the partial text) in its own
`ChunkResult`; the others in the batch are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

from pipeline.decode_stream import (
    DecodeRequest,
    DecodeStream,
    InvalidTokenIdError,
    PushSteps,
    StrictDecodeError,
)


class ChunkResult(NamedTuple):
    """The text a stream produced for its chunk (the partial text on error) and its error.

    A named tuple rather than a dataclass: one is built per stream per round, and tuple
    construction is several times cheaper than a frozen dataclass's `__init__`.
    """

    text: str
    # Strict and invalid-id errors are the input's; any other exception is a fault the caller
    # isolates to this stream's request.
    error: Exception | None = None


# Most rounds of a busy stream emit text, but many emit nothing (held characters, empty chunks):
# those all share this one immutable result.
_EMPTY = ChunkResult("")
# `ChunkResult((text, None))` without the generated `__new__`'s argument handling.
_new_result = partial(tuple.__new__, ChunkResult)


def decode_round(work: Sequence[tuple[DecodeStream, Sequence[int]]]) -> list[ChunkResult]:
    """Push one chunk into each stream; results in the order of `work`.

    A stream may appear at most once per round (its generator holds the stream's state while it
    waits). Streams may use different tokenizers and skip flags; empty chunks are allowed.
    """
    results: list[ChunkResult | None] = []
    append = results.append
    empty = _EMPTY
    new_result = _new_result
    waiting: list[tuple[int, DecodeStream, PushSteps, DecodeRequest]] = []
    for stream, chunk in work:
        if stream.decodes_inline:
            # Pure decoder: `push` never needs tokenizers, so no generator and no queueing.
            try:
                text = stream.push(chunk)
            except StrictDecodeError as error:
                append(ChunkResult(error.partial_text, error))
            except InvalidTokenIdError as error:
                append(ChunkResult("", error))
            except Exception as error:  # any other fault stays with its own stream
                append(ChunkResult("", error))
            else:
                append(new_result((text, None)) if text else empty)
        else:
            index = len(results)
            append(None)
            _advance(index, stream, stream.push_steps(chunk), None, results, waiting)
    while waiting:
        answers = _decode_grouped(waiting)
        current, waiting = waiting, []
        for (index, stream, steps, _), texts in zip(current, answers, strict=True):
            _advance(index, stream, steps, texts, results, waiting)
    return results  # type: ignore[return-value]  # every slot was filled


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
    except Exception as error:  # any other fault stays with its own stream
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
