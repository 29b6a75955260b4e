"""Logprob entries: each sampled token's string, bytes and text in context, and its alternatives.

A request's logprobs are kept as flat columns on its state (`pipeline.request_state`): the
sampled ids, their logprobs, the alternatives exactly as parsed, and where each token's text
starts in the request's text. Only output builds entries, and only as the wire record holds
them: each entry is its `TokenLogprob` JSON (`LogprobEntry`, a `msgspec.Raw`), written once and
shared by the delta that carries it and the completion, whose encoders copy it as is. Building
the pydantic models instead (an entry and one per alternative: six a token at top-5) and
encoding them twice cost ~18x the token's decode; `Logprobs.entries()` still gives the models
to whoever reads them, and the tests hold this JSON equal to the models' own dump.

Per id, what a token is alone does not depend on the request, so `token_prefix` encodes it once
per tokenizer and caches it on the tokenizer's profile (`vocab_tables.TokenizerProfile`):
- `token`: the id decoded alone with special tokens shown;
- `bytes`: the exact bytes of its piece: through the byte map for byte-level BPE, the byte of a
  `<0xNN>` byte-fallback piece, otherwise the UTF-8 of its piece with the metaspace `▁` as a
  space (what the piece contributes before a decoder strips or joins anything).
A token's `text` is what it added to the completion in context (`decode_stream.push_each`):
empty while a character is incomplete, the whole character on the token that completes it, and
the finish flush on the last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pipeline.vocab_tables import TokenizerProfile, byte_fallback_value
from schemas.events import Logprobs, encode_json

METASPACE = "\u2581"

# One `TokenLogprob` as its wire JSON: what deltas and completions carry (see module doc).
LogprobEntry = msgspec.Raw


def token_prefix(profile: TokenizerProfile, token_id: int) -> bytes:
    """`{"id":N,"token":...,"bytes":[...]` of one id (an unknown id: token "", no bytes): the
    start both a `TokenLogprob` and a `TopLogprob` share, cached per tokenizer."""
    cache = profile.token_info
    prefix = cache.get(token_id)
    if prefix is None:
        token, raw = token_info(profile, token_id)
        prefix = cache[token_id] = b'{"id":%d,"token":%s,"bytes":%s' % (
            token_id,
            encode_json(token),
            encode_json(list(raw)),
        )
    return prefix


def token_info(profile: TokenizerProfile, token_id: int) -> tuple[str, bytes]:
    """(`token`, `bytes`) of one id alone, uncached; an unknown id is ("", b"")."""
    tokenizer = profile.tokenizer
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return "", b""
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    if profile.kind == "byte_level":
        return token, profile.byte_table[False][token_id] or b""
    value = byte_fallback_value(piece)
    return token, bytes([value]) if value is not None else piece.replace(METASPACE, " ").encode()


def check_alternatives(top_logprobs: Sequence[Sequence[tuple[int, float]]], limit: int) -> int:
    """The first alternative id >= `limit` (outside the tokenizer and the model), else -1."""
    for pairs in top_logprobs:
        for pair in pairs:
            if pair[0] >= limit:
                return pair[0]
    return -1


def build_entries(
    profile: TokenizerProfile,
    ids: Sequence[int],
    values: Sequence[float],
    tops: Sequence[Sequence[Sequence[Any]]],
    offsets: Sequence[int],
    first: int,
    last: int,
    tail: str,
    tail_start: int,
    cut: int,
) -> list[LogprobEntry]:
    """The entries of tokens `first..last-1`.

    `tail` is the request's text from character `tail_start` (<= `offsets[first]`) on; a
    token's text runs from its offset to the next token's (the last token's: to the end of the
    text, so the finish flush is its), cut at `cut`, the completion's length.

    Floats are written by the one JSON encoder every record uses (`encode_json`, a list at a
    time: a float's JSON has no comma), so a logprob reads back as the same double and a
    non-finite one is `null`, as in every other record.
    """
    if last <= first:
        return []
    values_json = encode_json(values[first:last])[1:-1].split(b",")
    alternatives_json = encode_json([pair[1] for pairs in tops[first:last] for pair in pairs])
    alt_values = alternatives_json[1:-1].split(b",") if len(alternatives_json) > 2 else []
    entries = []
    count = len(offsets)
    end_of_text = tail_start + len(tail)
    cached = profile.token_info.get
    position = 0
    for index in range(first, last):
        start = min(offsets[index], cut)
        end = min(offsets[index + 1] if index + 1 < count else end_of_text, cut)
        token_id = ids[index]
        # One join of the entry's pieces: a format per alternative cost a fifth more.
        parts = [
            cached(token_id) or token_prefix(profile, token_id),
            b',"text":',
            encode_json(tail[start - tail_start : end - tail_start]),
            b',"text_offset":%d,"logprob":' % start,
            values_json[index - first],
            b',"top_logprobs":[',
        ]
        pairs = tops[index]
        for pair in pairs:
            alt_id = pair[0]
            parts += (
                cached(alt_id) or token_prefix(profile, alt_id),
                b',"logprob":',
                alt_values[position],
                b"},",
            )
            position += 1
        if pairs:
            parts[-1] = b"}]}"  # the last alternative's "}," closes the list and the entry
        else:
            parts.append(b"]}")
        entries.append(LogprobEntry(b"".join(parts)))
    return entries


def logprobs_model(entries: list[LogprobEntry]) -> Logprobs:
    """The completion's `Logprobs` of entries `build_entries` made (kept as their JSON)."""
    return Logprobs.model_construct(content=entries)
