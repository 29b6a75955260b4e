"""DecodeStream on the real tokenizer files (docs/decode-semantics.md, 'Tests'): chunk
invariance, oracle equality, OOV prompt ids, full-decode consistency, pure decoders equal to
`Tokenizer.decode`, and bounded windows over long invalid byte runs and long prompts."""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream
from pipeline.vocab_tables import profile_for
from tests.conftest import REAL_TOKENIZERS, real_tokenizer_path
from tests.unit.decode_oracle import OracleStream

pytestmark = pytest.mark.conformance
SETTINGS = settings(max_examples=40, deadline=None)
TEXTS = ["Hello world", " 你好𠀀", "👋🏽🏳️‍🌈", "def f(x):\n    return x", "Crème brûlée", "Привет"]


@cache
def load(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(real_tokenizer_path(name)))


def ids_strategy(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    size = tok.get_vocab_size(with_added_tokens=True)
    text_ids = st.sampled_from(TEXTS).map(lambda t: tok.encode(t, add_special_tokens=False).ids)
    return st.lists(
        st.one_of(text_ids, st.lists(st.integers(0, size - 1), max_size=3)), max_size=6
    ).map(lambda xs: [t for x in xs for t in x])


@pytest.mark.parametrize("name", REAL_TOKENIZERS)
def test_chunked_and_batched_equal_per_token_oracle(name: str) -> None:
    tok = load(name)

    @SETTINGS
    @given(ids_strategy(tok), ids_strategy(tok), st.integers(1, 7), st.booleans())
    def check(prompt, generated, size, skip) -> None:
        ref = OracleStream(tok, prompt, skip)
        cumulative, out = [], ""
        for t in generated:
            out += ref.push_token(t)
            cumulative.append(out)
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip)
        batched = DecodeStream(tok, prompt, skip_special_tokens=skip)
        text, count = "", 0
        for i in range(0, len(generated), size):
            chunk = generated[i : i + size]
            delta = stream.push(chunk)
            assert decode_round([(batched, chunk)])[0].text == delta
            text += delta
            count += len(chunk)
            assert text == cumulative[count - 1]
        tail = ref.flush()
        assert stream.flush() == tail
        assert batched.flush() == tail

    check()


# The byte-level and Llama-2 decoder chains have exact Python twins; WordPiece (bert) has none
# and always decodes through `tokenizers`.
PURE_DECODER_TOKENIZERS = ("gpt2", "llama-spm", "olmo2-dolma2", "qwen2-from-tiktoken")


def test_wordpiece_decodes_through_tokenizers() -> None:
    assert not profile_for(load("bert-base-uncased")).pure_decode


@pytest.mark.parametrize("name", PURE_DECODER_TOKENIZERS)
def test_pure_decoder_equals_tokenizers_decode(name: str) -> None:
    tok = load(name)
    profile = profile_for(tok)
    assert profile.pure_decode, f"{name} should have a pure decoder"
    rng = random.Random(0)
    size = len(profile.known)
    for skip in (False, True):
        decode = profile.pure_decode[skip]
        for _ in range(2000):
            ids = [rng.randrange(size) for _ in range(rng.randrange(12))]
            ids = [t for t in ids if profile.known[t]]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_qwen2_out_of_vocab_prompt_ids_are_filtered_and_counted() -> None:
    tok = load("qwen2-from-tiktoken")
    hello = tok.encode("Hello, world! 你好", add_special_tokens=False).ids
    oov = [151646, 151700, 151935]
    stream = DecodeStream(tok, [*hello[:2], oov[0], *hello[2:], oov[1], oov[2]])
    assert stream.push(tok.encode(" ok", add_special_tokens=False).ids) == " ok"
    assert stream.filtered_prompt_ids == [oov[1], oov[2]]
    only_oov = DecodeStream(tok, oov)
    assert only_oov.push(hello) == "Hello, world! 你好"
    assert only_oov.filtered_prompt_ids == oov


@pytest.mark.parametrize("name", ["gpt2", "olmo2-dolma2", "qwen2-from-tiktoken"])
def test_full_decode_consistency_byte_level(name: str) -> None:
    tok = load(name)
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(rng.choice(TEXTS) for _ in range(4))
        ids = tok.encode(text, add_special_tokens=False).ids
        cut = rng.randrange(1, len(ids))
        prompt, generated = ids[:cut], ids[cut:]
        if tok.decode(prompt, skip_special_tokens=True).endswith("\ufffd"):
            continue
        stream = DecodeStream(tok, prompt)
        out = "".join(stream.push(generated[i : i + 5]) for i in range(0, len(generated), 5))
        out += stream.flush()
        full = tok.decode(ids, skip_special_tokens=True).encode()
        head = tok.decode(prompt, skip_special_tokens=True).encode()
        assert out.encode() == full[len(head) :]


def test_llama_empty_token_ends_a_byte_run() -> None:
    """Llama-2's vocabulary has an empty token (""): it adds no text but, unlike a skipped
    special, still ends a byte-fallback run. Pure decoder, stream and oracle must all agree."""
    tok = load("llama-spm")
    empty = tok.get_vocab()[""]
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    ni = [byte[x] for x in "你".encode()]
    decode = profile_for(tok).pure_decode
    for skip in (False, True):
        for ids in ([ni[0], empty, *ni[1:]], [*ni, empty, *ni], [empty, 1, ni[0], 2, *ni[1:]]):
            assert decode[skip](ids) == tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode([ni[0], empty, *ni[1:]]) == "\ufffd" * 3
    rng = random.Random(2)
    pool = [empty, empty, 0, 1, 2, *ni, byte[0x80], byte[0x41], *tok.encode("Hi 你").ids]
    for _ in range(300):
        prompt = [rng.choice(pool) for _ in range(rng.randrange(8))]
        generated = [rng.choice(pool) for _ in range(rng.randrange(1, 12))]
        skip = rng.random() < 0.5
        ref = OracleStream(tok, prompt, skip)
        expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip)
        size = rng.randrange(1, 6)
        got = "".join(stream.push(generated[i : i + size]) for i in range(0, len(generated), size))
        assert got + stream.flush() == expected


def byte_id(tok: Tokenizer, value: int) -> int:
    """The id of the token spelling the single byte `value` (a `<0xNN>` token for Llama-2)."""
    profile = profile_for(tok)
    if profile.kind == "spm_byte_fallback":
        return tok.token_to_id(f"<0x{value:02X}>")
    return profile.byte_table[True].index(bytes([value]))


@pytest.mark.parametrize("name", ["llama-spm", "gpt2", "qwen2-from-tiktoken"])
@pytest.mark.parametrize("value", [0xE2, 0x80], ids=["lead", "continuation"])
@pytest.mark.parametrize("chunk", [1, 16, 32_000])
def test_long_invalid_byte_run_keeps_the_window_bounded(name: str, value: int, chunk: int) -> None:
    """Issue 16 item 13 (docs/decode-semantics.md, 'Linear cost'): 32k copies of one invalid byte.

    Before, the window grew by one id per id while the text ended in U+FFFD, so every push
    decoded the whole run (quadratic). Now the run's final text is held and the window stays a
    few ids; the text is unchanged (the full decode here, the per-token oracle below)."""
    tok = load(name)
    prompt = tok.encode("Hello world", add_special_tokens=False).ids
    bad = byte_id(tok, value)
    generated = [bad] * 32_000 + tok.encode("!", add_special_tokens=False).ids
    stream = DecodeStream(tok, prompt)
    out, largest = [], 0
    for i in range(0, len(generated), chunk):
        out.append(stream.push(generated[i : i + chunk]))
        largest = max(largest, len(stream.snapshot()["ids"]))
    out.append(stream.flush())
    assert largest <= 16
    full = tok.decode(prompt + generated, skip_special_tokens=True)
    assert "".join(out) == full[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert "".join(out).count("\ufffd") == 32_000


@pytest.mark.parametrize("name", ["llama-spm", "gpt2", "qwen2-from-tiktoken"])
def test_invalid_byte_runs_equal_the_per_token_oracle(name: str) -> None:
    tok = load(name)
    pool = [byte_id(tok, v) for v in (0xE2, 0x82, 0xAC, 0x80, 0xF0, 0x9F, 0xFF, 0xEF, 0xBF, 0xBD)]
    pool += tok.encode("a 你", add_special_tokens=False).ids
    rng = random.Random(3)
    for _ in range(40):
        prompt = [rng.choice(pool) for _ in range(rng.randrange(60))]
        generated = [rng.choice(pool) for _ in range(rng.randrange(1, 120))]
        ref = OracleStream(tok, prompt, True)
        expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
        stream = DecodeStream(tok, prompt)
        size = rng.randrange(1, 20)
        got = "".join(stream.push(generated[i : i + size]) for i in range(0, len(generated), size))
        assert got + stream.flush() == expected


@pytest.mark.parametrize("name", ["llama-spm", "gpt2", "qwen2-from-tiktoken", "bert-base-uncased"])
def test_long_prompt_snapshot_is_bounded(name: str) -> None:
    """Issue 16 item 2 (decode side): a 200k-id prompt no longer sits in the stream (and its
    snapshot) until the first push: seeding runs at construction and keeps a few ids."""
    tok = load(name)
    words = tok.encode(" ".join(TEXTS[:1] + TEXTS[4:5]), add_special_tokens=False).ids
    prompt = (words * (200_000 // len(words) + 1))[:200_000]
    stream = DecodeStream(tok, prompt)
    assert len(json.dumps(stream.snapshot())) < 1_000
    restored = DecodeStream.from_snapshot(tok, json.loads(json.dumps(stream.snapshot())))
    generated = tok.encode(" 你好 world!", add_special_tokens=False).ids
    ref = OracleStream(tok, prompt, True)
    expected = "".join(ref.push_token(t) for t in generated) + ref.flush()
    assert restored.push(generated) + restored.flush() == expected
