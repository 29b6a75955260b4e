"""Regenerate `examples/chat-generations.jsonl`, the sample the chat outputs are shown on
(docs/chat-outputs.md): Qwen-style generations whose text holds reasoning and tool calls.

Run from the repo root with the shared tokenizers beside the clone:
    python examples/make_chat_sample.py ../shared/tokenizers > examples/chat-generations.jsonl
The markers are spelled as plain text (the shared qwen2 tokenizer does not have Qwen3's added
tokens), which the parsers read the same way. Decode it with `--reasoning-parser qwen2=qwen3
--tool-parser qwen2=hermes`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# (request id, prompt, output, tools offered)
SAMPLES = [
    # Reasoning, then a call: content "\n\n", finish_reason "tool_calls".
    ("weather-call", "What is the weather in Paris?",
     f"The user wants the weather; call get_weather.</think>\n\n{CALL}", [WEATHER]),
    # Reasoning, then an answer, no tools offered.
    ("greeting", "Say hello.", "<think>\nA greeting.\n</think>\n\nHello!", None),
    # The same call text in a request that offers no tools: it stays content.
    ("no-tools", "Show a tool call.", f"Here is one.</think>{CALL}", None),
    # The chat template ended the prompt in <think>: the output starts inside reasoning.
    ("open-think", "<|im_start|>assistant\n<think>\n", "Two plus two.</think>4", None),
]  # fmt: skip


def main(tokenizer_dir: Path) -> None:
    qwen = Tokenizer.from_file(str(tokenizer_dir / "qwen2-from-tiktoken" / "tokenizer.json"))
    for request_id, prompt, output, tools in SAMPLES:
        line = {
            "request_id": request_id,
            "model": "qwen2",
            "prompt_token_ids": qwen.encode(prompt, add_special_tokens=False).ids,
            "output_token_ids": qwen.encode(output, add_special_tokens=False).ids,
            "finish_reason": "stop",
        }
        if tools is not None:
            line["tools"] = tools
        print(json.dumps(line, ensure_ascii=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
