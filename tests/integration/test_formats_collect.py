"""Formats through Kafka: a Parquet file replayed, decoded by a real worker, and collected as
JSONL, Parquet and OpenAI batch output; all of them say the same as `detok run` on the JSONL.
Budget: one worker run over 120 requests and three in-process collects (~15 s on two cores)."""

from __future__ import annotations

import json

import openai.types
import pytest

from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    wait_exit,
)
from workers.cli import main
from workers.formats.parquet import read_completions, write_generations

pytestmark = pytest.mark.integration

REQUESTS = 120


def detok(*arguments: str, bootstrap: str) -> int:
    """The command in this process (a subprocess each would add seconds of start-up)."""
    return main([*arguments, "--bootstrap-servers", bootstrap])


def test_parquet_replayed_and_collected_in_every_format_equals_detok_run(
    pipeline_run: NewPipelineRun, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = make_generations(REQUESTS)
    run = pipeline_run(rows)
    names, expected, tmp_path = run.names, run.expected, run.log_dir
    parquet = tmp_path / "generations.parquet"
    write_generations(parquet, iter(rows), rows=50)
    assert len(expected) == REQUESTS

    assert detok("replay", "--input", str(parquet), "--topic", names.input,
                 bootstrap=run.bootstrap) == 0  # fmt: skip
    assert f"replayed {REQUESTS} requests" in capsys.readouterr().out
    worker = run.start_worker("formats", extra=["--exit-when-idle", "3"])
    assert wait_exit(worker) == 0

    outputs = {
        "jsonl": tmp_path / "out.jsonl",
        "parquet": tmp_path / "out.parquet",
        "openai-batch": tmp_path / "batch.jsonl",
    }
    for fmt, path in outputs.items():
        assert detok("collect", "--topic", names.completions, "--output", str(path),
                     "--output-format", fmt, "--expect", str(REQUESTS),
                     bootstrap=run.bootstrap) == 0  # fmt: skip

    from_jsonl = [json.loads(line) for line in outputs["jsonl"].read_text().splitlines()]
    assert {c["request_id"]: c for c in from_jsonl} == expected
    from_parquet = [json.loads(c.model_dump_json()) for c in read_completions(outputs["parquet"])]
    assert from_parquet == from_jsonl

    batch = [json.loads(line) for line in outputs["openai-batch"].read_text().splitlines()]
    assert [line["custom_id"] for line in batch] == [c["request_id"] for c in from_jsonl]
    for line, completion in zip(batch, from_jsonl, strict=True):
        if completion["status"] == "ok":
            body = openai.types.Completion.model_validate(line["response"]["body"])
            assert body.choices[0].text == completion["text"]
        else:
            assert line["response"] is None
            openai.types.BatchError.model_validate(line["error"])
