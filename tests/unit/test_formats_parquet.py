"""Parquet in and out of `detok run`: the same completions as JSONL on the real tokenizers, bad
rows dead-lettered with their row index while the rest completes, clear errors for a file that is
not Parquet and for a missing pyarrow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from bench.workload import generations
from tests.conftest import real_tokenizer_path
from tests.unit.small_tokenizers import byte_level
from tests.unit.test_run_command import detok_run, read_jsonl
from workers.formats.parquet import read_completions, write_generations

# A byte-level BPE and a SentencePiece tokenizer: the two decoder families.
REAL = ("gpt2", "llama-spm")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


@pytest.mark.conformance
@pytest.mark.parametrize("name", REAL)
def test_parquet_input_gives_the_jsonl_completions_field_by_field(
    tmp_path: Path, name: str
) -> None:
    tokenizer_path = real_tokenizer_path(name)
    rows = generations(
        Tokenizer.from_file(str(tokenizer_path)),
        model=name,
        requests=40,
        prompt_tokens=(5, 80),
        output_tokens=(0, 120),
    )
    rows[3]["skip_special_tokens"] = False
    rows[4]["finish_reason"] = None
    jsonl = write_jsonl(tmp_path / "in.jsonl", rows)
    parquet = tmp_path / "in.parquet"
    write_generations(parquet, iter(rows), rows=16)  # three row groups
    spec = f"{name}={tokenizer_path}"
    assert detok_run(spec, jsonl, tmp_path / "from-jsonl.jsonl") == 0
    # Parquet in and Parquet out, read back through the model: field by field the same.
    assert detok_run(spec, parquet, tmp_path / "out.parquet") == 0
    from_jsonl = read_jsonl(tmp_path / "from-jsonl.jsonl")
    from_parquet = [
        json.loads(c.model_dump_json()) for c in read_completions(tmp_path / "out.parquet")
    ]
    assert len(from_jsonl) == 40
    for expected, got in zip(from_jsonl, from_parquet, strict=True):
        for field, value in expected.items():
            assert got[field] == value, (expected["request_id"], field)
    types = pq.read_schema(tmp_path / "out.parquet")
    assert types.field("prompt_tokens").type == pa.int64()
    assert types.field("filtered_prompt_ids").type == pa.list_(pa.uint32())


@pytest.mark.parametrize("id_type", [pa.int32(), pa.int64(), pa.uint32(), pa.uint16()])
def test_id_lists_of_any_integer_type_are_read(
    tmp_path: Path, tokenizer_file: Path, id_type: pa.DataType
) -> None:
    table = pa.table(
        {
            "request_id": ["a", "b"],
            "model": ["bytes", "bytes"],
            "prompt_token_ids": pa.array([list(b"Hi"), list(b"Yo")], pa.list_(id_type)),
            "output_token_ids": pa.array([list(b" there"), []], pa.large_list(id_type)),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    assert detok_run(f"bytes={tokenizer_file}", tmp_path / "in.parquet", tmp_path / "o.jsonl") == 0
    assert [c["text"] for c in read_jsonl(tmp_path / "o.jsonl")] == [" there", ""]


def test_each_class_of_bad_row_is_a_dead_letter_with_its_row_and_the_rest_completes(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    good = list(b" ok")
    first = pa.table(
        {
            "request_id": ["r0", "r1", "r2", "r3", "r4", "r5"],
            "model": ["bytes"] * 6,
            "prompt_token_ids": pa.array(
                [list(b"Hi"), [1, None, 3], None, list(b"Hi"), list(b"Hi"), list(b"Hi")],
                pa.list_(pa.int64()),
            ),
            "output_token_ids": pa.array(
                [good, good, good, [5, -1], [2**32], good], pa.list_(pa.int64())
            ),
            "skip_special_tokens": [True, True, True, True, True, None],
        }
    )
    second = pa.table(
        {
            "request_id": ["r6", "r7", "r0"],
            "model": ["bytes", "other", "bytes"],
            "prompt_token_ids": pa.array([list(b"Hi")] * 3, pa.list_(pa.int64())),
            "output_token_ids": pa.array([good] * 3, pa.list_(pa.int64())),
            "skip_special_tokens": [True, True, True],
        }
    )
    with pq.ParquetWriter(tmp_path / "in.parquet", first.schema) as writer:
        writer.write_table(first)
        writer.write_table(second)
    out, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    code = detok_run(
        f"bytes={tokenizer_file}", tmp_path / "in.parquet", out, "--dead-letter", str(dead)
    )
    assert code == 0
    assert [c["request_id"] for c in read_jsonl(out)] == ["r0", "r5", "r6"]
    letters = read_jsonl(dead)
    assert [(d["row"], d["line"], d["reason"]) for d in letters] == [
        (1, None, "schema_violation"),  # a null id
        (2, None, "schema_violation"),  # a null id list
        (3, None, "token_id_out_of_range"),  # a negative id
        (4, None, "token_id_out_of_range"),  # an id past u32
        (7, None, "unknown_model"),
        (8, None, "schema_violation"),  # the request id again
    ]
    assert "null id" in letters[0]["error"] and letters[0]["error_class"] == "BadRow"
    assert json.loads(letters[0]["original"])["prompt_token_ids"] == [1, None, 3]
    assert json.loads(letters[4]["original"])["request_id"] == "r7"


@pytest.mark.parametrize(
    ("columns", "problem"),
    [
        ({"prompt_token_ids": pa.array([[72]], pa.list_(pa.int64()))}, "output_token_ids"),
        ({"prompt_token_ids": pa.array([["H"]]), "output_token_ids": pa.array([[72]])}, "type"),
        ({"prompt_token_ids": pa.array([1.5]), "output_token_ids": pa.array([[72]])}, "type"),
    ],
    ids=["missing column", "list of strings", "not a list"],
)
def test_a_missing_or_mistyped_column_dead_letters_every_row(
    tmp_path: Path, tokenizer_file: Path, columns: dict, problem: str, capsys
) -> None:
    table = pa.table({"request_id": ["a"], "model": ["bytes"], **columns})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    assert detok_run(f"bytes={tokenizer_file}", tmp_path / "in.parquet", out) == 1
    [letter] = read_jsonl(tmp_path / "out.dead-letters.jsonl")
    assert letter["row"] == 0 and letter["reason"] == "schema_violation"
    assert problem in letter["error"]
    assert "parquet file of logged generations" in capsys.readouterr().err


def test_a_scalar_of_the_wrong_type_is_a_schema_violation(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    table = pa.table(
        {
            "request_id": [1, 2],
            "model": ["bytes", "bytes"],
            "prompt_token_ids": [[72], [72]],
            "output_token_ids": [[72], [72]],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    assert detok_run(f"bytes={tokenizer_file}", tmp_path / "in.parquet", tmp_path / "o.jsonl") == 1
    letters = read_jsonl(tmp_path / "o.dead-letters.jsonl")
    assert [(d["row"], d["reason"]) for d in letters] == [
        (0, "schema_violation"),
        (1, "schema_violation"),
    ]
    assert "request_id" in letters[0]["error"]


def test_a_file_that_is_not_parquet_is_a_clear_error(
    tmp_path: Path, tokenizer_file: Path, capsys
) -> None:
    source = tmp_path / "data.parquet"
    source.write_text('{"request_id": "a"}\n')
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert "is not a Parquet file" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
    # Named explicitly, the same bytes are read as JSONL.
    assert (
        detok_run(
            f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl", "--input-format", "jsonl"
        )  # fmt: skip
        == 1
    )


def test_the_extension_decides_unless_a_format_is_named(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    rows = [{"request_id": "a", "model": "bytes", "prompt_token_ids": [72],
             "output_token_ids": list(b" hi")}]  # fmt: skip
    write_generations(tmp_path / "in.data", iter(rows))
    spec = f"bytes={tokenizer_file}"
    assert detok_run(spec, tmp_path / "in.data", tmp_path / "o.jsonl", "--input-format",
                     "parquet", "--output-format", "parquet") == 0  # fmt: skip
    assert [c.text for c in read_completions(tmp_path / "o.jsonl")] == [" hi"]


def test_without_pyarrow_the_message_names_the_extra(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    source = tmp_path / "in.jsonl"
    write_jsonl(source, [{"request_id": "a", "model": "bytes", "prompt_token_ids": [72],
                          "output_token_ids": [72]}])  # fmt: skip
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.parquet") == 2
    assert "pip install 'detok[parquet]'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "tokenizer.json"]
