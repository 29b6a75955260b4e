"""A scripted inference engine publishing its token ids through detok's publisher (asyncio), and
aborting the requests detok stops.

It stands in for a tokens-only engine (vLLM with `detokenize=False`, SGLang with
`skip_tokenizer_init`): `--requests` requests run together, and every engine step (`--rate`
steps per second) gives each running request its next id. The ids are a real tokenizer's
encoding of a fixed text, so the worker's completions are readable. Every third request carries
a stop string from the middle of its own text and, like a real engine that cannot see it, would
go on generating (its text again and again) up to `--max-tokens`; the engine listens to detok's
stop signals and aborts such a request when its signal comes (without a worker running, it
generates all `--max-tokens`). Every fourth request asks for logprobs. The steps stream through
`AsyncPublisher.publish`, the shape of an engine's output loop (docs/engines.md maps vLLM's
`AsyncLLM` onto it).

`--log FILE` writes every request as a logged generation (`detok run`'s input) before
publishing, with all the ids the engine would generate unaborted: `detok run --input FILE` is
the answer the worker must give (the text ends at the stop either way).

    detok broker start && detok topics ensure
    detok worker --tokenizer gpt2=PATH/tokenizer.json &
    python examples/follow_requests.py --count 16 &   # the text, live
    python examples/engine_publish.py --tokenizer PATH/tokenizer.json --model gpt2
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

from workers.io.publish import AsyncPublisher, AsyncStopSignals, StepOutput

TEXTS = [
    "Kafka keeps the log; the workers keep one decoder per live request and publish its text.",
    "Unicode 天空 is decoded across token boundaries: naïve café, 👩‍💻, and résumé arrive whole.",
    "def stream(ids):\n    for chunk in ids:\n        yield decode(chunk)\n",
]


def scripted_requests(
    tokenizer: Tokenizer, model: str, count: int, seed: int, max_tokens: int
) -> list[dict]:
    """Each request as a logged generation: prompt ids, the ids the engine will generate, and
    its options (every third a stop string from its own text and `max_tokens` ids, since the
    engine cannot see the stop; every fourth logprobs)."""
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
            request["output_token_ids"] = (output * (max_tokens // len(output) + 1))[:max_tokens]
        if index % 4 == 0:
            count_ids = len(request["output_token_ids"])
            request["output_logprobs"] = [round(-rng.random() * 5, 3) for _ in range(count_ids)]
        requests.append(request)
    return requests


async def engine_steps(
    requests: list[dict], step_s: float, aborted: dict[str, int], sent: dict[str, int]
) -> AsyncIterator[StepOutput]:
    """One id of every running request per step, a step every `step_s`; a request's last
    output says `finished`. An aborted request generates nothing more (the stop signals are
    taken in while a step sleeps). `sent` counts each request's ids."""
    step = 0
    running = list(requests)
    while running:
        for r in running:
            ids, logprobs = r["output_token_ids"], r.get("output_logprobs")
            if r["request_id"] in aborted:
                continue
            sent[r["request_id"]] = step + 1
            last = step >= len(ids) - 1
            yield StepOutput(
                r["request_id"],
                ids[step : step + 1],
                finished=last,
                finish_reason=r["finish_reason"] if last else None,
                logprobs=None if logprobs is None else logprobs[step : step + 1],
            )
        step += 1
        running = [r for r in running if step < len(r["output_token_ids"])]
        running = [r for r in running if r["request_id"] not in aborted]
        await asyncio.sleep(step_s)


async def abort_on_signals(
    signals: AsyncStopSignals, publisher: AsyncPublisher, aborted: dict[str, int]
) -> None:
    """The engine's side of a stop signal: stop generating the request and close it in the
    publisher without a finish (the worker has its completion already)."""
    async for signal in signals:
        if await publisher.abandon(signal.request_id):
            aborted[signal.request_id] = signal.generated_tokens


async def run(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    requests = scripted_requests(tokenizer, args.model, args.requests, args.seed, args.max_tokens)
    if args.log:
        args.log.write_text("".join(json.dumps(r) + "\n" for r in requests))
    publisher = await AsyncPublisher.create(args.bootstrap_servers, args.topic)
    # Made before the first request opens: it reads from the control topic's end as of now.
    signals = await AsyncStopSignals.create(
        args.bootstrap_servers, args.control_topic, requests=publisher
    )
    aborted: dict[str, int] = {}  # request id -> ids the worker used of it
    sent: dict[str, int] = {}  # request id -> ids generated
    listener = asyncio.create_task(abort_on_signals(signals, publisher, aborted))
    async with publisher, signals:
        for r in requests:
            await publisher.open(r["request_id"], r["model"], r["prompt_token_ids"],
                                 stop=r.get("stop"))  # fmt: skip
        steps = engine_steps(requests, 1 / args.rate, aborted, sent)
        finished = await publisher.publish(steps)
        listener.cancel()
    script = {r["request_id"]: len(r["output_token_ids"]) for r in requests}
    saved = sum(script[r] - sent[r] for r in aborted)
    past_stop = sum(sent[r] - used for r, used in aborted.items())
    print(f"published {finished + len(aborted)} requests to {args.topic}: {finished} finished, "
          f"{len(aborted)} aborted on stop signals ({saved} ids not generated; {past_stop} "
          f"generated past a stop before its signal came)", file=sys.stderr)  # fmt: skip
    if args.summary:
        args.summary.write_text(json.dumps({"finished": finished, "aborted": aborted}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:19092")
    parser.add_argument("--topic", default="detok.tokens")
    parser.add_argument("--control-topic", default="detok.control", help="stop signals")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json")
    parser.add_argument("--model", default="gpt2", help="the model name the worker knows")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=100.0, help="engine steps per second")
    parser.add_argument("--max-tokens", type=int, default=600, help="of a request with a stop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="write the requests as logged generations")
    parser.add_argument("--summary", type=Path, help="write what was finished and aborted")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
