"""The reader rule (issue 32 item 9): an exception for one row of an input file dead-letters that
row, with its position and original, and the rest of the file completes; every reader holds a
row to the wire event's bounds; a completion a writer's columns cannot hold is named, never the
end of the whole file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.offline import run_generations
from pipeline.records import Position, SourceRecord
from schemas.events import Completion, LoggedGeneration
from schemas.validation import Rejection
from tests.unit.request_events import bytes_registry
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_run_command import detok_run, generation, read_jsonl
from workers.formats import openai as openai_format
from workers.formats.base import Destination
from workers.formats.jsonl import jsonl_records
from workers.formats.openai import openai_batch_records
from workers.formats.parquet import ParquetCompletions, parquet_records, read_completions
from workers.io.replay import replay_events

IDS = pa.list_(pa.uint32())


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


def parquet_file(path: Path, rows: list[dict], extra: list[tuple[str, pa.DataType]]) -> Path:
    schema = pa.schema(
        [
            ("request_id", pa.string()),
            ("model", pa.string()),
            ("prompt_token_ids", IDS),
            ("output_token_ids", IDS),
            *extra,
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def row(request_id: str, prompt: str, output: str, **extra: object) -> dict:
    return {
        "request_id": request_id,
        "model": "bytes",
        "prompt_token_ids": list(prompt.encode()),
        "output_token_ids": list(output.encode()),
        **extra,
    }


def test_a_parquet_row_counting_fewer_prompt_tokens_than_its_ids_is_a_dead_letter(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    """It passed the reader (the ids were checked apart from the model) and ended `detok run`
    with a ValueError and no output; JSONL dead-lettered the same row."""
    rows = [
        row("a", "hi", " one", prompt_tokens=None),
        row("short", "abc", " two", prompt_tokens=1),
        row("tail", "bc", " three", prompt_tokens=3),
    ]
    source = parquet_file(tmp_path / "in.parquet", rows, [("prompt_tokens", pa.int64())])
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    assert detok_run(f"bytes={tokenizer_file}", source, output, "--dead-letter", str(dead)) == 0
    completions = read_jsonl(output)
    assert [(c["request_id"], c["text"], c["prompt_tokens"]) for c in completions] == [
        ("a", " one", 2),
        ("tail", " three", 3),
    ]
    [letter] = read_jsonl(dead)
    assert (letter["reason"], letter["row"]) == ("schema_violation", 1)
    assert "prompt_tokens is less than the number of prompt_token_ids" in letter["error"]
    assert json.loads(letter["original"])["request_id"] == "short"


def test_a_prompt_tokens_count_past_int64_is_refused_by_every_reader(tmp_path: Path) -> None:
    """2**63 was accepted and then crashed Parquet output (OverflowError); every reader now
    holds the count to the wire event's bound."""
    big = 2**63
    jsonl = list(jsonl_records([generation("r", "a", "b", prompt_tokens=big).encode()]))
    source = parquet_file(
        tmp_path / "in.parquet",
        [row("r", "a", "b", prompt_tokens=big)],
        [("prompt_tokens", pa.uint64())],
    )
    batch_line = {
        "custom_id": "r",
        "response": {"body": {"model": "bytes", "prompt_token_ids": [97], "prompt_tokens": big,
                              "choices": [{"token_ids": [98]}]}},
    }  # fmt: skip
    openai = list(openai_batch_records([json.dumps(batch_line).encode()]))
    for record in (*jsonl, *parquet_records(source)):
        assert isinstance(record.parsed, Rejection), record
        assert "prompt_tokens" in record.parsed.message
    # The batch shape carries no prompt count: its generation counts its ids.
    assert isinstance(openai[0].parsed, LoggedGeneration) and openai[0].parsed.prompt_tokens is None


def test_a_row_whose_column_cannot_be_read_is_a_dead_letter_and_the_batch_goes_on(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    """Reading a batch's column whole fails for one row (a timestamp past year 9999 as
    `finish_reason`): the batch is read again row by row and only that row is a dead letter."""
    rows = [row(f"r{i}", "hi", f" {i}", finish_reason=None) for i in range(5)]
    rows[2]["finish_reason"] = 10**12  # seconds: year 33658, which Python's datetime refuses
    source = parquet_file(tmp_path / "in.parquet", rows, [("finish_reason", pa.timestamp("s"))])
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    assert detok_run(f"bytes={tokenizer_file}", source, output, "--dead-letter", str(dead)) == 0
    assert [c["request_id"] for c in read_jsonl(output)] == ["r0", "r1", "r3", "r4"]
    [letter] = read_jsonl(dead)
    assert (letter["reason"], letter["row"]) == ("unexpected_error", 2)
    assert "out of range" in letter["error"]


@pytest.mark.parametrize("choice", ["x", [1, 2], 5, None, True])
def test_a_batch_line_whose_choice_is_not_an_object_is_a_dead_letter(
    tmp_path: Path, tokenizer_file: Path, choice: object
) -> None:
    """`choices[0].get` on a string, list, number or null ended `detok run` and `detok replay`
    with an AttributeError."""
    good = {"custom_id": "good", "response": {"body": {"model": "bytes", "choices": [
        {"token_ids": [104, 105], "prompt_token_ids": [81, 58]}]}}}  # fmt: skip
    bad = {"custom_id": "bad", "response": {"body": {"model": "bytes", "choices": [choice]}}}
    source = tmp_path / "batch.jsonl"
    source.write_text(f"{json.dumps(bad)}\n{json.dumps(good)}\n", encoding="utf-8")
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    code = detok_run(f"bytes={tokenizer_file}", source, output, "--input-format", "openai-batch",
                     "--dead-letter", str(dead))  # fmt: skip
    assert code == 0
    assert [(c["request_id"], c["text"]) for c in read_jsonl(output)] == [("good", "hi")]
    [letter] = read_jsonl(dead)
    assert (letter["reason"], letter["line"]) == ("schema_violation", 1)
    assert "choices[0]" in letter["error"]
    # Replay passes the line through unkeyed, for the worker to dead-letter.
    records = list(openai_batch_records(source.read_bytes().splitlines()))
    assert list(replay_events(records[:1], 16)) == [(None, json.dumps(bad).encode())]


def test_any_exception_for_one_batch_line_rejects_that_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule holds for exceptions no check names (here the model raising on one line)."""
    real = LoggedGeneration.model_validate

    def validate(fields: dict) -> LoggedGeneration:
        if fields["request_id"] == "boom":
            raise RuntimeError("an exception no check names")
        return real(fields)

    monkeypatch.setattr(openai_format.LoggedGeneration, "model_validate", validate)
    lines = [
        json.dumps(
            {
                "custom_id": name,
                "response": {
                    "body": {"model": "m", "choices": [{"token_ids": [1], "prompt_token_ids": [2]}]}
                },
            }
        ).encode()  # fmt: skip
        for name in ("a", "boom", "c")
    ]
    records = list(openai_batch_records(lines))
    assert [type(r.parsed).__name__ for r in records] == [
        "LoggedGeneration", "Rejection", "LoggedGeneration",
    ]  # fmt: skip
    rejected = records[1].parsed
    assert isinstance(rejected, Rejection)
    assert (rejected.reason, rejected.error_class) == ("unexpected_error", "RuntimeError")
    assert records[1].original() == lines[1]


def test_a_generation_its_events_refuse_is_a_dead_letter_offline_and_unkeyed_in_replay(
    tmp_path: Path,
) -> None:
    """A reader that lets through a generation its events refuse (what the Parquet reader did)
    costs that record only: `detok run` dead-letters it with its position and original, replay
    passes it through unkeyed."""
    slipped = LoggedGeneration.model_construct(
        request_id="slipped", model="bytes", prompt_token_ids=[1, 2, 3], output_token_ids=[104],
        skip_special_tokens=True, finish_reason=None, stop=None, include_stop_str_in_output=False,
        output_logprobs=None, output_top_logprobs=None, prompt_tokens=1,
    )  # fmt: skip
    good = LoggedGeneration(
        request_id="good", model="bytes", prompt_token_ids=[104], output_token_ids=[105]
    )
    records = [
        SourceRecord(Position(row=0, row_group=0), slipped, b'{"the":"row"}'),
        SourceRecord(Position(row=1, row_group=0), good),
    ]
    outcomes = list(run_generations(records, bytes_registry(tmp_path)))
    assert outcomes[0].completion is None and outcomes[0].dead_letter is not None
    letter = outcomes[0].dead_letter
    assert (letter.reason, letter.error_class) == ("unexpected_error", "ValueError")
    assert letter.value == b'{"the":"row"}' and outcomes[0].position.row == 0
    assert outcomes[1].completion is not None and outcomes[1].completion.text == "i"
    assert list(replay_events(records[:1], 16)) == [(None, b'{"the":"row"}')]


def completion(request_id: str, prompt_tokens: int) -> Completion:
    return Completion(
        request_id=request_id, model="m", text="t", status="ok", prompt_tokens=prompt_tokens,
        generated_tokens=1,
    )  # fmt: skip


def test_a_completion_parquet_cannot_hold_is_named_and_the_rest_is_written(
    tmp_path: Path,
) -> None:
    """A completion with a count past int64 (already on a compacted topic, from before the
    bound) ended every Parquet collect with an OverflowError."""
    path = tmp_path / "out.parquet"
    writer = ParquetCompletions(Destination(path, "x"))
    for index, count in enumerate([3, 2**63, 4, 2**64 + 5]):
        writer.write(completion(f"r{index}", count), None)
    writer.close()
    assert [(c.request_id, c.prompt_tokens) for c in read_completions(path)] == [
        ("r0", 3),
        ("r2", 4),
    ]
    assert [(f.request_id, f.code) for f in writer.refused] == [
        ("r1", "unexpected_error"),
        ("r3", "unexpected_error"),
    ]
    assert all("OverflowError" in f.message for f in writer.refused)


def test_a_run_whose_completion_parquet_cannot_hold_dead_letters_it(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In `detok run` such a completion becomes a dead letter naming its request: no request is
    left out of both files."""
    from workers.commands import run as run_command

    real = run_command.run_generations

    def overflowing(*args, **kwargs):
        for outcome in real(*args, **kwargs):
            if outcome.completion is not None and outcome.completion.request_id == "b":
                outcome.completion = completion("b", 2**63)
            yield outcome

    monkeypatch.setattr(run_command, "run_generations", overflowing)
    source = tmp_path / "in.jsonl"
    source.write_text(f"{generation('a', 'x', 'y')}\n{generation('b', 'x', 'z')}\n")
    output, dead = tmp_path / "out.parquet", tmp_path / "dead.jsonl"
    assert detok_run(f"bytes={tokenizer_file}", source, output, "--dead-letter", str(dead)) == 0
    assert [c.request_id for c in read_completions(output)] == ["a"]
    [letter] = read_jsonl(dead)
    assert (letter["reason"], letter["request_id"]) == ("unexpected_error", "b")
    assert "OverflowError" in letter["error"]
