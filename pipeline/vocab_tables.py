"""Per-tokenizer lookup tables, built once and shared by every stream of that tokenizer.

Building these walks the whole vocabulary (150k+ ids for Qwen), which costs tens of milliseconds:
fine once per tokenizer, far too slow once per request. `profile_for` therefore caches one
`TokenizerProfile` per tokenizer object. The cache is keyed by `id(tokenizer)` and holds a strong
reference to the tokenizer, so an id can never be recycled for a different object while its
entry lives. Tokenizers are long-lived (one per model in the registry), so the cache stays tiny.

Besides the known-id table (strictness is ours: `Tokenizer.decode` silently drops unknown ids),
a profile may carry a *pure decoder*: a Python function proven (by tests over every single id and
random sequences, on toy and real tokenizers) to return exactly what `Tokenizer.decode` returns,
without an FFI call. Two decoder families get one:

- a top-level `ByteLevel` decoder (GPT-2, Qwen, Llama-3, OLMo): decode is lossy UTF-8 over the
  concatenated bytes of the tokens, a pure function of the bytes (docs/decode-semantics.md,
  'ByteLevel');
- the Llama-2 SentencePiece chain `Sequence[Replace(▁→' '), ByteFallback, Fuse, Strip(' ',1,0)]`.

Every other decoder (Metaspace, WordPiece, ...) goes through `Tokenizer.decode`/`decode_batch`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenizers import Tokenizer

FFFD = "\ufffd"

DecoderKind = Literal["byte_level", "spm_byte_fallback", "ffi"]

# The exact decoder JSON of Llama-2 style SentencePiece tokenizers (llama-spm, TinyLlama,
# Mistral v1).
# Only this exact chain is emulated; any variation (other Strip counts, extra steps) uses the FFI.
_SPM_BYTE_FALLBACK_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode` table, inverted: the char spelling each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


GPT2_CHAR_TO_BYTE = _gpt2_unicode_to_byte()
# The same table for `str.translate`: each GPT-2 char becomes the Latin-1 char of its byte, and
# every other char below 256 becomes U+FFFF, so the Latin-1 encoding that follows fails exactly
# when some char is outside the table (chars from U+0100 up that the table lacks stay as they
# are, and fail it too). Both steps run in C: a worker's start walked Qwen's 151k tokens in
# ~0.45 s char by char in Python, this way in a tenth of that.
_GPT2_TRANSLATION = {
    **{code: "\uffff" for code in range(256)},
    **{ord(c): chr(b) for c, b in GPT2_CHAR_TO_BYTE.items()},
}


def byte_level_token_bytes(token: str) -> bytes:
    """The bytes a `ByteLevel` decoder produces for one token (tokenizers `byte_level.rs`).

    Each char maps through the GPT-2 table; if any char is outside it, the token's raw UTF-8 is
    used instead (that is how added tokens such as `<think>` written in plain text survive).
    """
    try:
        return token.translate(_GPT2_TRANSLATION).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def byte_fallback_value(token: str) -> int | None:
    """The byte of a `<0xNN>` token as tokenizers' ByteFallback decoder parses it, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


@dataclass(eq=False)
class TokenizerProfile:
    """What a stream needs to know about its tokenizer, computed once per tokenizer.

    `has_byte_fallback` marks decoders whose output is not append-monotonic when a byte run is
    invalid: a stream then steps per token through any chunk whose decode holds a U+FFFD.
    `known[i]` is 1 iff `tokenizer.id_to_token(i)` is not None, for 0 <= i < len(known); ids
    beyond are unknown. `pure_decode[skip]` is the FFI-free decoder for that `skip_special_tokens`
    flag, or absent when the decoder family has none. `reuse_prefix` says the decoder is context
    independent (top-level ByteLevel), so the text of the last emission *is* the decode of its ids
    and the second decode per emission can be skipped (docs/decode-semantics.md, 'ByteLevel';
    vLLM #46723).
    """

    tokenizer: Tokenizer
    known: bytearray
    special_ids: frozenset[int]
    kind: DecoderKind
    reuse_prefix: bool
    has_byte_fallback: bool
    pure_decode: dict[bool, Callable[[Sequence[int]], str]]
    # byte_token[i] == 1 iff id i is a `<0xNN>` byte-fallback token.
    byte_token: bytearray
    # id -> bytes of the token under each skip flag (None = unknown); ByteLevel only.
    byte_table: dict[bool, list[bytes | None]]
    # id -> the token's UTF-8 piece after Replace(▁→' ') (a `<0xNN>` token: its one byte; a
    # skipped special: b""; an empty token: EMPTY_TOKEN_PIECE; None = unknown) under each skip
    # flag; Llama-2 chain only. The chain's output is the strict decode of the pieces'
    # concatenation whenever that is valid UTF-8.
    spm_table: dict[bool, list[bytes | None]]
    # The stream class of each skip flag, specialized on first use by `pipeline.decode_stream`
    # (its class attributes are this tokenizer's tables, shared by every stream of it).
    strategies: dict[bool, Any] = field(default_factory=dict)
    # id -> the JSON start of its logprob entries (the id decoded alone, the bytes of its
    # piece), filled as logprob output meets ids (`pipeline.logprobs.token_prefix`): a full
    # walk would cost every tokenizer 150k decodes.
    token_info: dict[int, bytes] = field(default_factory=dict)


# Keyed by id(tokenizer); read directly by `DecodeStream` construction (a hit costs no call).
PROFILES: dict[int, TokenizerProfile] = {}
_LOCK = threading.Lock()


def profile_for(tokenizer: Tokenizer) -> TokenizerProfile:
    """The cached profile of `tokenizer`, built on first use."""
    profile = PROFILES.get(id(tokenizer))
    if profile is None:
        with _LOCK:
            profile = PROFILES.get(id(tokenizer))
            if profile is None:
                profile = build_profile(tokenizer)
                PROFILES[id(tokenizer)] = profile
    return profile


def register_profile(profile: TokenizerProfile) -> None:
    """Install a profile explicitly (tests force the FFI path on a pure-decodable tokenizer)."""
    with _LOCK:
        PROFILES[id(profile.tokenizer)] = profile


def build_profile(tokenizer: Tokenizer, *, allow_pure: bool = True) -> TokenizerProfile:
    """Walk the vocabulary once and pick the decoder family."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    known = bytearray(size)
    tokens: list[str | None] = [None] * size
    for token, i in vocab.items():
        known[i] = 1
        tokens[i] = token
    added = tokenizer.get_added_tokens_decoder()
    for i in added:
        # What decode sees: `get_vocab` lists an added token's content, but for a `normalized`
        # added token `id_to_token` (and decode) use the normalized form, e.g. "▁<think>".
        tokens[i] = tokenizer.id_to_token(i)
    special_ids = frozenset(i for i, token in added.items() if token.special)
    decoder = None if tokenizer.decoder is None else json.loads(tokenizer.decoder.__getstate__())
    kind: DecoderKind = "ffi"
    pure: dict[bool, Callable[[Sequence[int]], str]] = {}
    byte_table: dict[bool, list[bytes | None]] = {}
    spm_table: dict[bool, list[bytes | None]] = {}
    if allow_pure and decoder is not None and decoder.get("type") == "ByteLevel":
        kind = "byte_level"
        kept = [None if t is None else byte_level_token_bytes(t) for t in tokens]
        skipped = list(kept)
        for i in special_ids:
            skipped[i] = b""
        byte_table = {False: kept, True: skipped}
        pure = {skip: _byte_level_decoder(table) for skip, table in byte_table.items()}
    elif allow_pure and decoder == _SPM_BYTE_FALLBACK_DECODER:
        kind = "spm_byte_fallback"
        for skip in (False, True):
            skipped = special_ids if skip else frozenset()
            spm_table[skip] = _spm_pieces(tokens, skipped)
            pure[skip] = _spm_byte_fallback_decoder(tokens, spm_table[skip])
    byte_token = bytearray(size)
    for i, token in enumerate(tokens):
        if token is not None and byte_fallback_value(token) is not None:
            byte_token[i] = 1
    return TokenizerProfile(
        tokenizer=tokenizer,
        byte_token=byte_token,
        known=known,
        special_ids=special_ids,
        kind=kind,
        reuse_prefix=kind == "byte_level",
        has_byte_fallback="ByteFallback" in json.dumps(decoder),
        pure_decode=pure,
        byte_table=byte_table,
        spm_table=spm_table,
    )


def _byte_level_decoder(table: list[bytes | None]) -> Callable[[Sequence[int]], str]:
    """`decode` for a top-level ByteLevel decoder: lossy UTF-8 of the concatenated token bytes.

    Python's `bytes.decode("utf-8", "replace")` matches Rust's `String::from_utf8_lossy`
    (docs/decode-semantics.md, 'ByteLevel'); the tests re-check it on every tokenizer. Callers
    pass only known ids.
    """
    lookup = table.__getitem__

    def decode(ids: Sequence[int]) -> str:
        return b"".join(map(lookup, ids)).decode("utf-8", "replace")

    return decode


# The piece of an empty token (Llama-2 has one, id 31353). It adds no text, but unlike a skipped
# special it is still a token in the chain, so it ends a byte run: "<0xE4>", "", "<0xBD><0xA0>"
# decodes to three U+FFFD, not "你". A byte that is never valid UTF-8 makes every concatenation
# holding it fail the strict decode, so exactly those sequences take the per-run slow path.
EMPTY_TOKEN_PIECE = b"\xff"


def _spm_pieces(tokens: list[str | None], skipped: frozenset[int]) -> list[bytes | None]:
    """The `spm_table` of one skip flag (see `TokenizerProfile`)."""
    pieces: list[bytes | None] = []
    for i, token in enumerate(tokens):
        if token is None:
            pieces.append(None)
        elif i in skipped:
            pieces.append(b"")
        elif not token:
            pieces.append(EMPTY_TOKEN_PIECE)
        else:
            value = byte_fallback_value(token)
            pieces.append(bytes([value]) if value is not None else token.replace("▁", " ").encode())
    return pieces


def _spm_byte_fallback_decoder(
    tokens: list[str | None], pieces: list[bytes | None]
) -> Callable[[Sequence[int]], str]:
    """`decode` for Sequence[Replace(▁→' '), ByteFallback, Fuse, Strip(' ', 1, 0)].

    The chain, per token: `▁` becomes a space; a run of consecutive `<0xNN>` tokens becomes its
    bytes decoded as UTF-8 if the *whole run* is valid, else one U+FFFD per byte token
    (tokenizers `byte_fallback.rs`); everything is concatenated and one leading space is stripped.
    Skipped special tokens vanish before the decoder runs, so byte runs around them merge.

    Fast path: every piece as UTF-8 bytes (byte tokens as their byte) and one strict decode. Text
    pieces are complete UTF-8, so the concatenation is valid iff every byte run is, and then it
    equals the chain's output. Only an invalid or unfinished run takes the per-run slow path.
    """
    byte_of: list[int] = []  # the byte of a (not skipped) `<0xNN>` token, or -1
    for token, piece in zip(tokens, pieces, strict=True):
        value = byte_fallback_value(token) if token is not None and piece else None
        byte_of.append(-1 if value is None else value)
    lookup = pieces.__getitem__

    def slow(ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        run_tokens = 0
        for i in ids:
            value = byte_of[i]
            if value >= 0:
                run.append(value)
                run_tokens += 1
                continue
            piece = pieces[i]
            if not piece:  # skipped special: invisible, does not break a byte run
                continue
            if run_tokens:
                out.append(_finish_run(run, run_tokens))
                run.clear()
                run_tokens = 0
            if piece != EMPTY_TOKEN_PIECE:  # an empty token only ends the run
                out.append(piece.decode("utf-8"))
        if run_tokens:
            out.append(_finish_run(run, run_tokens))
        return "".join(out)

    def decode(ids: Sequence[int]) -> str:
        raw = b"".join(map(lookup, ids))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = slow(ids)
        return text[1:] if text[:1] == " " else text

    return decode


def _finish_run(run: bytearray, run_tokens: int) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return FFFD * run_tokens
