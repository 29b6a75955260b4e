"""Changelog bytes of one request against its final completion, with and without logprobs.

The worker writes a request's changelog records (`RequestProcessor.changelog_records`) at every
commit that touched it. This drives one request through the processor, `chunk` ids per tokens
event and a commit after every `commit_every` events, and counts every byte written (keys and
values) against the completion's JSON: the target (issue 32 item 6) is at most 2x the final
completion plus a constant, for every workload, logprobs included. Deterministic, no timings.

    python -m bench.changelog_bytes [--shared-dir ../shared] [--tokens 4000,8000] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.processor import RequestProcessor
from pipeline.results import EventOrigin
from pipeline.tokenizer_registry import TokenizerRegistry
from schemas.events import dump_json
from schemas.fast_events import ParsedEvent, ParsedFinish, ParsedPrompt, ParsedTokens


@dataclass
class ChangelogBytes:
    tokens: int
    top: int | None  # alternatives per token; None: no logprobs
    changelog_bytes: int
    completion_bytes: int
    commits: int

    @property
    def ratio(self) -> float:
        return self.changelog_bytes / self.completion_bytes


def request_events(
    ids: list[int], top: int | None, chunk: int, vocab: int, model: str = "m"
) -> list[ParsedEvent]:
    """A request's prompt, its ids as tokens events of `chunk` ids (with a logprob and `top`
    alternatives below `vocab` per id unless `top` is None) and its finish."""
    events: list[ParsedEvent] = [
        ParsedPrompt(request_id="r", model=model, prompt_token_ids=ids[:4])
    ]
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        events.append(
            ParsedTokens(
                request_id="r",
                seq=len(events),
                token_ids=part,
                logprobs=None if top is None else [-0.25 - (t % 7) / 8 for t in part],
                top_logprobs=(
                    None
                    if top is None
                    else [[((t + k * 31) % vocab, -0.5 - k / 3) for k in range(top)] for t in part]
                ),
            )
        )
    events.append(ParsedFinish(request_id="r", seq=len(events), finish_reason="length"))
    return events


def measure(
    processor: RequestProcessor,
    ids: list[int],
    top: int | None,
    *,
    chunk: int = 1,
    commit_every: int = 1,
    vocab: int = 256,
    model: str = "m",
) -> ChangelogBytes:
    """Drive one request through `processor`; count its changelog bytes and its completion's."""
    origin = EventOrigin("bench", 0, 0, b"")
    events = request_events(ids, top, chunk, vocab, model)
    written = commits = 0
    completion = None
    for start in range(0, len(events), commit_every):
        result = processor.process([(e, origin) for e in events[start : start + commit_every]])
        if result.completions:
            (completion,) = result.completions
        commits += 1
        for key, value in processor.changelog_records("r"):
            written += len(key) + len(value or b"")
    assert completion is not None and completion.status == "ok", completion
    return ChangelogBytes(len(ids), top, written, len(dump_json(completion)), commits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shared-dir", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared"
    )
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--tokens", default="4000,8000")
    parser.add_argument("--chunk", type=int, default=1, help="ids per tokens event")
    parser.add_argument("--commit-every", type=int, default=1, help="events per commit")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    registry = TokenizerRegistry()
    path = args.shared_dir / "tokenizers" / args.tokenizer / "tokenizer.json"
    registry.register("m", path)
    vocab = registry.get("m").tokenizer_vocab_size
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    corpus = registry.get("m").tokenizer.encode(text, add_special_tokens=False).ids
    rows = []
    for count in map(int, args.tokens.split(",")):
        ids = (corpus * (count // len(corpus) + 1))[:count]
        for top in (None, 0, 5, 20):
            processor = RequestProcessor(registry)
            rows.append(
                measure(
                    processor,
                    ids,
                    top,
                    chunk=args.chunk,
                    commit_every=args.commit_every,
                    vocab=vocab,
                )
            )
    if args.json:
        print(json.dumps([asdict(r) | {"ratio": r.ratio} for r in rows]))
        return
    print(f"chunk {args.chunk} ids/event, a commit every {args.commit_every} events")
    print(f"{'tokens':>7} {'logprobs':>9} {'changelog B':>12} {'completion B':>13} {'ratio':>6}")
    for r in rows:
        top = "none" if r.top is None else f"top-{r.top}"
        print(
            f"{r.tokens:>7} {top:>9} {r.changelog_bytes:>12,} {r.completion_bytes:>13,} "
            f"{r.ratio:>6.2f}"
        )


if __name__ == "__main__":
    main()
