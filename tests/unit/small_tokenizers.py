"""Small real `tokenizers.Tokenizer`s built in code, one per decoder family (test helpers).

Each is a genuine `Tokenizer`, so the stream exercises the same `decode`/`decode_batch` as in
production. Unknown ids: everything at or above the vocabulary (10_000 is the upstream probe).
"""

from __future__ import annotations

from functools import cache

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pipeline.vocab_tables import GPT2_CHAR_TO_BYTE, build_profile, register_profile

UNKNOWN_ID = 10_000

# Byte-level: ids 0..255 are the bytes; added tokens from 256 (upstream's TestTokenizer;
# docs/decode-semantics.md, 'Tests').
BL_SPECIAL = 256  # "<special>", special
BL_IM_END = 257  # "<|im_end|>", special
BL_THINK = 258  # "<think>", added, not special


@cache
def byte_level() -> Tokenizer:
    """The Python twin of upstream's `TestTokenizer`: id b <-> byte b, ByteLevel decoder."""
    byte_char = {b: c for c, b in GPT2_CHAR_TO_BYTE.items()}
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<special>", special=True)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<think>", special=False)])
    assert tok.token_to_id("<think>") == BL_THINK
    return tok


SPM_PIECES = [
    "<unk>", "<s>", "</s>", "▁", "▁Hello", "▁world", "▁the", "ing", "s", "a", "b", "!", ".",
    "你", "好", "▁你", "😀", "é", "x", "▁▁",
]  # fmt: skip


@cache
def metaspace() -> Tokenizer:
    """SentencePiece-like (Metaspace decoder, prepend "always"): the first piece loses its space."""
    vocab = {piece: i for i, piece in enumerate(SPM_PIECES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens([AddedToken("<think>", special=False)])
    return tok


@cache
def byte_fallback() -> Tokenizer:
    """Llama-2 style: `<0xNN>` byte tokens at 3..258, the Replace/ByteFallback/Fuse/Strip chain."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES[3:]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens([AddedToken("<think>", special=False)])
    return tok


def spm_byte(b: int) -> int:
    """The id of the `<0xNN>` token for byte b in `byte_fallback()`."""
    return 3 + b


WORDPIECE_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "##ing", "un", "##able", ".",
    ",", "!", "'", "你", "好", "the", "##e", "a", "?",
]  # fmt: skip


@cache
def wordpiece() -> Tokenizer:
    """BERT-like: `##` continuation pieces, cleanup of spaces before punctuation."""
    vocab = {piece: i for i, piece in enumerate(WORDPIECE_VOCAB)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    return tok


@cache
def ffi_twin(name: str) -> Tokenizer:
    """A copy of a small tokenizer whose streams always decode through `tokenizers` (no pure
    Python decoder), so both paths can be compared."""
    tok = Tokenizer.from_str(FAMILIES[name]().to_str())
    register_profile(build_profile(tok, allow_pure=False))
    return tok


FAMILIES = {
    "byte_level": byte_level,
    "metaspace": metaspace,
    "byte_fallback": byte_fallback,
    "wordpiece": wordpiece,
}


def vocab_size(tok: Tokenizer) -> int:
    return tok.get_vocab_size(with_added_tokens=True)
