"""DecodeStream edge cases by example (docs/decode-semantics.md, 'Tests'), on every small decoder
family with its pure decoder and through `tokenizers` (`ffi_twin`).

- malformed ids are `InvalidTokenIdError`, never `OverflowError`/`TypeError` from `tokenizers`,
  and a rejected chunk changes no state;
- a long prompt with nothing generated emits nothing at flush;
- a prompt ending mid-character emits the straddling character once, whole;
- the window (and so the snapshot) stays bounded over a long generation, over a long run of
  invalid bytes, and whatever the prompt's length;
- a malformed snapshot is a `SnapshotFormatError`.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream, InvalidTokenIdError, SnapshotFormatError
from tests.unit.decode_oracle import OracleStream
from tests.unit.small_tokenizers import (
    FAMILIES,
    UNKNOWN_ID,
    byte_fallback,
    byte_level,
    ffi_twin,
    spm_byte,
)

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


def _byte(name: str):
    return (lambda x: x) if name == "byte_level" else spm_byte


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("value", [0xE2, 0x80, 0xFF])
@pytest.mark.parametrize("chunk", [1, 7, 32_000])
def test_invalid_byte_run_keeps_the_window_bounded(name: str, value: int, chunk: int) -> None:
    """Issue 16 item 13: a run of 32k invalid bytes is held text, not a 32k-id window."""
    tok = tokenizer(name, False)
    as_id = _byte(name)
    # Text pieces, not byte tokens: a byte run would merge into the generated one.
    prompt = (
        text_ids(tok, "Hello world")
        if name == "byte_level"
        else [tok.token_to_id("▁Hello"), tok.token_to_id("▁world")]
    )
    generated = [as_id(value)] * 32_000 + text_ids(tok, "!")
    stream = DecodeStream(tok, prompt)
    out, largest = [], 0
    for i in range(0, len(generated), chunk):
        out.append(stream.push(generated[i : i + chunk]))
        largest = max(largest, len(stream.snapshot()["ids"]))
    assert largest <= 16
    text = "".join(out) + stream.flush()
    assert text == tok.decode(prompt + generated)[len(tok.decode(prompt)) :]
    assert text.count("\ufffd") == 32_000 and text.endswith("!")


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_long_prompt_gives_a_bounded_snapshot(name: str, ffi: bool) -> None:
    """Issue 16 item 2 (decode side): seeding runs at construction, so a 200k-id prompt leaves
    only the few ids seeding keeps, before and after a push, and the same text."""
    tok = tokenizer(name, ffi)
    word = text_ids(tok, "hello world")
    prompt = (word * 100_000)[:200_000]
    stream = DecodeStream(tok, prompt)
    assert len(json.dumps(stream.snapshot())) < 1_000
    generated = text_ids(tok, "hello world")
    ref = OracleStream(tok, prompt, True)
    expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
    restored = DecodeStream.from_snapshot(tok, json.loads(json.dumps(stream.snapshot())))
    assert restored.push(generated) + restored.flush() == expected


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize(
    "tail", [[0xE2] * 40, [0xFF] * 40, [0xF0, 0x9F]], ids=["lead", "never-valid", "cut"]
)
def test_long_prompt_with_an_unseedable_tail_gives_a_bounded_snapshot(
    name: str, tail: list[int]
) -> None:
    """The full-prompt seeding fallback (no clean 4-6 id suffix) keeps only the prompt's last
    text piece or unfinished bytes on the byte strategies, not the prompt."""
    tok = tokenizer(name, False)
    as_id = _byte(name)
    prompt = (text_ids(tok, "hello world the") * 20_000)[:200_000] + [as_id(b) for b in tail]
    generated = [as_id(b) for b in "🌶!".encode()[len(tail) if len(tail) < 4 else 0 :]]
    stream = DecodeStream(tok, prompt)
    assert len(json.dumps(stream.snapshot())) < 1_000
    ref = OracleStream(tok, prompt, True)
    expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
    assert stream.push(generated) + stream.flush() == expected


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        "snapshot",
        {},
        {"version": 3},
        {"version": True},
        {"version": 2, "skip_special_tokens": True},
        {"version": 2, "skip_special_tokens": 1, "unknown_generated_ids": "error"},
        {"version": 2, "skip_special_tokens": True, "unknown_generated_ids": "ignore"},
    ],
    ids=repr,
)
def test_malformed_snapshot_is_a_snapshot_format_error(bad: object) -> None:
    with pytest.raises(SnapshotFormatError):
        DecodeStream.from_snapshot(byte_level(), bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ids", [-1]),
        ("ids", ["7"]),
        ("ids", None),
        ("prefix", 3),
        ("prefix_index", 99),
        ("prefix_index", "0"),
        ("started", "yes"),
        ("held", None),
        ("filtered_prompt_ids", [2**40]),
    ],
)
def test_snapshot_with_a_bad_field_is_a_snapshot_format_error(field: str, value: object) -> None:
    tok = byte_level()
    data = DecodeStream(tok, text_ids(tok, "Hello world")).snapshot()
    assert DecodeStream.from_snapshot(tok, dict(data)).snapshot() == data
    with pytest.raises(SnapshotFormatError):
        DecodeStream.from_snapshot(tok, {**data, field: value})
    missing = dict(data)
    del missing[field]
    with pytest.raises(SnapshotFormatError):
        DecodeStream.from_snapshot(tok, missing)


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_version_1_snapshots_still_restore(name: str, ffi: bool) -> None:
    """Changelogs written before seeding moved to construction: an unseeded version 1 snapshot
    carries its prompt and is seeded on restore; a seeded one maps field for field."""
    tok = tokenizer(name, ffi)
    prompt, generated = text_ids(tok, "hello world the"), text_ids(tok, "hello world")
    expected = DecodeStream(tok, prompt).push(generated)
    unseeded = {
        "version": 1,
        "skip_special_tokens": True,
        "unknown_generated_ids": "error",
        "ids": prompt,
        "prefix": "",
        "prefix_index": 0,
        "prefix_seeded": False,
        "filtered_prompt_ids": [],
    }
    assert DecodeStream.from_snapshot(tok, unseeded).push(generated) == expected
    seeded = DecodeStream(tok, prompt).snapshot()
    seeded["version"], seeded["prefix_seeded"] = 1, seeded.pop("started")
    del seeded["held"]
    assert DecodeStream.from_snapshot(tok, seeded).push(generated) == expected


def test_filtered_prompt_ids_are_reported_once_a_token_was_pushed() -> None:
    """Seeding runs at construction, but a request that generates nothing reports no filtered
    prompt ids, as when seeding ran at the first push."""
    tok = byte_level()
    prompt = [UNKNOWN_ID, *text_ids(tok, "Hi")]
    stream = DecodeStream(tok, prompt)
    assert stream.filtered_prompt_ids == []
    assert stream.push([]) == ""
    assert stream.filtered_prompt_ids == []
    assert stream.push(text_ids(tok, "!")) == "!"
    assert stream.filtered_prompt_ids == [UNKNOWN_ID]
