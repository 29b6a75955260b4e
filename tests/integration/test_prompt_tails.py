"""A 500k-id prompt through `detok replay` and the worker with default broker limits (issue 15
items 1 and 2): the input topic keeps the broker's 1 MB record limit, replay sends the prompt as
its 64-id tail with `prompt_tokens`, and the worker's completions (text, prompt_tokens, filtered
ids) equal `detok run` on the whole prompt."""

from __future__ import annotations

import json
import logging

import pytest

from tests.integration.worker_harness import (
    TEXTS,
    NewPipelineRun,
    read_topic,
    wait_exit,
    worker_tokenizers,
)
from workers.io.replay import replay

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def long_prompts() -> list[dict]:
    gpt2, qwen2 = worker_tokenizers()["gpt2"], worker_tokenizers()["qwen2"]
    generations = []
    for model, tok, length in (("gpt2", gpt2, 500_000), ("qwen2", qwen2, 200_000)):
        words = tok.encode(" ".join(TEXTS), add_special_tokens=False).ids
        ending = tok.encode(" 天空 blue 你好 world!", add_special_tokens=False).ids
        unknown = [151_700, 151_800] if model == "qwen2" else []
        # The prompt ends one id into 你 (mid-character), with out-of-vocabulary ids before it.
        cut = 3
        end = ending[:cut] + unknown + ending[cut : cut + 1]
        body = (words * (length // len(words) + 1))[: length - len(end)]
        prompt = body + end
        generations.append(
            {"request_id": f"long-{model}", "model": model, "prompt_token_ids": prompt,
             "output_token_ids": ending[cut + 1 :] + words[:50], "finish_reason": "stop"}
        )  # fmt: skip
        generations.append(
            {"request_id": f"short-{model}", "model": model, "prompt_token_ids": words[:30],
             "output_token_ids": words[30:90], "finish_reason": "length"}
        )  # fmt: skip
    return generations


def test_a_500k_id_prompt_through_replay_and_the_worker_equals_detok_run(
    pipeline_run: NewPipelineRun, caplog: pytest.LogCaptureFixture
) -> None:
    run = pipeline_run(long_prompts(), partitions=2)
    kafka_bootstrap, names, expected = run.bootstrap, run.names, run.expected
    assert expected["long-gpt2"]["prompt_tokens"] == 500_000
    assert expected["long-qwen2"]["filtered_prompt_ids"] == [151_700, 151_800]
    with caplog.at_level(logging.INFO, logger="detok.replay"):
        totals = replay(kafka_bootstrap, run.source, names.input, progress=False)
    assert totals.requests == 4
    assert "request long-gpt2: prompt of 500000 ids" in caplog.text
    sent = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, names.input)]
    prompts = {e["request_id"]: e for e in sent if e["type"] == "prompt"}
    assert len(prompts["long-gpt2"]["prompt_token_ids"]) == 64
    assert prompts["long-gpt2"]["prompt_tokens"] == 500_000

    worker = run.start_worker("tails", extra=["--exit-when-idle", "3"])
    assert wait_exit(worker) == 0
    run.assert_exactly_once()
    filtered = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, names.metrics)]
    assert [(m["request_id"], m["filtered_ids"], m["prompt_tokens"]) for m in filtered] == [
        ("long-qwen2", [151_700, 151_800], 200_000)
    ]
