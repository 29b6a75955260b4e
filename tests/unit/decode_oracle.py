"""An independent per-token reference for DecodeStream, on `Tokenizer.decode`
(docs/decode-semantics.md, 'Seeding', 'Pushing', 'Flush').

Line-by-line the upstream Rust algorithm (`seed_prefix`, `push_token`, `flush`) plus the prompt-tail
fix and the bound on what seeding reads (the last 64 prompt ids; `context_ids=None` reads the whole
prompt, as upstream), with none of the production code's chunking, probes, pure decoders or prefix
reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

FFFD = "\ufffd"
PROMPT_CONTEXT_IDS = 64


class UnknownId(Exception):
    pass


def _slice(text: str, n: int) -> str:
    raw = text.encode()
    if n >= len(raw):
        return ""
    while n > 0 and (raw[n] & 0xC0) == 0x80:
        n -= 1
    return raw[n:].decode()


class OracleStream:
    def __init__(
        self,
        tok: Tokenizer,
        prompt: Sequence[int],
        skip: bool,
        policy: str = "error",
        context_ids: int | None = PROMPT_CONTEXT_IDS,
    ):
        self.tok, self.skip, self.policy = tok, skip, policy
        self.ids = list(prompt) if context_ids is None else list(prompt)[-context_ids:]
        self.prefix, self.prefix_index = "", 0
        self.seeded = not self.ids
        self.filtered: list[int] = []

    def dec(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip)

    def known(self, t: int) -> bool:
        return self.tok.id_to_token(t) is not None

    def context(self, ids: list[int]) -> tuple[str, list[int]]:
        ctx = [t for t in ids if self.known(t)]
        return self.dec(ctx), ctx

    def seed(self) -> None:
        n = len(self.ids)
        if n > 4:
            for length in range(4, min(6, n - 1) + 1):
                suffix = self.ids[n - length :]
                d, ctx = self.context(suffix)
                if FFFD not in d and len(ctx) >= 4:
                    self.filtered = [t for t in suffix if not self.known(t)]
                    self.prefix, self.ids, self.prefix_index = d, ctx, len(ctx)
                    return
        d, ctx = self.context(self.ids)
        self.filtered = [t for t in self.ids if not self.known(t)]
        self.ids = ctx
        if not d.endswith(FFFD):
            self.prefix, self.prefix_index = d, len(ctx)
            return
        for m in range(len(ctx) - 1, max(-1, len(ctx) - 33), -1):
            dm = self.dec(ctx[:m])
            if not dm.endswith(FFFD):
                self.prefix, self.prefix_index = dm, m
                return
        self.prefix, self.prefix_index = d, len(ctx)

    def push_token(self, t: int) -> str:
        if not self.seeded and self.ids:
            self.seed()
        self.seeded = True
        if not self.known(t):
            if self.policy == "skip":
                return ""
            raise UnknownId(t)
        self.ids.append(t)
        s = self.dec(self.ids)
        pl = len(self.prefix.encode())
        if len(s.encode()) <= pl or s.endswith(FFFD):
            return ""
        new = _slice(s, pl)
        del self.ids[: self.prefix_index]
        self.prefix = self.dec(self.ids)
        self.prefix_index = len(self.ids)
        return new

    def flush(self) -> str:
        tail = ""
        if self.seeded and self.ids:
            tail = _slice(self.dec(self.ids), len(self.prefix.encode()))
        self.ids, self.prefix, self.prefix_index, self.seeded = [], "", 0, True
        return tail
