"""Logprob entries: each sampled token's string, bytes and text in context, and its alternatives.

A request's logprobs are kept as flat columns (`pipeline.request_state.LogprobColumns`): the
sampled ids, their logprobs, the alternatives exactly as parsed, and where each token's text
starts in the request's text. Only output builds per-token objects, and only what the wire
record holds (`schemas.events.TokenLogprob`, as plain dicts in field order: a delta is encoded
straight from them; a completion validates them once into its models).

Per id, what a token is alone does not depend on the request, so `token_info` computes it once
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
from typing import Any, TypeVar

from pydantic import BaseModel

from pipeline.vocab_tables import TokenizerProfile, byte_fallback_value
from schemas.events import Logprobs, TokenLogprob, TopLogprob

M = TypeVar("M", bound=BaseModel)

METASPACE = "\u2581"

TokenInfo = tuple[str, list[int]]


def token_info(profile: TokenizerProfile, token_id: int) -> TokenInfo:
    """(`token`, `bytes`) of one id, cached per tokenizer; an unknown id is ("", [])."""
    cache = profile.token_info
    info = cache.get(token_id)
    if info is None:
        info = cache[token_id] = _token_info(profile, token_id)
    return info


def _token_info(profile: TokenizerProfile, token_id: int) -> TokenInfo:
    tokenizer = profile.tokenizer
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return "", []
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    if profile.kind == "byte_level":
        raw = profile.byte_table[False][token_id] or b""
    else:
        value = byte_fallback_value(piece)
        raw = bytes([value]) if value is not None else piece.replace(METASPACE, " ").encode()
    return token, list(raw)


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
) -> list[dict[str, Any]]:
    """The entries of tokens `first..last-1` (plain dicts, `TokenLogprob` field order).

    `tail` is the request's text from character `tail_start` (<= `offsets[first]`) on; a
    token's text runs from its offset to the next token's (the last token's: to the end of the
    text, so the finish flush is its), cut at `cut`, the completion's length.
    """
    entries = []
    count = len(offsets)
    end_of_text = tail_start + len(tail)
    cached = profile.token_info.get
    for index in range(first, last):
        start = min(offsets[index], cut)
        end = min(offsets[index + 1] if index + 1 < count else end_of_text, cut)
        token_id = ids[index]
        token, raw = cached(token_id) or token_info(profile, token_id)
        alternatives = []
        for alt_id, alt_logprob in tops[index]:
            alt_token, alt_raw = cached(alt_id) or token_info(profile, alt_id)
            alternatives.append(
                {"id": alt_id, "token": alt_token, "bytes": alt_raw, "logprob": alt_logprob}
            )
        entries.append(
            {
                "id": token_id,
                "token": token,
                "bytes": raw,
                "text": tail[start - tail_start : end - tail_start],
                "text_offset": start,
                "logprob": values[index],
                "top_logprobs": alternatives,
            }
        )
    return entries


def logprobs_model(entries: list[dict[str, Any]]) -> Logprobs:
    """The completion's `Logprobs` from entries `build_entries` made.

    The entries are built here from validated input with the models' exact field types, so
    they are wrapped as they are, as `model_construct` would (without its per-field Python
    work): validating them again cost more than the whole decode of a request. The tests
    hold the result equal to a validated copy.
    """
    content = [
        _trusted(
            TokenLogprob,
            {**entry, "top_logprobs": [_trusted(TopLogprob, a) for a in entry["top_logprobs"]]},
        )
        for entry in entries
    ]
    return _trusted(Logprobs, {"content": content})


_set = object.__setattr__
_new = object.__new__
# Every field is set, so every instance of a model shares its field-name set (never mutated:
# `model_copy` copies it).
_FIELDS_SET = {model: set(model.model_fields) for model in (Logprobs, TokenLogprob, TopLogprob)}


def _trusted(model: type[M], fields: dict[str, Any]) -> M:
    """An instance of `model` whose fields are `fields` (every field, in declaration order)."""
    instance = _new(model)
    _set(instance, "__dict__", fields)
    _set(instance, "__pydantic_fields_set__", _FIELDS_SET[model])
    _set(instance, "__pydantic_extra__", None)
    _set(instance, "__pydantic_private__", None)
    return instance
