"""Chat-output parsing benchmark: the parser's cost against plain decoding, in one run.

For generations of about 1k, 8k and 32k tokens (reasoning, a short answer, then three hermes
tool calls with long arguments; Qwen3's format, markers spelled as text on the qwen2 tokenizer
unless `--markers-as-tokens`), in chunks of `--chunk` ids (16: the shape token events arrive
in; 1: one id per event):
  (d)  plain decode: `DecodeStream.push` per chunk;
  (dp) decode + parse: the same, each text delta fed to `ChatParser` (qwen3 + hermes), finish;
  (p)  parse alone over (d)'s deltas: chars/s and tokens/s.
Times are the process's CPU time (`time.process_time`: the machine is shared, and wall time
there measures the neighbours), medians over repeats in rotating order, gc off; dp/d is the
median of per-repeat ratios of tokens/s. Linear growth shows as a parse cost per token that
does not grow with the size (it falls, as the per-stream costs spread). The parse result is
checked once per size (three calls, reasoning, content). No timing is asserted.

    python -m bench.bench_chat [--shared-dir ../shared] [--chunk 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from pipeline.chat import ChatParser, reasoning_format, tool_format
from pipeline.decode_stream import DecodeStream

PROSE = (
    "the a of to and in is that for it with as on be by this are or from at which have an "
    "was not but can all we if will more one there their has would so about out what when "
    "function value result tool city weather 東京 Zürich café naïve 你好 👋🏽"
)
WORDS = [*PROSE.split(), "x = f(y) + 1;", "return {key: [1, 2]}", '"quoted"', "\\", "a < b\n"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def generation(tok: Tokenizer, tokens: int, seed: int = 0) -> tuple[str, list[int]]:
    """About `tokens` ids: 70% reasoning, 5% answer, 25% in three calls' arguments."""
    rng = random.Random(seed)
    per_word = len(tok.encode(prose(rng, 400), add_special_tokens=False).ids) / 400
    words = int(tokens / per_word)
    calls = "".join(
        f'<tool_call>\n{{"name": "run_{i}", "arguments": {{"path": "/tmp/f{i}", '
        f'"code": {json_string(prose(rng, words // 12))}}}}}\n</tool_call>\n'
        for i in range(3)
    )
    text = f"<think>\n{prose(rng, words * 7 // 10)}\n</think>\n\n{prose(rng, words // 20)}\n{calls}"
    return text, tok.encode(text, add_special_tokens=False).ids


def json_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def decode(tok: Tokenizer, chunks: list[list[int]]) -> list[str]:
    stream = DecodeStream(tok, [], skip_special_tokens=False)
    deltas = [stream.push(chunk) for chunk in chunks]
    deltas.append(stream.flush())
    return deltas


def new_parser() -> ChatParser:
    return ChatParser(
        reasoning_format("qwen3"), tool_format("hermes"), request_id="bench", offers_tools=True
    )


def decode_and_parse(tok: Tokenizer, chunks: list[list[int]]) -> list[str]:
    stream, parser = DecodeStream(tok, [], skip_special_tokens=False), new_parser()
    for chunk in chunks:
        parser.feed(stream.push(chunk))
    parser.feed(stream.flush())
    parser.finish()
    return []


def parse_only(deltas: list[str]) -> Callable[[], object]:
    def run() -> object:
        parser = new_parser()
        for delta in deltas:
            parser.feed(delta)
        return parser.finish()[1]

    return run


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        fn()
        return time.process_time() - start
    finally:
        gc.enable()


def bench_size(tok: Tokenizer, size: int, chunk: int, repeats: int) -> dict[str, float]:
    text, ids = generation(tok, size)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    deltas = decode(tok, chunks)
    result = parse_only(deltas)()
    assert len(result.tool_calls) == 3 and result.reasoning and result.content, result
    methods = {
        "d": lambda: decode(tok, chunks),
        "dp": lambda: decode_and_parse(tok, chunks),
        "p": parse_only(deltas),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(repeats):
        order = list(methods)[repeat % 3 :] + list(methods)[: repeat % 3]
        for name in order:
            times[name].append(timed(methods[name]))
    n, chars = len(ids), len("".join(deltas))
    ratios = [d / dp for d, dp in zip(times["d"], times["dp"], strict=True)]
    p = statistics.median(times["p"])
    return {
        "tokens": n,
        "chars": chars,
        "d_tok_s": n / statistics.median(times["d"]),
        "dp_tok_s": n / statistics.median(times["dp"]),
        "dp_over_d": statistics.median(ratios),
        "p_tok_s": n / p,
        "p_chars_s": chars / p,
        "p_us_per_token": p / n * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_shared = Path(__file__).resolve().parents[1].parent / "shared"
    parser.add_argument("--shared-dir", type=Path, default=default_shared)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sizes", default="1000,8000,32000")
    parser.add_argument("--markers-as-tokens", action="store_true")
    args = parser.parse_args()
    tok = Tokenizer.from_file(
        str(args.shared_dir / "tokenizers/qwen2-from-tiktoken/tokenizer.json")
    )
    if args.markers_as_tokens:
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    spelled = "added tokens" if args.markers_as_tokens else "text"
    print(f"qwen2-from-tiktoken, markers as {spelled}, chunks of {args.chunk} ids, "
          f"{args.repeats} repeats (medians)")  # fmt: skip
    print(f"{'tokens':>7} {'chars':>8} {'d tok/s':>10} {'d+p tok/s':>10} {'(dp)/(d)':>8} "
          f"{'p tok/s':>10} {'p chars/s':>11} {'p us/tok':>8}")  # fmt: skip
    for size in map(int, args.sizes.split(",")):
        r = bench_size(tok, size, args.chunk, args.repeats)
        print(f"{r['tokens']:>7} {r['chars']:>8} {r['d_tok_s']:>10,.0f} {r['dp_tok_s']:>10,.0f} "
              f"{r['dp_over_d']:>8.2f} {r['p_tok_s']:>10,.0f} {r['p_chars_s']:>11,.0f} "
              f"{r['p_us_per_token']:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
