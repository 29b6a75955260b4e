"""Ports of the upstream Rust unit tests in vLLM `rust/src/tokenizer/src/incremental.rs`
(docs/decode-semantics.md, 'Tests').

Same inputs and expectations. The byte-level fixture is a real `tokenizers.Tokenizer` equivalent
to upstream's `TestTokenizer` (id b <-> byte b, added tokens from 256, 10_000 unknown). Upstream's
fake backends that no real tokenizer can express (`NonMonotonicBackend`, `PieceBackend`) are
emulated through the one seam that exists for that: a `TokenizerProfile` whose pure decoder is a
scripted function. Not ported: the `next_chunk`/hold-back tests (`next_chunk_with_hold_back`,
`next_chunk_cutoff_respects_char_boundary`), because stop-string hold-back is not part of this
stream's API (it lives with stop strings, above it), and the attribution tests (no attributions).
Upstream return values are byte counts; here `push` returns the text, so counts become
`len(text.encode())` and `output()` is the concatenation of everything returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer

from pipeline.decode_stream import DecodeStream, StrictDecodeError, slice_from_byte
from pipeline.vocab_tables import build_profile, register_profile
from tests.unit.small_tokenizers import BL_SPECIAL, UNKNOWN_ID, byte_level


def b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def stream(prompt: Sequence[int] = (), *, skip: bool = True) -> DecodeStream:
    return DecodeStream(byte_level(), prompt, skip_special_tokens=skip)


def test_holds_incomplete_utf8_until_complete() -> None:
    s = stream()
    assert [nbytes(s.push([t])) for t in (0xE4, 0xBD)] == [0, 0]
    out = s.push([0xA0])
    assert nbytes(out) == 3
    assert out == "你"


def test_emits_ascii_immediately() -> None:
    s = stream()
    outs = [s.push([ord("o")]), s.push([ord("k")])]
    assert [nbytes(o) for o in outs] == [1, 1]
    assert "".join(outs) == "ok"


def test_flush_returns_none_when_fully_consumed() -> None:
    s = stream()
    assert [s.push([ord("o")]), s.push([ord("k")])] == ["o", "k"]
    assert s.flush() == ""


def test_flush_emits_buffered_incomplete_utf8() -> None:
    s = stream()
    assert s.push([0xE4]) + s.push([0xBD]) == ""
    assert s.flush() == "\ufffd"


def test_respects_skip_special_tokens() -> None:
    assert nbytes(stream(skip=True).push([BL_SPECIAL])) == 0
    kept = stream(skip=False).push([BL_SPECIAL])
    assert nbytes(kept) == 9
    assert kept == "<special>"


def test_prompt_tokens_provide_context_without_re_emission() -> None:
    s = stream(b("Hi"))
    out = s.push(b("!"))
    assert nbytes(out) == 1
    assert out == "!"


@pytest.mark.parametrize(
    ("prompt", "push", "expected", "filtered"),
    [
        pytest.param(
            b("abc") + [UNKNOWN_ID] + b("Hi"), b("!"), "!", [UNKNOWN_ID], id="suffix seed"
        ),
        pytest.param([UNKNOWN_ID], b("!"), "!", [UNKNOWN_ID], id="all unknown"),
        pytest.param(
            [UNKNOWN_ID, 0xE4, 0xBD],
            [0xA0],
            "你",
            [UNKNOWN_ID],
            id="unknown before incomplete utf-8",
        ),
        pytest.param(
            [0xE4, 0xBD, *range(UNKNOWN_ID, UNKNOWN_ID + 6)],
            [0xA0],
            "你",
            list(range(UNKNOWN_ID, UNKNOWN_ID + 6)),
            id="incomplete utf-8 before filtered suffix",
        ),
    ],
)
def test_prompt_context_filters_unknown_ids(
    prompt: list[int], push: list[int], expected: str, filtered: list[int]
) -> None:
    s = stream(prompt)
    out = s.push(push)
    assert nbytes(out) == nbytes(expected)
    assert out == expected
    assert s.filtered_prompt_ids == filtered


def test_generated_unknown_ids_still_return_decode_error() -> None:
    s = stream([UNKNOWN_ID, *b("Hi")])
    with pytest.raises(StrictDecodeError, match="cannot decode unknown token id 10000") as info:
        s.push([UNKNOWN_ID])
    assert info.value.token_id == UNKNOWN_ID
    assert info.value.partial_text == ""


def test_chunks_concatenate_to_full_text() -> None:
    text = "Hello, world!"
    s = stream()
    chunks = [s.push([t]) for t in b(text)]
    assert all(chunks)
    assert "".join(chunks) + s.flush() == text


def _scripted(tokenizer: Tokenizer, script: dict[tuple[int, ...], str]) -> None:
    """Make `tokenizer`'s streams decode by `script` (an emulated upstream fake backend)."""
    profile = build_profile(tokenizer, allow_pure=False)
    profile.pure_decode = {flag: (lambda ids: script[tuple(ids)]) for flag in (False, True)}
    register_profile(profile)


def test_non_monotonic_decode_does_not_panic() -> None:
    # NonMonotonicBackend: [1]->"abc", [1,2]->"ab", [1,2,3]->"🎉d" (vllm #17448). The prefix length
    # 2 lands inside the emoji; upstream floors it to a char boundary instead of panicking.
    tok = Tokenizer.from_str(byte_level().to_str())
    _scripted(tok, {(): "", (1,): "abc", (1, 2): "ab", (1, 2, 3): "🎉d", (2,): "", (2, 3): "🎉d"})
    s = DecodeStream(tok, [])
    assert nbytes(s.push([1])) == 3
    assert nbytes(s.push([2])) == 0
    assert nbytes(s.push([3])) > 0


def test_piece_backend_empty_piece_never_emits() -> None:
    # PieceBackend: 1->"abcd", 2->"ab", 4->"" (a zero-width piece emits nothing and raises nothing).
    tok = Tokenizer.from_str(byte_level().to_str())
    pieces = {1: "abcd", 2: "ab", 4: ""}
    profile = build_profile(tok, allow_pure=False)
    profile.pure_decode = {
        flag: (lambda ids: "".join(pieces[i] for i in ids)) for flag in (False, True)
    }
    register_profile(profile)
    s = DecodeStream(tok, [])
    assert [s.push([1]), s.push([4]), s.push([2])] == ["abcd", "", "ab"]
    assert s.flush() == ""


def test_floor_char_boundary_slicing() -> None:
    assert slice_from_byte("🎉d", 2) == "🎉d"
    assert slice_from_byte("a🎉d", 3) == "🎉d"
    assert slice_from_byte("a🎉d", 5) == "d"
    assert slice_from_byte("abc", 5) == ""


def test_flush_without_push_token_does_not_leak_prompt() -> None:
    s = stream(b("x") * 7001)
    assert s.flush() == ""


def test_flush_without_push_token_does_not_leak_undecodable_prompt_tail() -> None:
    s = stream([0xE4, 0xBD])
    assert s.flush() == ""
