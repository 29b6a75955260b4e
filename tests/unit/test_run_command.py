"""`detok run` end to end on files: outputs in input order, bad lines to the dead-letter file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.small_tokenizers import UNKNOWN_ID, byte_level
from workers.cli import main


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


def generation(request_id: str, prompt: str, output: str | list[int], **extra) -> str:
    output_ids = list(output.encode()) if isinstance(output, str) else output
    return json.dumps(
        {
            "request_id": request_id,
            "model": "bytes",
            "prompt_token_ids": list(prompt.encode()),
            "output_token_ids": output_ids,
            **extra,
        }
    )


def detok_run(tokenizer: str, source: Path | str, output: Path | str, *extra: str) -> int:
    """`detok run --tokenizer TOKENIZER --input SOURCE --output OUTPUT EXTRA...`, in process."""
    return main(
        ["run", "--tokenizer", tokenizer, "--input", str(source), "--output", str(output), *extra]
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_run_writes_completions_in_order_and_dead_letters_with_line_numbers(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    source = tmp_path / "in.jsonl"
    lines = [
        generation("b", "Say hi:", " hi 👋", finish_reason="stop"),
        '{"request_id": "broken", ',
        generation("a", "Count:", " 1 2 3"),
        json.dumps(
            {"request_id": "m", "model": "other", "prompt_token_ids": [1], "output_token_ids": [2]}
        ),
        "",
        generation("s", "Fail:", [*b"ok", UNKNOWN_ID, *b"never"]),
        generation("b", "Again", " dup"),
    ]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    code = detok_run(
        f"bytes={tokenizer_file}", source, output, "--dead-letter", str(dead), "--chunk-size", "2"
    )
    assert code == 0
    completions = read_jsonl(output)
    assert [(c["request_id"], c["status"], c["text"]) for c in completions] == [
        ("b", "ok", " hi 👋"),
        ("a", "ok", " 1 2 3"),
        ("s", "failed", "ok"),
    ]
    assert completions[0]["finish_reason"] == "stop"
    assert str(UNKNOWN_ID) in completions[2]["error"]
    letters = read_jsonl(dead)
    assert [(d["line"], d["reason"]) for d in letters] == [
        (2, "malformed_json"),
        (4, "unknown_model"),
        (6, "strict_decode_failure"),
        (7, "schema_violation"),
    ]
    assert letters[0]["original"] == lines[1]
    assert "already appeared" in letters[3]["error"]


def test_chunk_size_does_not_change_completions(tmp_path: Path, tokenizer_file: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(generation(f"r{i}", "Prompt €", "naïve 😀 café " * i) for i in range(6)),
        encoding="utf-8",
    )
    results = []
    for chunk in ("1", "3", "16"):
        output = tmp_path / f"out-{chunk}.jsonl"
        assert detok_run(f"bytes={tokenizer_file}", source, output, "--chunk-size", chunk) == 0
        results.append(output.read_text(encoding="utf-8"))
    assert results[0] == results[1] == results[2]


def test_unreadable_input_or_bad_spec_exit_2(tmp_path: Path, tokenizer_file: Path) -> None:
    out = str(tmp_path / "out.jsonl")
    missing = str(tmp_path / "missing.jsonl")
    assert detok_run(f"bytes={tokenizer_file}", missing, out) == 2
    assert detok_run("bytes", missing, out) == 2
    assert detok_run(f"x={tmp_path / 'nope.json'}", missing, out) == 2


@pytest.mark.parametrize(
    ("output", "dead_letter"),
    [
        ("in.jsonl", None),  # --output equal to --input
        ("out.jsonl", "in.jsonl"),  # --dead-letter equal to --input
        ("./sub/../in.jsonl", None),  # the same file, spelled differently
        ("out.jsonl", "out.jsonl"),  # both outputs on one file: dead letters would be lost
    ],
)
def test_a_run_that_would_overwrite_its_input_or_merge_its_outputs_is_refused(
    tmp_path: Path, tokenizer_file: Path, output: str, dead_letter: str | None, capsys
) -> None:
    (tmp_path / "sub").mkdir()
    source = tmp_path / "in.jsonl"
    content = generation("a", "Hi", " there") + "\n"
    source.write_text(content, encoding="utf-8")
    extra = ["--dead-letter", str(tmp_path / dead_letter)] if dead_letter else []
    code = detok_run(f"bytes={tokenizer_file}", source, tmp_path / output, *extra)
    assert code == 2
    assert "same file" in capsys.readouterr().err
    assert source.read_text(encoding="utf-8") == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "sub", "tokenizer.json"]


def test_an_input_named_like_the_default_dead_letter_file_is_refused(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    source = tmp_path / "out.dead-letters.jsonl"
    content = generation("a", "Hi", " there") + "\n"
    source.write_text(content, encoding="utf-8")
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl") == 2
    assert source.read_text(encoding="utf-8") == content


def test_a_hard_link_to_the_input_is_the_same_file(tmp_path: Path, tokenizer_file: Path) -> None:
    source = tmp_path / "in.jsonl"
    content = generation("a", "Hi", " there") + "\n"
    source.write_text(content, encoding="utf-8")
    (tmp_path / "link.jsonl").hardlink_to(source)
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "link.jsonl") == 2
    assert source.read_text(encoding="utf-8") == content


def test_existing_outputs_survive_a_run_that_fails_midway(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs are written beside their targets and renamed at the end: an interrupted run
    leaves the previous outputs whole and no temporary file behind."""
    source = tmp_path / "in.jsonl"
    source.write_text(generation("a", "Hi", " there") + "\n", encoding="utf-8")
    output, dead = tmp_path / "out.jsonl", tmp_path / "out.dead-letters.jsonl"
    output.write_text("previous completions\n")
    dead.write_text("previous dead letters\n")

    def interrupted(*_args, **_kwargs):
        yield from ()
        raise KeyboardInterrupt

    monkeypatch.setattr("workers.commands.run.run_generations", interrupted)
    with pytest.raises(KeyboardInterrupt):
        detok_run(f"bytes={tokenizer_file}", source, output)
    assert output.read_text() == "previous completions\n"
    assert dead.read_text() == "previous dead letters\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl", "out.dead-letters.jsonl", "out.jsonl", "tokenizer.json",
    ]  # fmt: skip


def test_a_file_in_which_no_line_parses_is_an_error(
    tmp_path: Path, tokenizer_file: Path, capsys
) -> None:
    source = tmp_path / "data.bin"
    source.write_bytes(b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12\x00\x00\nPAR1\xff\n")
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl") == 1
    err = capsys.readouterr().err
    assert "0 completions" in err and "no record of" in err and "jsonl file" in err


def test_an_empty_input_is_fine(tmp_path: Path, tokenizer_file: Path) -> None:
    source = tmp_path / "empty.jsonl"
    source.write_text("")
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl") == 0
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_a_file_of_unknown_models_only_is_an_error_without_the_jsonl_hint(
    tmp_path: Path, tokenizer_file: Path, capsys
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps(
            {"request_id": "m", "model": "other", "prompt_token_ids": [1], "output_token_ids": [2]}
        )
        + "\n"
    )
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out.jsonl") == 1
    err = capsys.readouterr().err
    assert "unknown_model=1" in err and "gave a completion" in err and "JSONL" not in err


def test_an_output_that_is_a_directory_is_exit_2_and_leaves_no_file(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(generation("a", "Hi", " there") + "\n", encoding="utf-8")
    (tmp_path / "out").mkdir()
    assert detok_run(f"bytes={tokenizer_file}", source, tmp_path / "out") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out", "tokenizer.json"]
