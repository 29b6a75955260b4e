"""Hypothesis properties of DecodeStream and decode_round on each small tokenizer family
(docs/decode-semantics.md, 'Tests').

The reference is `OracleStream`, an independent per-token port of upstream on `Tokenizer.decode`.
Each family runs twice: with its pure Python decoder (if it has one) and through `tokenizers`
(`ffi_twin`), so both decode paths are held to the same oracle.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream, StrictDecodeError
from tests.unit.decode_oracle import FFFD, OracleStream, UnknownId
from tests.unit.small_tokenizers import (
    FAMILIES,
    UNKNOWN_ID,
    ffi_twin,
    spm_byte,
    vocab_size,
)

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIANTS = [(name, ffi) for name in FAMILIES for ffi in (False, True)]
NASTY_TEXT = ["你好", "😀", "👋🏽", "🏳️‍🌈", "𠀀", "é", " ", "Hello", "!", "\n"]


def tokenizer(name: str, ffi: bool):
    return ffi_twin(name) if ffi else FAMILIES[name]()


def token_ids(name: str, *, unknown: bool) -> st.SearchStrategy[list[int]]:
    """Mixed ids: random vocab ids, byte tokens of multi-byte text, raw (often invalid) bytes."""
    size = vocab_size(FAMILIES[name]())
    as_bytes = {"byte_level": lambda b: b, "byte_fallback": spm_byte}.get(name)
    parts = [st.lists(st.integers(0, size - 1), min_size=1, max_size=4)]
    if as_bytes is not None:
        text = st.lists(st.sampled_from(NASTY_TEXT), min_size=1, max_size=3)
        parts.append(text.map(lambda ws: [as_bytes(x) for x in "".join(ws).encode()]))
        parts.append(st.lists(st.integers(0x80, 0xFF).map(as_bytes), min_size=1, max_size=3))
    else:
        tok = FAMILIES[name]()
        parts.append(
            st.sampled_from(NASTY_TEXT).map(lambda w: tok.encode(w, add_special_tokens=False).ids)
        )
    if unknown:
        parts.append(st.just([UNKNOWN_ID]))
    return st.lists(st.one_of(parts), max_size=8).map(lambda xs: [t for x in xs for t in x])


@st.composite
def cases(draw, name: str, *, unknown_generated: bool = False):
    prompt = draw(token_ids(name, unknown=True))
    generated = draw(token_ids(name, unknown=unknown_generated))
    cuts = sorted(draw(st.lists(st.integers(0, len(generated)), max_size=6)))
    chunks = [generated[a:b] for a, b in zip([0, *cuts], [*cuts, len(generated)], strict=True)]
    return prompt, generated, chunks, draw(st.booleans())


def oracle_texts(tok, prompt, generated, skip, policy="error"):
    """Per-token reference: cumulative text after every token, and the flush tail."""
    ref = OracleStream(tok, prompt, skip, policy)
    out, cumulative = "", []
    for t in generated:
        out += ref.push_token(t)
        cumulative.append(out)
    return cumulative, ref.flush(), ref.filtered


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_chunked_equals_per_token_at_every_boundary(name: str, ffi: bool) -> None:
    tok = tokenizer(name, ffi)

    @SETTINGS
    @given(cases(name))
    def check(case) -> None:
        prompt, generated, chunks, skip = case
        cumulative, tail, filtered = oracle_texts(tok, prompt, generated, skip)
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip)
        out, count = "", 0
        for chunk in chunks:
            delta = stream.push(chunk)
            out += delta
            count += len(chunk)
            assert out == (cumulative[count - 1] if count else "")
            assert not out.endswith(FFFD)  # never a trailing unfinished char before finish
        assert out + stream.flush() == (cumulative[-1] if cumulative else "") + tail
        if generated:
            assert stream.filtered_prompt_ids == filtered

    check()


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_snapshot_restore_continues_identically(name: str, ffi: bool) -> None:
    tok = tokenizer(name, ffi)

    @SETTINGS
    @given(cases(name), st.data())
    def check(case, data) -> None:
        prompt, _, chunks, skip = case
        plain = DecodeStream(tok, prompt, skip_special_tokens=skip)
        restored = DecodeStream(tok, prompt, skip_special_tokens=skip)
        texts_plain, texts_restored = [], []
        for chunk in chunks:
            if data.draw(st.booleans()):
                snap = json.loads(json.dumps(restored.snapshot()))
                restored = DecodeStream.from_snapshot(tok, snap)
            texts_plain.append(plain.push(chunk))
            texts_restored.append(restored.push(chunk))
            # Bounded: the window never holds more than the prompt plus this stream's generation.
            assert len(restored.ids) <= len(prompt) + sum(map(len, chunks))
        if data.draw(st.booleans()):
            restored = DecodeStream.from_snapshot(tok, json.loads(json.dumps(restored.snapshot())))
        assert texts_restored == texts_plain
        assert restored.flush() == plain.flush()

    check()


@pytest.mark.parametrize(("name", "ffi"), VARIANTS)
def test_generated_unknown_ids(name: str, ffi: bool) -> None:
    tok = tokenizer(name, ffi)

    @SETTINGS
    @given(cases(name, unknown_generated=True), st.sampled_from(["error", "skip"]))
    def check(case, policy) -> None:
        prompt, generated, chunks, skip = case
        ref = OracleStream(tok, prompt, skip, policy)
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip, unknown_generated_ids=policy)
        for chunk in chunks:
            expected, failed = "", None
            for t in chunk:
                try:
                    expected += ref.push_token(t)
                except UnknownId as error:
                    failed = error.args[0]
                    break
            if failed is None:
                assert stream.push(chunk) == expected
                continue
            with pytest.raises(StrictDecodeError) as info:
                stream.push(chunk)
            assert (info.value.token_id, info.value.partial_text) == (failed, expected)
            return  # the request is failed; nothing more is pushed
        assert stream.flush() == ref.flush()

    check()


@pytest.mark.parametrize("ffi", [False, True])
def test_batch_equals_per_stream(ffi: bool) -> None:
    names = list(FAMILIES)

    @SETTINGS
    @given(
        st.lists(
            st.sampled_from(names).flatmap(
                lambda n: st.tuples(st.just(n), cases(n, unknown_generated=True))
            ),
            min_size=1,
            max_size=6,
        )
    )
    def check(requests) -> None:
        solo, batched, work_chunks = [], [], []
        for name, (prompt, _, chunks, skip) in requests:
            tok = tokenizer(name, ffi)
            solo.append(DecodeStream(tok, prompt, skip_special_tokens=skip))
            batched.append(DecodeStream(tok, prompt, skip_special_tokens=skip))
            work_chunks.append(chunks)
        alive = set(range(len(requests)))
        for round_no in range(max(len(c) for c in work_chunks)):
            work = [
                (i, work_chunks[i][round_no] if round_no < len(work_chunks[i]) else [])
                for i in sorted(alive)
            ]
            results = decode_round([(batched[i], chunk) for i, chunk in work])
            for (i, chunk), result in zip(work, results, strict=True):
                try:
                    expected, error = solo[i].push(chunk), None
                except StrictDecodeError as e:
                    expected, error = e.partial_text, e
                assert result.text == expected
                assert (result.error is None) == (error is None)
                if error is not None:
                    assert result.error.token_id == error.token_id
                    alive.discard(i)
        for i in alive:
            assert batched[i].flush() == solo[i].flush()

    check()


# Bytes that make long U+FFFD runs: lone leads, stray continuations, never-valid bytes, parts of
# a literal U+FFFD (EF BF BD) and of valid characters, next to ASCII.
RUN_BYTES = [0xE2, 0x82, 0xAC, 0x80, 0xF0, 0x9F, 0x98, 0xC3, 0xFF, 0xEF, 0xBF, 0xBD, ord("a")]


def run_ids(name: str) -> st.SearchStrategy[list[int]]:
    """Long sequences of the bytes above, a skipped special and (for Llama-2) the empty piece."""
    as_id = (lambda x: x) if name == "byte_level" else spm_byte
    extra = [256] if name == "byte_level" else [0, 1]  # "<special>" / "<unk>", "<s>"
    return st.lists(
        st.one_of(st.sampled_from(RUN_BYTES).map(as_id), st.sampled_from(extra)), max_size=80
    )


@pytest.mark.parametrize(
    ("name", "ffi"), [(n, f) for n in ("byte_level", "byte_fallback") for f in (False, True)]
)
def test_long_invalid_runs_equal_per_token_and_stay_bounded(name: str, ffi: bool) -> None:
    """docs/decode-semantics.md, 'Linear cost': a run of invalid bytes is held, not windowed."""
    tok = tokenizer(name, ffi)

    # More examples than the others: the cases that matter (a seed leaving a long tail, a run
    # crossing chunk boundaries) are a small part of the space.
    @settings(SETTINGS, max_examples=400)
    @given(run_ids(name), run_ids(name), st.lists(st.integers(0, 80), max_size=8), st.booleans())
    @example([229, 133, 133, *[0] * 9, 229, 0, 0, 0], [133], [], True)  # a 16-id seeded window
    def check(prompt, generated, cuts, skip) -> None:
        cuts = sorted(c for c in cuts if c <= len(generated))
        chunks = [generated[a:b] for a, b in zip([0, *cuts], [*cuts, len(generated)], strict=True)]
        cumulative, tail, _ = oracle_texts(tok, prompt, generated, skip)
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip)
        # A prompt ending mid-character keeps its clean head as context until the first
        # emission (docs/decode-semantics.md, 'A prompt ending mid-character'): with skipped
        # specials around the unfinished character that is more than 16 ids, and it is the
        # prompt's (at most its last 64 ids), not a cost that grows with the generation.
        seeded = len(stream.ids)
        out, count = "", 0
        for chunk in chunks:
            out += stream.push(chunk)
            count += len(chunk)
            assert out == (cumulative[count - 1] if count else "")
            if not ffi:
                # Pure strategies cut the window behind final text; the generic path cannot.
                assert len(stream.ids) - (0 if out else seeded) <= 16
            if data_roundtrip := json.loads(json.dumps(stream.snapshot())):
                stream = DecodeStream.from_snapshot(tok, data_roundtrip)
        assert out + stream.flush() == (cumulative[-1] if cumulative else "") + tail

    check()
