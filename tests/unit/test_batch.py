"""Batch transparency by example (docs/decode-semantics.md, 'Batching'): `decode_round` gives
every stream exactly what `push` alone would, whatever else shares the round.

One round mixes tokenizers of every decoder family (pure Python and through `tokenizers`), both
`skip_special_tokens` flags, empty chunks, already flushed streams, a request failing on an
unknown generated id and one with a malformed id. Each stream has a solo twin driven by `push`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer

from pipeline.batch import ChunkResult, decode_round
from pipeline.decode_stream import DecodeStream, InvalidTokenIdError, StrictDecodeError
from tests.unit.small_tokenizers import (
    BL_IM_END,
    BL_SPECIAL,
    UNKNOWN_ID,
    byte_fallback,
    byte_level,
    ffi_twin,
    metaspace,
    spm_byte,
    wordpiece,
)


def b(text: str) -> list[int]:
    """Byte-level ids of `text` (id b <-> byte b)."""
    return list(text.encode("utf-8"))


def sb(text: str) -> list[int]:
    """`<0xNN>` ids of `text` in the byte-fallback tokenizer."""
    return [spm_byte(x) for x in text.encode("utf-8")]


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@dataclass
class Request:
    """A batched stream, its solo twin, and the chunk it gets in each round ([] once done)."""

    name: str
    tokenizer: Callable[[], Tokenizer]
    prompt: list[int]
    chunks: list[list[int]]
    skip: bool = True
    flushed_before: bool = False
    batched: DecodeStream = field(init=False)
    solo: DecodeStream = field(init=False)

    def __post_init__(self) -> None:
        tok = self.tokenizer()
        self.batched = DecodeStream(tok, self.prompt, skip_special_tokens=self.skip)
        self.solo = DecodeStream(tok, self.prompt, skip_special_tokens=self.skip)
        if self.flushed_before:
            for stream in (self.batched, self.solo):
                stream.push(self.prompt[-1:])
                stream.flush()

    def chunk(self, round_no: int) -> list[int]:
        return self.chunks[round_no] if round_no < len(self.chunks) else []


def requests() -> list[Request]:
    bf, ms, wp = byte_fallback(), metaspace(), wordpiece()
    smile = "😀".encode()
    return [
        # A character split over three rounds, then a skipped (or kept) special.
        Request("bl", byte_level, b("Hi "), [b("你")[:1], b("你")[1:2], b("你")[2:] + b(" ok")]),
        Request(
            "bl-keep-specials",
            byte_level,
            b("Hi"),
            [b("!") + [BL_SPECIAL], [], [BL_IM_END] + b("é")[:1], b("é")[1:]],
            skip=False,
        ),
        Request("bl-ffi", lambda: ffi_twin("byte_level"), b("ab"), [b("c你")[:3], b("你")[2:]]),
        Request(
            "byte-fallback",
            byte_fallback,
            enc(bf, "Hello"),
            # The normalizer prepends "▁": "world" encodes as "▁world", decoded " world".
            [enc(bf, "world") + sb("😀")[:2], sb("😀")[2:], [], enc(bf, "the")],
        ),
        Request(
            "byte-fallback-keep",
            byte_fallback,
            enc(bf, "the"),
            [[2] + sb("é"), [spm_byte(smile[0])], [spm_byte(x) for x in smile[1:]]],
            skip=False,
        ),
        Request("metaspace", metaspace, enc(ms, "Hello"), [enc(ms, " world"), [], [2]]),
        Request("metaspace-ffi", lambda: ffi_twin("metaspace"), [], [enc(ms, "the a b")]),
        Request("wordpiece", wordpiece, enc(wp, "hello"), [enc(wp, "worlds ,"), enc(wp, "!")]),
        # Finished before this batch: an empty chunk, and one more chunk after the flush.
        Request("flushed-empty", byte_level, b("done"), [[], []], flushed_before=True),
        Request("flushed-more", metaspace, enc(ms, "the"), [enc(ms, "a")], flushed_before=True),
        # Fails in round 1 after emitting "ab"; round 0 is a normal chunk.
        Request("fails", byte_level, b("x"), [b("ok"), b("ab") + [UNKNOWN_ID] + b("c")]),
        Request("fails-ffi", lambda: ffi_twin("wordpiece"), [], [enc(wp, "hello"), [UNKNOWN_ID]]),
    ]


def test_round_equals_each_stream_alone() -> None:
    reqs = requests()
    alive = list(reqs)
    failed: dict[str, ChunkResult] = {}
    for round_no in range(max(len(r.chunks) for r in reqs)):
        work = [(r, r.chunk(round_no)) for r in alive]
        results = decode_round([(r.batched, chunk) for r, chunk in work])
        assert len(results) == len(work)
        for (r, chunk), result in zip(work, results, strict=True):
            try:
                expected = r.solo.push(chunk)
            except StrictDecodeError as error:
                assert isinstance(result.error, StrictDecodeError), r.name
                assert result.error.token_id == error.token_id == UNKNOWN_ID
                assert result.text == error.partial_text, r.name
                failed[r.name] = result
                continue
            assert result == ChunkResult(expected), r.name
        alive = [r for r in alive if r.name not in failed]
    assert set(failed) == {"fails", "fails-ffi"}
    assert failed["fails"].text == "ab"
    assert failed["fails-ffi"].text == ""
    for r in alive:
        assert r.batched.flush() == r.solo.flush(), r.name


def test_known_outputs_of_the_mixed_round() -> None:
    """The transparency above, pinned to the texts a reader expects."""
    texts: dict[str, str] = {}
    reqs = requests()
    for round_no in range(max(len(r.chunks) for r in reqs)):
        results = decode_round([(r.batched, r.chunk(round_no)) for r in reqs])
        for r, result in zip(reqs, results, strict=True):
            texts[r.name] = texts.get(r.name, "") + result.text
    for r in reqs:
        texts[r.name] += r.batched.flush()
    assert texts["bl"] == "你 ok"
    assert texts["bl-keep-specials"] == "!<special><|im_end|>é"
    assert texts["bl-ffi"] == "c你"
    assert texts["byte-fallback"] == " world😀 the"
    assert texts["flushed-empty"] == ""
    assert texts["fails"] == "okab"


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_malformed_id_fails_only_its_stream(bad: object) -> None:
    good = DecodeStream(byte_level(), b("Hi"))
    broken = DecodeStream(byte_level(), b("Hi"))
    ffi = DecodeStream(ffi_twin("byte_level"), b("Hi"))
    results = decode_round([(good, b("!")), (broken, [*b("a"), bad]), (ffi, [bad])])  # type: ignore[list-item]
    assert results[0] == ChunkResult("!")
    for result in results[1:]:
        assert result.text == ""
        assert isinstance(result.error, InvalidTokenIdError)
    # A malformed chunk changes nothing: the stream continues as if it was never pushed.
    assert broken.push(b("a!")) == "a!"
    assert ffi.push(b("a!")) == "a!"


def test_empty_round_and_empty_chunks() -> None:
    assert decode_round([]) == []
    streams = [DecodeStream(byte_level(), b("Hi")), DecodeStream(ffi_twin("metaspace"), [4])]
    assert decode_round([(s, []) for s in streams]) == [ChunkResult(""), ChunkResult("")]
    # Nothing was pushed: the prompt is never emitted.
    assert [s.flush() for s in streams] == ["", ""]
