"""Deterministic multilingual generation logs for `detok demo` and the benchmarks.

`generations(tokenizer, model=...)` returns logged generations as plain dicts
`{"request_id", "model", "prompt_token_ids", "output_token_ids", "skip_special_tokens",
"finish_reason"}`. Documents are seeded random mixes of the paragraphs below (English prose 35 %,
code 25 %, Chinese incl. CJK Ext-B 20 %, emoji/ZWJ/flags and other scripts 20 %), encoded once and
split into prompt and generation. Split points move forward to character boundaries (a real
prompt is complete text); mid-character cases are the unit tests' job.
"""

from __future__ import annotations

import random
from typing import Any

from tokenizers import Tokenizer

PROSE = [
    "The committee met on Tuesday to review the quarterly figures, which showed a modest rise in "
    "revenue despite the slowdown in the northern region.",
    "She walked along the river at dawn, counting the herons that stood motionless in the "
    "shallows, and wondered whether the bridge would be finished before winter.",
    "Incremental detokenization turns a stream of token ids into text without ever emitting half "
    "of a character, which matters more than it sounds for languages outside ASCII.",
    "In 1887 the observatory recorded a comet whose tail, according to the logbook, stretched "
    "across nearly a quarter of the night sky.",
]
CODE = [
    "def merge(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    while a and b:\n"
    "        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
    '    println!("{:?}", v);\n}\n',
    "SELECT user_id, COUNT(*) AS n FROM events WHERE ts > NOW() - INTERVAL '1 day' "
    "GROUP BY user_id ORDER BY n DESC LIMIT 10;",
    '{"request_id": "r-17", "tokens": [15496, 995], "finish": {"reason": "stop"}}',
    'for f in *.log; do gzip -9 "$f" && echo "packed $f"; done',
    "template <typename T> T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }",
]
CJK = [
    "今天早上我们一起走向地铁站。咖啡店门口排着长队，空气里有烤面包的味道。",
    "机器学习模型的推理速度取决于批处理大小、内存带宽以及解码策略。",
    "𠀀𠀁𠀂 是扩展B区的汉字，很多字体无法显示它们，𪚥 也是。",
    "山高水长，风清月明。读书使人明智，写作使人精确。",
]
OTHER = [
    "Hi 👋🏽 — family: 👨‍👩‍👧‍👦, flags: 🇯🇵🇫🇷🇧🇷, rainbow: 🏳️‍🌈, hearts: 💙💜🖤🤍.",
    "日本語のテキスト：東京は今日も晴れです。カタカナとひらがなが混ざっています。",
    "한국어 문장입니다. 오늘 날씨가 정말 좋네요!",
    "Привет, мир! Это пример текста на русском языке.",
    "Καλημέρα κόσμε· η γλώσσα είναι ελληνική.",
    "مرحبا بالعالم، هذا نص باللغة العربية.",
    "नमस्ते दुनिया, यह हिंदी में एक वाक्य है।",
    "Crème brûlée, façade, naïve, Ångström, Zürich, São Paulo.",
]
MIX = [(PROSE, 0.35), (CODE, 0.25), (CJK, 0.20), (OTHER, 0.20)]


def _document(rng: random.Random, paragraphs: int) -> str:
    groups, weights = zip(*MIX, strict=True)
    parts = [rng.choice(rng.choices(groups, weights)[0]) for _ in range(paragraphs)]
    return "\n\n".join(parts)


def _clean_end(tokenizer: Tokenizer, ids: list[int], start: int, end: int) -> int:
    """Move `end` forward until ids[start:end] decodes without a trailing unfinished character."""
    while end < len(ids) and tokenizer.decode(ids[start:end], skip_special_tokens=True).endswith(
        "\ufffd"
    ):
        end += 1
    return end


def generations(
    tokenizer: Tokenizer,
    *,
    model: str = "model",
    requests: int = 2000,
    prompt_tokens: tuple[int, int] = (200, 1000),
    output_tokens: tuple[int, int] = (100, 500),
    seed: int = 0,
) -> list[dict[str, Any]]:
    """`requests` logged generations; the same arguments always give the same list."""
    rng = random.Random(seed)
    plans = [(rng.randint(*prompt_tokens), rng.randint(*output_tokens)) for _ in range(requests)]
    texts = []
    for prompt_len, output_len in plans:
        # ~3 tokens per paragraph word group; overshoot, then cut by tokens.
        texts.append(_document(rng, 2 + (prompt_len + output_len) // 20))
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = _eos_id(tokenizer)
    out = []
    for index, ((prompt_len, output_len), enc) in enumerate(zip(plans, encoded, strict=True)):
        ids = enc.ids
        cut = _clean_end(tokenizer, ids, 0, min(prompt_len, len(ids) - 1))
        stop = _clean_end(tokenizer, ids, cut, min(cut + output_len, len(ids)))
        output = ids[cut:stop]
        finish = "length"
        if eos is not None and rng.random() < 0.5:
            output = [*output, eos]
            finish = "stop"
        out.append(
            {
                "request_id": f"{model}-{index:05d}",
                "model": model,
                "prompt_token_ids": ids[:cut],
                "output_token_ids": output,
                "skip_special_tokens": True,
                "finish_reason": finish,
            }
        )
    return out


def _eos_id(tokenizer: Tokenizer) -> int | None:
    for token in ("</s>", "<|endoftext|>", "<|im_end|>", "[SEP]"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    return None
