"""Regenerate `examples/generations.jsonl`, the small sample `detok run` is shown on.

Run from the repo root with the shared tokenizers beside the clone:
    python examples/make_sample.py ../shared/tokenizers > examples/generations.jsonl
It covers the cases a user meets first: plain English, code, CJK and emoji, a prompt cut in the
middle of a character, Qwen prompt ids outside the tokenizer vocabulary (filtered and counted),
a generated id outside it (a strict-decode failure), an unknown model and a malformed line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

TEXTS = [
    (
        "Write a haiku about Kafka.",
        " Logs flow like rivers,\nordered by partition keys,\ncommitted at last.",
    ),
    ("def add(a, b):", "\n    return a + b\n\nprint(add(2, 3))  # 5\n"),
    ("请用中文回答：天空为什么是蓝色的？", "因为瑞利散射：短波长的蓝光被大气分子散射得更多。🌤️"),
    ("Emoji test:", " 👩‍💻 ships 🚀 at 🕛 — naïve café, résumé, 𠀀𠀁."),
    ("Translate 'good morning' to Japanese.", " おはようございます (ohayō gozaimasu)."),
]


def main(tokenizer_dir: Path) -> None:
    gpt2 = Tokenizer.from_file(str(tokenizer_dir / "gpt2" / "tokenizer.json"))
    qwen = Tokenizer.from_file(str(tokenizer_dir / "qwen2-from-tiktoken" / "tokenizer.json"))
    lines = []
    for index, (prompt, output) in enumerate(TEXTS):
        for name, tok in (("gpt2", gpt2), ("qwen2", qwen)):
            lines.append(
                {
                    "request_id": f"{name}-{index}",
                    "model": name,
                    "prompt_token_ids": tok.encode(prompt, add_special_tokens=False).ids,
                    "output_token_ids": tok.encode(output, add_special_tokens=False).ids,
                    "finish_reason": "stop",
                }
            )
    # A prompt that ends inside a character: its first byte tokens are in the prompt.
    ids = gpt2.encode("Hot pepper: 🌶 and more", add_special_tokens=False).ids
    cut = next(
        i for i in range(1, len(ids)) if "\ufffd" in gpt2.decode(ids[:i], skip_special_tokens=True)
    )
    lines.append(
        {
            "request_id": "gpt2-mid-char",
            "model": "gpt2",
            "prompt_token_ids": ids[:cut],
            "output_token_ids": ids[cut:],
            "finish_reason": "length",
        }
    )
    # Qwen2 models have 151,936 embedding rows but the tokenizer maps 151,646 ids.
    prompt = qwen.encode("<|im_start|>user\nHi there<|im_end|>", add_special_tokens=False).ids
    lines.append(
        {
            "request_id": "qwen2-oov-prompt",
            "model": "qwen2",
            "prompt_token_ids": [151700, *prompt[:3], 151935, *prompt[3:]],
            "output_token_ids": qwen.encode("Hello! How can I help?", add_special_tokens=False).ids,
            "finish_reason": "stop",
        }
    )
    good = qwen.encode("This text stops at a bad id", add_special_tokens=False).ids
    lines.append(
        {
            "request_id": "qwen2-strict-failure",
            "model": "qwen2",
            "prompt_token_ids": prompt,
            "output_token_ids": [*good, 151800, *good],
            "finish_reason": "stop",
        }
    )
    lines.append(
        {
            "request_id": "unknown-model",
            "model": "llama-9000",
            "prompt_token_ids": [1, 2, 3],
            "output_token_ids": [4, 5],
        }
    )
    out = [json.dumps(line, ensure_ascii=False) for line in lines]
    out.insert(5, '{"request_id": "broken", "model": "gpt2", "prompt_token_ids": [1, 2,')
    print("\n".join(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
