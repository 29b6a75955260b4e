"""Decode-core benchmark: streaming methods vs the library's non-streaming limit, in one run.

Methods (tokens/s = generated tokens / wall time, median over repeats in rotating order, gc off;
ratios are medians of per-repeat time ratios):
  (a) HF `tokenizers.decoders.DecodeStream`, primed by step() over the vLLM V1 "safe place to
      start" suffix (shortest of 5..23 prompt ids decoding without U+FFFD), stepped per token;
  (b) our `DecodeStream.push` per request, 16-id chunks;
  (c) our `decode_round`, continuous rounds over `--active` requests, refilled as they finish;
  (d) one `decode_batch` over all full generations (no streaming: the library's limit).
Every method gets its input in the shape it consumes, prepared outside the timings: (a) and (d)
the generation lists, (b) and (c) the generations already split into 16-id chunks (the shape token
events arrive in). Outputs of (b) and (c) are checked equal for every request, and (b) against
(a). No timing is asserted anywhere.

`--compare-with TREE` also loads (b) and (c) from another checkout's `pipeline` package (e.g. a
`git worktree add /tmp/base <commit>` of the code before a change) and times them in the same
rotation, as (b0) and (c0): before/after figures from one run, paired per repeat.

`--decode-options` adds the whole `RequestProcessor` (sequencing, decode, deltas, completions)
over the same requests as events, in continuous rounds of `--active` requests (docs/decode-
options.md): (p) no options, (ps) four stop strings per request (ones the workload never
completes, so every request runs its full length and the row measures matching and hold-back),
(pl) top-5 logprobs on every token; with `--compare-with`, (p0), (ps0) and (pl0) are (p), (ps)
and (pl) on the other tree. Every processor row encodes its deltas and completions as the worker
writes them (an option's cost includes its output records). Ratios to (p) are paired per
repeat; (ps) must give (p)'s completions exactly.

`--chat` adds the chat-output stage (docs/chat-outputs.md): generations of about 1k, 8k and
32k tokens (bench/bench_chat.py's: reasoning, a short answer, three hermes tool calls with long
arguments; qwen2, markers spelled as text), `--chat-copies` requests of each at once, through
the whole `RequestProcessor` in 16-id events: (pp) no parsers, (pc) `qwen3` + `hermes` with
tools offered, paired per repeat. It prints both rates, (pc)/(pp) (the issue's aim: at least
0.8 at 32k) and the parse cost per token, (t(pc) - t(pp)) / tokens, which stays flat when the
cost is linear in the text. Process CPU time, medians.

    python -m bench.bench_core [--shared-dir ../shared] [--tokenizers gpt2,llama-spm] [--json]
                               [--compare-with /tmp/base] [--decode-options] [--chat]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import compress, zip_longest
from operator import attrgetter
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream as HFDecodeStream

from bench.bench_chat import generation
from bench.workload import generations
from pipeline.batch import decode_round
from pipeline.chat import ChatParsers
from pipeline.decode_stream import DecodeStream
from pipeline.processor import RequestProcessor
from pipeline.results import EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import dump_json
from schemas.fast_events import (
    ParsedEvent,
    ParsedFinish,
    ParsedFunction,
    ParsedPrompt,
    ParsedTokens,
    ParsedTool,
)

CHUNK = 16
# Issue 2's targets for (c), the batched path: at least half of (d) and 4x (a).
TARGET_TO_D = 0.5
TARGET_TO_A = 4.0
# Issue 13's aim for (ps): stop strings at no less than 80% of the processor's no-option rate.
TARGET_STOP_TO_P = 0.8
# Stop strings the workload's text never completes, though it holds their first characters
# ("\n" in code, "<" in templates, "#", "O"), so matching and hold-back both run.
BENCH_STOPS = ["\n\nHuman:", "<|endoftext|>", "###", "Observation:"]
TOP_LOGPROBS = 5


def chunks_of(ids: list[int], size: int = CHUNK) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def method_hf_stream(tok: Tokenizer, reqs: list[dict[str, Any]]) -> list[str]:
    outs = []
    for r in reqs:
        prompt = r["prompt_token_ids"]
        skip = r["skip_special_tokens"]
        start = 0
        for n in range(5, min(len(prompt) + 1, 24)):
            if "\ufffd" not in tok.decode(prompt[-n:], skip_special_tokens=skip):
                start = len(prompt) - n
                break
        stream = HFDecodeStream(skip_special_tokens=skip)
        for t in prompt[start:]:
            stream.step(tok, t)
        parts = []
        for t in r["output_token_ids"]:
            piece = stream.step(tok, t)
            if piece:
                parts.append(piece)
        outs.append("".join(parts))
    return outs


def method_push(
    tok: Tokenizer,
    reqs: list[dict[str, Any]],
    chunked: list[list[list[int]]],
    stream_class: Any = DecodeStream,
) -> list[str]:
    outs = []
    for r, chunks in zip(reqs, chunked, strict=True):
        stream = stream_class(
            tok, r["prompt_token_ids"], skip_special_tokens=r["skip_special_tokens"]
        )
        parts = [stream.push(c) for c in chunks]
        parts.append(stream.flush())
        outs.append("".join(parts))
    return outs


def method_batched(
    tok: Tokenizer,
    reqs: list[dict[str, Any]],
    chunked: list[list[list[int]]],
    active: int,
    stream_class: Any = DecodeStream,
    round_function: Callable[..., Any] = decode_round,
) -> list[str]:
    """Continuous batching as a worker would run it: each round pushes the next chunk of every
    live request, finished requests are flushed and replaced from the queue. The bookkeeping is
    kept in parallel lists so the harness costs little next to what it measures."""
    outs: list[list[str]] = [[] for _ in reqs]
    queue = iter(range(len(reqs)))
    streams: list[Any] = []
    feeds: list[Iterator[list[int]]] = []  # each live request's remaining chunks
    sinks: list[list[str]] = []  # each live request's output parts
    ends: list[int] = []  # the round each live request has no chunk left in
    round_no = 0

    def admit() -> None:
        for i in queue:
            r = reqs[i]
            streams.append(
                stream_class(
                    tok, r["prompt_token_ids"], skip_special_tokens=r["skip_special_tokens"]
                )
            )
            feeds.append(iter(chunked[i]))
            sinks.append(outs[i])
            ends.append(round_no + len(chunked[i]))
            if len(streams) >= active:
                return

    admit()
    while streams:
        results = round_function(list(zip(streams, map(next, feeds), strict=True)))
        # sink.append(result.text) for every live request, without a Python-level loop.
        deque(map(list.append, sinks, map(attrgetter("text"), results)), maxlen=0)
        round_no += 1
        if min(ends) == round_no:
            keep = [end != round_no for end in ends]
            for stream, sink, live in zip(streams, sinks, keep, strict=True):
                if not live:
                    sink.append(stream.flush())
            for column in (streams, feeds, sinks, ends):
                column[:] = compress(column, keep)  # type: ignore[call-overload]
            admit()
    return ["".join(o) for o in outs]


def processor_rounds(
    reqs: list[dict[str, Any]],
    active: int,
    stop: list[str] | None,
    logprobs: bool,
    vocab: int = 1,
    chunk: int = CHUNK,
) -> list[list[tuple[ParsedEvent, EventOrigin]]]:
    """The requests as the batches a worker would hand its processor: windows of `active`
    requests, each round one event (of `chunk` ids) of every request in the window (built
    outside timings). With `logprobs`, every token gets its logprob and TOP_LOGPROBS
    alternatives below `vocab`."""
    origin = EventOrigin("bench", 0, 0, b"")
    rounds = []
    for start in range(0, len(reqs), active):
        streams = []
        for index, r in enumerate(reqs[start : start + active], start=start):
            request_id = f"r{index}"
            events: list[ParsedEvent] = [
                ParsedPrompt(
                    request_id=request_id,
                    model="m",
                    prompt_token_ids=r["prompt_token_ids"],
                    skip_special_tokens=r["skip_special_tokens"],
                    stop=stop,
                )
            ]
            for ids in chunks_of(r["output_token_ids"], chunk):
                events.append(
                    ParsedTokens(
                        request_id=request_id,
                        seq=len(events),
                        token_ids=ids,
                        logprobs=[-0.25] * len(ids) if logprobs else None,
                        top_logprobs=(
                            [
                                [((t + k) % vocab, -0.5 - k) for k in range(TOP_LOGPROBS)]
                                for t in ids
                            ]
                            if logprobs
                            else None
                        ),
                    )
                )
            events.append(ParsedFinish(request_id=request_id, seq=len(events)))
            streams.append(events)
        for round_events in zip_longest(*streams):
            rounds.append([(e, origin) for e in round_events if e is not None])
    return rounds


def processed(processor: RequestProcessor, batch: list) -> list[Any]:
    """One batch through `processor`, its deltas and completions encoded as the worker writes
    them (an option's cost includes its output records); the completions."""
    result = processor.process(batch)
    for delta in result.deltas:
        delta.to_wire_json()
    for completion in result.completions:
        dump_json(completion)
    return result.completions


def method_processor(
    registry: TokenizerRegistry,
    rounds: list[list[tuple[ParsedEvent, EventOrigin]]],
    requests: int,
    processor_class: Any = RequestProcessor,
) -> list[str]:
    processor = processor_class(registry)
    texts: dict[str, str] = {}
    stopped = 0
    for batch in rounds:
        for completion in processed(processor, batch):
            if completion.status != "ok":
                raise SystemExit(f"bench request failed: {completion.error}")
            texts[completion.request_id] = completion.text
            stopped += getattr(completion, "stop_reason", None) is not None
    if stopped:
        raise SystemExit(f"{stopped} bench requests stopped: BENCH_STOPS must never complete")
    return [texts[f"r{i}"] for i in range(requests)]


def method_decode_batch(tok: Tokenizer, reqs: list[dict[str, Any]]) -> list[str]:
    return tok.decode_batch([r["output_token_ids"] for r in reqs], skip_special_tokens=True)


def timed(
    fn: Callable[[], list[str]], clock: Callable[[], float] = time.perf_counter
) -> tuple[float, list[str]]:
    gc.collect()
    gc.disable()
    try:
        t0 = clock()
        out = fn()
        return clock() - t0, out
    finally:
        gc.enable()


def paired_ratio(reference: list[float], method: list[float]) -> float:
    """Median over repeats of t(reference) / t(method), both timed in the same repeat: a load
    spike on a busy host then hits both sides of a ratio instead of skewing it."""
    return statistics.median(r / m for r, m in zip(reference, method, strict=True))


def load_pipeline(tree: Path) -> tuple[Any, Callable[..., Any], Any]:
    """`DecodeStream`, `decode_round` and `RequestProcessor` of another checkout's `pipeline`,
    loaded beside ours.

    Our `pipeline` modules are set aside while the other tree's are imported (their absolute
    `pipeline.` imports then resolve inside that tree), and put back after: both versions live
    in this process, each module keeping its own globals and caches.
    """

    def ours() -> dict[str, Any]:
        return {n: m for n, m in sys.modules.items() if n.split(".")[0] == "pipeline"}

    saved = ours()
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        stream_module = importlib.import_module("pipeline.decode_stream")
        batch_module = importlib.import_module("pipeline.batch")
        processor_module = importlib.import_module("pipeline.processor")
        for strategy in ("decode_byte_level", "decode_reference", "decode_spm"):
            importlib.import_module(f"pipeline.{strategy}")
    finally:
        sys.path.remove(str(tree))
        theirs = ours()
        for name in theirs:
            del sys.modules[name]
        sys.modules.update(saved)
    if not Path(stream_module.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"--compare-with {tree}: its pipeline package was not the one loaded")
    # `stream_class_for` imports the strategy modules when it first builds a class: that import
    # must find the other tree's modules, or its streams would be built from ours.
    build_class = stream_module.stream_class_for

    def stream_class_for(tokenizer: Tokenizer, skip_special_tokens: bool) -> Any:
        current = ours()
        sys.modules.update(theirs)
        try:
            return build_class(tokenizer, skip_special_tokens)
        finally:
            sys.modules.update(current)

    stream_module.stream_class_for = stream_class_for
    return stream_module.DecodeStream, batch_module.decode_round, processor_module.RequestProcessor


def bench_tokenizer(
    path: Path,
    name: str,
    repeats: int,
    active: int,
    requests: int,
    base: tuple[Any, Callable[..., Any], Any] | None = None,
    decode_options: bool = False,
) -> dict[str, Any]:
    tok = Tokenizer.from_file(str(path))
    reqs = generations(tok, model=name, requests=requests)
    generated = sum(len(r["output_token_ids"]) for r in reqs)
    chunked = [chunks_of(r["output_token_ids"]) for r in reqs]
    DecodeStream(tok, [1, 2, 3]).push([4])  # build the tokenizer profile outside the timings
    methods: dict[str, Callable[[], list[str]]] = {
        "a": lambda: method_hf_stream(tok, reqs),
        "b": lambda: method_push(tok, reqs, chunked),
        "c": lambda: method_batched(tok, reqs, chunked, active),
        "d": lambda: method_decode_batch(tok, reqs),
    }
    if base is not None:
        base_stream, base_round, base_processor = base
        base_stream(tok, [1, 2, 3]).push([4])
        methods["b0"] = lambda: method_push(tok, reqs, chunked, base_stream)
        methods["c0"] = lambda: method_batched(tok, reqs, chunked, active, base_stream, base_round)
    if decode_options:
        registry = TokenizerRegistry()
        registry.register("m", path)
        plain = processor_rounds(reqs, active, None, False)
        stops = processor_rounds(reqs, active, BENCH_STOPS, False)
        logprobs = processor_rounds(reqs, active, None, True, tok.get_vocab_size())
        count = len(reqs)
        methods["p"] = lambda: method_processor(registry, plain, count)
        methods["ps"] = lambda: method_processor(registry, stops, count)
        methods["pl"] = lambda: method_processor(registry, logprobs, count)
        if base is not None:
            methods["p0"] = lambda: method_processor(registry, plain, count, base_processor)
            methods["ps0"] = lambda: method_processor(registry, stops, count, base_processor)
            methods["pl0"] = lambda: method_processor(registry, logprobs, count, base_processor)
    times: dict[str, list[float]] = {k: [] for k in methods}
    outputs: dict[str, list[str]] = {}
    order = list(methods)
    for rep in range(repeats):
        for key in order[rep % len(order) :] + order[: rep % len(order)]:
            seconds, outputs[key] = timed(methods[key])
            times[key].append(seconds)
    mismatches_bc = sum(x != y for x, y in zip(outputs["b"], outputs["c"], strict=True))
    mismatches_ba = sum(x != y for x, y in zip(outputs["b"], outputs["a"], strict=True))
    median = {k: statistics.median(v) for k, v in times.items()}
    versus_base = {}
    if base is not None:
        versus_base = {k: paired_ratio(times[f"{k}0"], times[k]) for k in ("b", "c")}
        pairs = [k for k in ("b", "c", "p", "ps", "pl") if k in times]
        versus_base = {k: paired_ratio(times[f"{k}0"], times[k]) for k in pairs}
        versus_base["mismatches"] = sum(
            x != y for k in pairs for x, y in zip(outputs[k], outputs[f"{k}0"], strict=True)
        )
    options = {}
    if decode_options:
        options = {k: paired_ratio(times["p"], times[k]) for k in ("ps", "pl")}
        if base is not None:  # the same ratio on the other tree, paired in this run
            options["pl0"] = paired_ratio(times["p0"], times["pl0"])
        options["mismatches_ps_vs_p"] = sum(
            x != y for x, y in zip(outputs["p"], outputs["ps"], strict=True)
        )
        options["mismatches_p_vs_b"] = sum(
            x != y for x, y in zip(outputs["p"], outputs["b"], strict=True)
        )
    return {
        "tokenizer": name,
        "requests": len(reqs),
        "generated_tokens": generated,
        "repeats": repeats,
        "tok_per_s": {k: generated / v for k, v in median.items()},
        "ratio_to_d": {k: paired_ratio(times["d"], v) for k, v in times.items()},
        "ratio_to_a": {k: paired_ratio(times["a"], v) for k, v in times.items()},
        "target_met": (
            paired_ratio(times["d"], times["c"]) >= TARGET_TO_D
            and paired_ratio(times["a"], times["c"]) >= TARGET_TO_A
        ),
        "mismatches_b_vs_c": mismatches_bc,
        "mismatches_b_vs_a": mismatches_ba,
        "versus_base": versus_base,
        "decode_options": options,
    }


CHAT_SIZES = (1000, 8000, 32000)
TARGET_CHAT_TO_PLAIN = 0.8
CHAT_TOOLS = [ParsedTool(function=ParsedFunction(name=f"run_{i}")) for i in range(3)]


def chat_rounds(ids: list[int], copies: int) -> list[list[tuple[ParsedEvent, EventOrigin]]]:
    """`copies` requests of the same generation, offering tools, one 16-id event of each per
    round (the batches a worker hands its processor)."""
    origin = EventOrigin("bench", 0, 0, b"")
    streams = []
    for copy in range(copies):
        request_id = f"c{copy}"
        events: list[ParsedEvent] = [
            ParsedPrompt(request_id=request_id, model="m", prompt_token_ids=[], tools=CHAT_TOOLS)
        ]
        for chunk in chunks_of(ids):
            events.append(ParsedTokens(request_id=request_id, seq=len(events), token_ids=chunk))
        events.append(ParsedFinish(request_id=request_id, seq=len(events)))
        streams.append(events)
    return [
        [(e, origin) for e in round_events if e is not None]
        for round_events in zip_longest(*streams)
    ]


def method_chat(registry: TokenizerRegistry, rounds: list, parsers: ChatParsers) -> list[Any]:
    """The processor over `rounds`, deltas and completions encoded as the worker writes them."""
    processor = RequestProcessor(registry, chat_parsers=parsers)
    completions = []
    for batch in rounds:
        completions += processed(processor, batch)
    return completions


def bench_chat_stage(shared: Path, repeats: int, copies: int) -> list[dict[str, Any]]:
    """(pp) and (pc) per size, paired per repeat in rotating order (see the module doc)."""
    path = shared / "tokenizers" / "qwen2-from-tiktoken" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    registry = TokenizerRegistry()
    registry.register("m", path)
    parsers = ChatParsers({"m": "qwen3"}, {"m": "hermes"})
    rows = []
    for size in CHAT_SIZES:
        _, ids = generation(tok, size)
        rounds = chat_rounds(ids, copies)
        done = method_chat(registry, rounds, parsers)
        if any(len(c.tool_calls or []) != 3 or not c.reasoning for c in done):
            raise SystemExit("bench chat generation did not parse into reasoning + 3 calls")
        methods = {
            "pp": lambda r=rounds: method_chat(registry, r, ChatParsers()),
            "pc": lambda r=rounds: method_chat(registry, r, parsers),
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        for rep in range(repeats):
            for key in list(methods)[rep % 2 :] + list(methods)[: rep % 2]:
                times[key].append(timed(methods[key], time.process_time)[0])
        tokens = len(ids) * copies
        extra = [(c - p) / tokens * 1e6 for p, c in zip(times["pp"], times["pc"], strict=True)]
        rows.append(
            {
                "tokens": len(ids),
                "copies": copies,
                "pp_tok_s": tokens / statistics.median(times["pp"]),
                "pc_tok_s": tokens / statistics.median(times["pc"]),
                "pc_over_pp": paired_ratio(times["pp"], times["pc"]),
                "parse_us_per_token": statistics.median(extra),
            }
        )
    return rows


def print_chat(rows: list[dict[str, Any]]) -> None:
    print(
        f"\nchat outputs (qwen2, markers as text, qwen3 + hermes, reasoning + 3 calls; "
        f"{rows[0]['copies']} requests at once, CPU time, medians):"
    )
    print("| tokens | (pp) no parsers tok/s | (pc) parsed tok/s | (pc)/(pp) | parse us/token |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['pp_tok_s'] / 1e3:,.0f} k | {r['pc_tok_s'] / 1e3:,.0f} k | "
            f"{r['pc_over_pp']:.3f} | {r['parse_us_per_token']:.3f} |"
        )
    last = rows[-1]["pc_over_pp"]
    met = "met" if last >= TARGET_CHAT_TO_PLAIN else "NOT met"
    print(f"aim (pc)/(pp) >= {TARGET_CHAT_TO_PLAIN} at 32k: {met}")


LABELS = {
    "a": "(a) HF DecodeStream, safe-suffix primed, per token",
    "b": "(b) DecodeStream.push per request, chunk 16",
    "c": "(c) decode_round, continuous batching",
    "d": "(d) one decode_batch, no streaming",
    "b0": "(b0) as (b), --compare-with tree",
    "c0": "(c0) as (c), --compare-with tree",
    "p": "(p) RequestProcessor, no decode options",
    "p0": "(p0) as (p), --compare-with tree",
    "ps": "(ps) RequestProcessor, 4 stop strings",
    "ps0": "(ps0) as (ps), --compare-with tree",
    "pl": "(pl) RequestProcessor, top-5 logprobs",
    "pl0": "(pl0) as (pl), --compare-with tree",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared-dir", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared"
    )
    parser.add_argument("--tokenizers", default="gpt2,llama-spm")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--active", type=int, default=256)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="TREE",
        help="another checkout whose pipeline's (b) and (c) are timed in the same run",
    )
    parser.add_argument(
        "--decode-options",
        action="store_true",
        help="add the processor rows: no options, stop strings, logprobs",
    )
    parser.add_argument(
        "--chat", action="store_true", help="add the chat-output rows (pp) and (pc)"
    )
    parser.add_argument("--chat-copies", type=int, default=8)
    parser.add_argument(
        "--chat-only", action="store_true", help="only the chat-output rows (implies --chat)"
    )
    args = parser.parse_args()
    if args.chat_only:
        rows = bench_chat_stage(args.shared_dir, args.repeats, args.chat_copies)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print_chat(rows)
        return
    base = None if args.compare_with is None else load_pipeline(args.compare_with)
    results = [
        bench_tokenizer(
            args.shared_dir / "tokenizers" / n / "tokenizer.json",
            n,
            args.repeats,
            args.active,
            args.requests,
            base,
            args.decode_options,
        )
        for n in args.tokenizers.split(",")
    ]
    chat = bench_chat_stage(args.shared_dir, args.repeats, args.chat_copies) if args.chat else []
    if args.json:
        print(json.dumps({"tokenizers": results, "chat": chat} if chat else results, indent=2))
        return
    for res in results:
        print(
            f"\n{res['tokenizer']}: {res['requests']} requests, "
            f"{res['generated_tokens']:,} generated tokens, median of {res['repeats']}"
        )
        print("| method | tok/s | ratio to (d) | ratio to (a) |\n|---|---:|---:|---:|")
        for k, label in LABELS.items():
            if k not in res["tok_per_s"]:
                continue
            rate, to_d, to_a = res["tok_per_s"][k], res["ratio_to_d"][k], res["ratio_to_a"][k]
            print(f"| {label} | {rate / 1e3:,.0f} k | {to_d:.3f} | {to_a:.2f} |")
        print(
            f"outputs (b) vs (c): {res['mismatches_b_vs_c']} mismatches; "
            f"(b) vs (a): {res['mismatches_b_vs_a']}"
        )
        print(
            f"target (c) >= {TARGET_TO_D} x (d) and >= {TARGET_TO_A} x (a): "
            f"{'met' if res['target_met'] else 'NOT met'}"
        )
        if res["versus_base"]:
            vs = res["versus_base"]
            pairs = ", ".join(f"({k}) {v:.3f}" for k, v in vs.items() if k != "mismatches")
            print(
                f"this tree vs --compare-with (median per-repeat time ratio, > 1 = faster): "
                f"{pairs}; output mismatches: {vs['mismatches']}"
            )
        if res["decode_options"]:
            opts = res["decode_options"]
            other = f" (other tree: (pl0)/(p0) {opts['pl0']:.3f})" if "pl0" in opts else ""
            print(
                f"decode options vs (p) (median per-repeat time ratio): stop strings (ps) "
                f"{opts['ps']:.3f} (aim >= {TARGET_STOP_TO_P}), logprobs (pl) {opts['pl']:.3f}"
                f"{other}; completions (ps) vs (p): {opts['mismatches_ps_vs_p']} mismatches, "
                f"(p) vs (b): {opts['mismatches_p_vs_b']}"
            )

    if chat:
        print_chat(chat)


if __name__ == "__main__":
    main()
