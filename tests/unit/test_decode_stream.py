"""DecodeStream edge cases by example (spec §10.7, §10.17), on every small decoder family with its
pure decoder and through `tokenizers` (`ffi_twin`).

- malformed ids are `InvalidTokenIdError`, never `OverflowError`/`TypeError` from `tokenizers`,
  and a rejected chunk changes no state;
- a long prompt with nothing generated emits nothing at flush;
- a prompt ending mid-character emits the straddling character once, whole;
- the window (and so the snapshot) stays bounded over a long generation.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream, InvalidTokenIdError
from tests.unit.decode_oracle import OracleStream
from tests.unit.small_tokenizers import FAMILIES, byte_fallback, byte_level, ffi_twin, spm_byte

VARIANTS = [(name, ffi) for name in FAMILIES for ffi in (False, True)]
MALFORMED = [-1, -(2**40), 2**32, 2**64, 1.5, "7", None, b"\x01"]


def tokenizer(name: str, ffi: bool) -> Tokenizer:
    return ffi_twin(name) if ffi else FAMILIES[name]()


def text_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
@pytest.mark.parametrize("bad", MALFORMED, ids=repr)
def test_malformed_ids_are_invalid_token_id_errors(name: str, ffi: bool, bad: object) -> None:
    tok = tokenizer(name, ffi)
    hello = text_ids(tok, "hello")
    with pytest.raises(InvalidTokenIdError):
        DecodeStream(tok, [*hello, bad])  # type: ignore[list-item]
    stream = DecodeStream(tok, hello)
    twin = DecodeStream(tok, hello)
    for chunk in ([bad], [*hello, bad], [bad, *hello]):
        with pytest.raises(InvalidTokenIdError):
            stream.push(chunk)  # type: ignore[arg-type]
        (result,) = decode_round([(stream, chunk)])  # type: ignore[list-item]
        assert (result.text, type(result.error)) == ("", InvalidTokenIdError)
    # Nothing of the rejected chunks stuck: the stream behaves exactly like its twin.
    assert stream.snapshot() == twin.snapshot()
    assert stream.push(hello) == twin.push(hello)
    assert stream.flush() == twin.flush()


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_long_prompt_and_nothing_generated_flushes_nothing(name: str, ffi: bool) -> None:
    tok = tokenizer(name, ffi)
    word = text_ids(tok, "hello")
    prompt = (word * 7001)[:7001]
    assert DecodeStream(tok, prompt).flush() == ""
    stream = DecodeStream(tok, prompt)
    assert decode_round([(stream, [])])[0].text == ""
    assert stream.push([]) == ""
    assert stream.flush() == ""


def straddling_cases() -> list[tuple[str, Tokenizer, list[int], list[int]]]:
    """(name, tokenizer, prompt ending inside 🌶, generated ids completing it then "!")."""
    pepper = "🌶".encode()
    cases = []
    for name, tok, as_id in (
        ("byte_level", byte_level(), lambda x: x),
        ("byte_level-ffi", ffi_twin("byte_level"), lambda x: x),
        ("byte_fallback", byte_fallback(), spm_byte),
        ("byte_fallback-ffi", ffi_twin("byte_fallback"), spm_byte),
    ):
        bang = as_id(ord("!"))
        for cut in (1, 2, 3):
            prompt = text_ids(tok, "Hello world") + [as_id(x) for x in pepper[:cut]]
            generated = [as_id(x) for x in pepper[cut:]] + [bang]
            cases.append((f"{name}-cut{cut}", tok, prompt, generated))
    return cases


@pytest.mark.parametrize(
    ("tok", "prompt", "generated"),
    [pytest.param(tok, p, g, id=name) for name, tok, p, g in straddling_cases()],
)
@pytest.mark.parametrize("chunk_size", [1, 2, 16])
def test_prompt_ending_mid_character_emits_it_once_whole(
    tok: Tokenizer, prompt: list[int], generated: list[int], chunk_size: int
) -> None:
    stream = DecodeStream(tok, prompt)
    deltas = [
        stream.push(generated[i : i + chunk_size]) for i in range(0, len(generated), chunk_size)
    ]
    assert "".join(deltas) + stream.flush() == "🌶!"
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_snapshot_stays_bounded_over_a_long_generation(name: str, ffi: bool) -> None:
    tok = tokenizer(name, ffi)
    prompt = text_ids(tok, "hello world the")
    if name in ("byte_level", "byte_fallback"):
        as_id = (lambda x: x) if name == "byte_level" else spm_byte
        # Multi-byte characters as raw byte tokens, so chunks often end mid-character.
        piece = text_ids(tok, "Hello world! ") + [as_id(x) for x in "你好😀é ".encode()]
    else:
        piece = text_ids(tok, "hello world the a b")
    generated = piece * (20_000 // len(piece))
    stream = DecodeStream(tok, prompt)
    out = []
    largest = 0
    for i in range(0, len(generated), 16):
        out.append(stream.push(generated[i : i + 16]))
        largest = max(largest, len(stream.snapshot()["ids"]))
    out.append(stream.flush())
    # The window is the context of the last emission plus ids not emitted yet: a few chunks'
    # worth at most, never the generation (20,000 ids).
    assert largest <= 64
    assert len(json.dumps(stream.snapshot())) < 1_000
    whole = DecodeStream(tok, prompt)
    assert "".join(out) == whole.push(generated) + whole.flush()


@pytest.mark.parametrize("ffi", [False, True])
def test_byte_run_continued_across_a_skipped_special(ffi: bool) -> None:
    """Regression (found by hypothesis): a chunk ending "byte tokens, skipped special" still ends
    inside a byte run, so a later invalid byte turns into as many U+FFFD as per-token pushing
    gives, not one per byte token of the whole chunk."""
    tok = tokenizer("byte_fallback", ffi)
    flag = "🏳️‍🌈".encode()
    generated = [0, 0, *map(spm_byte, flag), 0, spm_byte(0x80)]  # 0 = "<unk>", a special
    ref = OracleStream(tok, [], True)
    expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
    stream = DecodeStream(tok, [])
    got = stream.push(generated[:-1]) + stream.push(generated[-1:]) + stream.flush()
    # Per-token pushing's window holds 🌈's 4 byte tokens; the invalid byte extends that run, so
    # the 5-token run decodes to 5 U+FFFD, of which 4 lie beyond the 4-byte prefix (upstream).
    assert got == expected == "🏳️‍🌈" + "\ufffd" * 4
