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

    python -m bench.bench_core [--shared-dir ../shared] [--tokenizers gpt2,llama-spm] [--json]
                               [--compare-with /tmp/base]
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
from itertools import compress
from operator import attrgetter
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream as HFDecodeStream

from bench.workload import generations
from pipeline.batch import decode_round
from pipeline.decode_stream import DecodeStream

CHUNK = 16
# Issue 2's targets for (c), the batched path: at least half of (d) and 4x (a).
TARGET_TO_D = 0.5
TARGET_TO_A = 4.0


def chunks_of(ids: list[int]) -> list[list[int]]:
    return [ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK)]


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


def method_decode_batch(tok: Tokenizer, reqs: list[dict[str, Any]]) -> list[str]:
    return tok.decode_batch([r["output_token_ids"] for r in reqs], skip_special_tokens=True)


def timed(fn: Callable[[], list[str]]) -> tuple[float, list[str]]:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        gc.enable()


def paired_ratio(reference: list[float], method: list[float]) -> float:
    """Median over repeats of t(reference) / t(method), both timed in the same repeat: a load
    spike on a busy host then hits both sides of a ratio instead of skewing it."""
    return statistics.median(r / m for r, m in zip(reference, method, strict=True))


def load_pipeline(tree: Path) -> tuple[Any, Callable[..., Any]]:
    """`DecodeStream` and `decode_round` of another checkout's `pipeline`, loaded beside ours.

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
    finally:
        sys.path.remove(str(tree))
        for name in ours():
            del sys.modules[name]
        sys.modules.update(saved)
    if not Path(stream_module.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"--compare-with {tree}: its pipeline package was not the one loaded")
    return stream_module.DecodeStream, batch_module.decode_round


def bench_tokenizer(
    path: Path,
    name: str,
    repeats: int,
    active: int,
    requests: int,
    base: tuple[Any, Callable[..., Any]] | None = None,
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
        base_stream, base_round = base
        base_stream(tok, [1, 2, 3]).push([4])
        methods["b0"] = lambda: method_push(tok, reqs, chunked, base_stream)
        methods["c0"] = lambda: method_batched(tok, reqs, chunked, active, base_stream, base_round)
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
        versus_base["mismatches"] = sum(
            x != y for k in ("b", "c") for x, y in zip(outputs[k], outputs[f"{k}0"], strict=True)
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
    }


LABELS = {
    "a": "(a) HF DecodeStream, safe-suffix primed, per token",
    "b": "(b) DecodeStream.push per request, chunk 16",
    "c": "(c) decode_round, continuous batching",
    "d": "(d) one decode_batch, no streaming",
    "b0": "(b0) as (b), --compare-with tree",
    "c0": "(c0) as (c), --compare-with tree",
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
    args = parser.parse_args()
    base = None if args.compare_with is None else load_pipeline(args.compare_with)
    results = [
        bench_tokenizer(
            args.shared_dir / "tokenizers" / n / "tokenizer.json",
            n,
            args.repeats,
            args.active,
            args.requests,
            base,
        )
        for n in args.tokenizers.split(",")
    ]
    if args.json:
        print(json.dumps(results, indent=2))
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
            print(
                f"this tree vs --compare-with (median per-repeat time ratio, > 1 = faster): "
                f"(b) {vs['b']:.3f}, (c) {vs['c']:.3f}; output mismatches: {vs['mismatches']}"
            )


if __name__ == "__main__":
    main()
