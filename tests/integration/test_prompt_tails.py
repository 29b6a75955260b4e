"""A 500k-id prompt through `detok replay` and the worker with default broker limits (issue 15
items 1 and 2): the input topic keeps the broker's 1 MB record limit, replay sends the prompt as
its 64-id tail with `prompt_tokens`, and the worker's completions (text, prompt_tokens, filtered
ids) equal `detok run` on the whole prompt."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.conftest import real_tokenizer_path
from tests.integration.conftest import unique_name
from tests.integration.worker_harness import (
    TEXTS,
    assert_deltas_cover_exactly_once,
    completions_on,
    models,
    offline_completions,
    pipeline_topics,
    read_topic,
    start_worker,
    wait_exit,
    write_jsonl,
)
from workers.replay import replay

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def long_prompts() -> list[dict]:
    gpt2 = Tokenizer.from_file(str(real_tokenizer_path("gpt2")))
    qwen2 = Tokenizer.from_file(str(real_tokenizer_path("qwen2-from-tiktoken")))
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
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = write_jsonl(tmp_path / "generations.jsonl", long_prompts())
    expected = offline_completions(source, models().registry())
    assert expected["long-gpt2"]["prompt_tokens"] == 500_000
    assert expected["long-qwen2"]["filtered_prompt_ids"] == [151_700, 151_800]
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    with caplog.at_level(logging.INFO, logger="detok.replay"):
        totals = replay(kafka_bootstrap, source, names.input, progress=False)
    assert totals.requests == 4
    assert "request long-gpt2: prompt of 500000 ids" in caplog.text
    sent = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, names.input)]
    prompts = {e["request_id"]: e for e in sent if e["type"] == "prompt"}
    assert len(prompts["long-gpt2"]["prompt_token_ids"]) == 64
    assert prompts["long-gpt2"]["prompt_tokens"] == 500_000

    worker = start_worker(
        kafka_bootstrap,
        names,
        unique_name("g"),
        instance_id="tails",
        extra=["--exit-when-idle", "3"],
        log_dir=tmp_path,
    )
    assert wait_exit(worker) == 0
    got = completions_on(kafka_bootstrap, names)
    assert got == expected
    assert_deltas_cover_exactly_once(kafka_bootstrap, names, expected)
    filtered = [json.loads(v) for _, v, _ in read_topic(kafka_bootstrap, names.metrics)]
    assert [(m["request_id"], m["filtered_ids"], m["prompt_tokens"]) for m in filtered] == [
        ("long-qwen2", [151_700, 151_800], 200_000)
    ]
