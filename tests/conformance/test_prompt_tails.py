"""Prompt tails on the real tokenizers (docs/production-shapes.md, 'Prompt tails'; issue 15 item 1).

Seeding reads only the last `PROMPT_CONTEXT_IDS` (64) prompt ids, so a prompt event carrying
that tail and the full count (`prompt_tokens`) must give exactly what the whole prompt gives:
the text at every chunk, the flush, the filtered ids and the counts in the completion. The
prompts are built to hit every seeding path: clean text (the 4..6-id sweep), endings inside a
character and runs of continuation bytes (every suffix has a U+FFFD: the fallback and its
mid-character search), and out-of-vocabulary ids (filtered, and fewer than 4 known ids left).

The second property holds the bound to upstream: reading only the last 64 ids seeds as decoding
the whole prompt does (upstream's fallback). On the byte-level tokenizers that is exact for every
prompt (lossy UTF-8 decides from the last few bytes and the mid-character search probes at most
32 heads); on llama-spm it holds over these prompt shapes.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pipeline.decode_stream import PROMPT_CONTEXT_IDS, DecodeStream
from pipeline.processor import RequestProcessor
from pipeline.tokenizer_registry import TokenizerRegistry
from pipeline.vocab_tables import profile_for
from schemas.fast_events import ParsedFinish, ParsedPrompt, ParsedTokens
from tests.conftest import real_tokenizer_path
from tests.unit.decode_oracle import OracleStream
from tests.unit.request_events import origin

pytestmark = pytest.mark.conformance
SETTINGS = settings(max_examples=40, deadline=None)
TAIL_TOKENIZERS = {"gpt2": "gpt2", "llama-spm": "llama-spm", "qwen2": "qwen2-from-tiktoken"}
SEED_AS_UPSTREAM = ("gpt2", "qwen2", "llama-spm")
TEXTS = ["Hello world", " 你好𠀀", "👋🏽🏳️‍🌈", "def f(x):\n    return x", "Crème brûlée", "。"]


@cache
def load(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(real_tokenizer_path(TAIL_TOKENIZERS[name])))


@cache
def byte_ids(name: str) -> dict[int, int]:
    """byte value -> an id spelling exactly that byte (GPT-2 symbols or `<0xNN>` pieces)."""
    profile = profile_for(load(name))
    table = profile.byte_table[True] if profile.kind == "byte_level" else profile.spm_table[True]
    found: dict[int, int] = {}
    for i, piece in enumerate(table):
        if piece is not None and len(piece) == 1:
            found.setdefault(piece[0], i)
    return found


def pieces(name: str) -> st.SearchStrategy[list[int]]:
    """Runs of ids: real text, bytes of a character cut short, continuation bytes, unknown ids."""
    tok = load(name)
    size = tok.get_vocab_size(with_added_tokens=True)
    spelled = byte_ids(name)
    text = st.sampled_from(TEXTS).map(lambda t: tok.encode(t, add_special_tokens=False).ids)
    cut = st.sampled_from(["你", "𠀀", "👋", "é"]).flatmap(
        lambda c: st.integers(1, len(c.encode()) - 1).map(
            lambda k: [spelled[b] for b in c.encode()[:k]]
        )
    )
    continuation = st.lists(st.integers(0x80, 0xBF), min_size=1, max_size=12).map(
        lambda bs: [spelled[b] for b in bs if b in spelled]
    )
    unknown = st.lists(st.integers(size, size + 300), min_size=1, max_size=8)
    random_ids = st.lists(st.integers(0, size - 1), max_size=3)
    return st.one_of(text, cut, continuation, unknown, random_ids)


def prompts(name: str) -> st.SearchStrategy[list[int]]:
    """Prompts of 0 to a few hundred ids, most longer than the 64 seeding reads."""
    return st.lists(pieces(name), max_size=40).map(lambda xs: [t for x in xs for t in x])


def known_only(tok: Tokenizer, ids: list[int]) -> list[int]:
    known = profile_for(tok).known
    return [t for t in ids if t < len(known) and known[t]]


def registry(name: str) -> TokenizerRegistry:
    return TokenizerRegistry.from_specs([f"{name}={real_tokenizer_path(TAIL_TOKENIZERS[name])}"])


def run(processor: RequestProcessor, prompt: ParsedPrompt, generated: list[int], size: int):
    events = [prompt]
    chunks = [generated[i : i + size] for i in range(0, len(generated), size)]
    events += [ParsedTokens(request_id="r", seq=s, token_ids=c) for s, c in enumerate(chunks, 1)]
    events.append(ParsedFinish(request_id="r", seq=len(events)))
    deltas, completions, filtered = [], [], []
    for event in events:  # one event per batch: every chunk boundary is compared
        result = processor.process([(event, origin(0, event))])
        deltas += [(d.text_offset, d.text) for d in result.deltas]
        completions += result.completions
        filtered += result.filtered_ids
    return deltas, completions, filtered


@pytest.mark.parametrize("name", sorted(TAIL_TOKENIZERS))
def test_a_64_id_tail_with_its_count_equals_the_whole_prompt(name: str) -> None:
    tok = load(name)
    models = registry(name)

    @SETTINGS
    @given(prompts(name), prompts(name), st.integers(1, 7), st.booleans())
    def check(prompt: list[int], generated: list[int], size: int, skip: bool) -> None:
        whole = ParsedPrompt(
            request_id="r", model=name, prompt_token_ids=prompt, skip_special_tokens=skip
        )
        tail = ParsedPrompt(
            request_id="r",
            model=name,
            prompt_token_ids=prompt[-PROMPT_CONTEXT_IDS:],
            skip_special_tokens=skip,
            prompt_tokens=len(prompt),
        )
        generated = known_only(tok, generated)  # the strict policy fails unknown ids
        expected = run(RequestProcessor(models), whole, generated, size)
        got = run(RequestProcessor(models), tail, generated, size)
        assert got == expected
        (completion,) = got[1]
        assert completion.prompt_tokens == len(prompt)
        assert all(record.prompt_tokens == len(prompt) for record in got[2])

    check()


@pytest.mark.parametrize("name", SEED_AS_UPSTREAM)
def test_reading_64_ids_seeds_as_upstream_reads_the_whole_prompt(name: str) -> None:
    tok = load(name)

    @SETTINGS
    @given(prompts(name), prompts(name), st.booleans())
    def check(prompt: list[int], generated: list[int], skip: bool) -> None:
        generated = known_only(tok, generated)
        upstream = OracleStream(tok, prompt, skip, context_ids=None)
        expected = "".join(upstream.push_token(t) for t in generated) + upstream.flush()
        stream = DecodeStream(tok, prompt, skip_special_tokens=skip)
        assert stream.push(generated) + stream.flush() == expected

    check()


def test_a_tail_keeps_the_filtered_ids_of_the_ids_seeding_reads() -> None:
    """The filtered-id record of a tail: the unknown ids among the ids seeding read, as for the
    whole prompt; unknown ids before them were never read, whole or tail."""
    tok = load("qwen2")
    size = tok.get_vocab_size(with_added_tokens=True)
    words = tok.encode(" the sky is blue", add_special_tokens=False).ids
    cut = [byte_ids("qwen2")[b] for b in "你".encode()[:2]]
    prompt = [size + 1] * 100 + words * 20 + [size + 2, size + 3] + cut + [size + 4] * 3
    generated = [byte_ids("qwen2")[b] for b in "你".encode()[2:]] + words
    for sent in (prompt, prompt[-PROMPT_CONTEXT_IDS:]):
        stream = DecodeStream(tok, sent)
        assert stream.push(generated) == "你" + " the sky is blue"
        assert stream.filtered_prompt_ids == [size + 2, size + 3, size + 4, size + 4, size + 4]
