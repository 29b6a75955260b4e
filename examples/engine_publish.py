"""A scripted inference engine publishing its token ids through detok's publisher (asyncio).

It stands in for a tokens-only engine (vLLM with `detokenize=False`, SGLang with
`skip_tokenizer_init`): `--requests` requests run together, and every engine step (`--rate`
steps per second) gives each running request its next id. The ids are a real tokenizer's
encoding of a fixed text, so the worker's completions are readable; some requests carry stop
strings taken from the middle of their own text, so they fire mid-generation, and some ask for
logprobs. The steps stream through `AsyncPublisher.publish`, the shape of an engine's output loop
(docs/engines.md maps vLLM's `AsyncLLM` onto it).

`--log FILE` writes every request as a logged generation (`detok run`'s input) before
publishing: `detok run --input FILE` is then the answer the worker must give.

    detok broker start && detok topics ensure
    python examples/engine_publish.py --tokenizer PATH/tokenizer.json --model gpt2
    detok worker --tokenizer gpt2=PATH/tokenizer.json   # and `detok collect` for the results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from tokenizers import Tokenizer

from workers.io.publish import AsyncPublisher, StepOutput

TEXTS = [
    "Kafka keeps the log; the workers keep one decoder per live request and publish its text.",
    "Unicode 天空 is decoded across token boundaries: naïve café, 👩‍💻, and résumé arrive whole.",
    "def stream(ids):\n    for chunk in ids:\n        yield decode(chunk)\n",
]


def scripted_requests(tokenizer: Tokenizer, model: str, count: int, seed: int) -> list[dict]:
    """Each request as a logged generation: prompt ids, the ids the engine will generate, and
    its options (every third a stop string from its own text, every fourth logprobs)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        ids = tokenizer.encode(" ".join(rng.sample(TEXTS, 2)), add_special_tokens=False).ids
        cut = rng.randint(3, 12)
        prompt, output = ids[:cut], ids[cut : cut + rng.randint(20, 60)]
        request: dict = {
            "request_id": f"engine-{seed}-{index:03d}",
            "model": model,
            "prompt_token_ids": prompt,
            "output_token_ids": output,
            "finish_reason": "length",
        }
        text = tokenizer.decode(output)
        if index % 3 == 0 and len(text) > 30:
            request["stop"] = [text[len(text) // 2 : len(text) // 2 + 3]]
        if index % 4 == 0:
            request["output_logprobs"] = [round(-rng.random() * 5, 3) for _ in output]
        requests.append(request)
    return requests


async def engine_steps(requests: list[dict], step_s: float) -> AsyncIterator[StepOutput]:
    """One id of every running request per step, a step every `step_s`; a request's last
    output says `finished`."""
    step = 0
    while any(step < len(r["output_token_ids"]) or step == 0 for r in requests):
        for r in requests:
            ids, logprobs = r["output_token_ids"], r.get("output_logprobs")
            if step < len(ids) or (step == 0 and not ids):
                last = step >= len(ids) - 1
                yield StepOutput(
                    r["request_id"],
                    ids[step : step + 1],
                    finished=last,
                    finish_reason=r["finish_reason"] if last else None,
                    logprobs=None if logprobs is None else logprobs[step : step + 1],
                )
        step += 1
        await asyncio.sleep(step_s)


async def run(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    requests = scripted_requests(tokenizer, args.model, args.requests, args.seed)
    if args.log:
        args.log.write_text("".join(json.dumps(r) + "\n" for r in requests))
    publisher = await AsyncPublisher.create(args.bootstrap_servers, args.topic)
    async with publisher:
        for r in requests:
            await publisher.open(r["request_id"], r["model"], r["prompt_token_ids"],
                                 stop=r.get("stop"))  # fmt: skip
        finished = await publisher.publish(engine_steps(requests, 1 / args.rate))
    print(f"published {finished} requests to {args.topic}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:19092")
    parser.add_argument("--topic", default="detok.tokens")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json")
    parser.add_argument("--model", default="gpt2", help="the model name the worker knows")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=200.0, help="engine steps per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="write the requests as logged generations")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
