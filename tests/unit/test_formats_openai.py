"""OpenAI shapes, judged by the `openai` package's own models: every `openai-completion` line is an
`openai.types.Completion`, every `openai-batch` body too and every error an `openai.types.
BatchError`; and a Batch output file with vLLM's token ids is read back as logged generations."""

from __future__ import annotations

import json
from pathlib import Path

import openai.types
import pytest

from schemas.events import Completion, Logprobs, TokenLogprob, TopLogprob
from tests.unit.small_tokenizers import UNKNOWN_ID, byte_level
from tests.unit.test_run_command import detok_run, generation, read_jsonl
from workers.formats.jsonl import jsonl_records
from workers.formats.openai import completion_object, openai_batch_records
from workers.io.replay import replay_events


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    byte_level().save(str(path))
    return path


def run_as(tokenizer_file: Path, source: Path, output_format: str) -> list[dict]:
    """`detok run` of `source` in `output_format` (it must exit 0): the output's JSON lines."""
    output = source.with_name(f"out-{output_format}.jsonl")
    code = detok_run(f"bytes={tokenizer_file}", source, output, "--output-format", output_format)
    assert code == 0
    return read_jsonl(output)


@pytest.fixture
def mixed_input(tmp_path: Path) -> Path:
    """ok requests under every kind of finish reason, a failed decode, an unknown model, a line
    that is not JSON."""
    lines = [
        generation("stop", "Say hi:", " hi 👋", finish_reason="stop"),
        generation("length", "Count:", " 1 2 3", finish_reason="length"),
        generation("none", "Q:", " A"),
        generation("abort", "Q:", " cut", finish_reason="abort"),
        generation("fails", "Fail:", [*b"ok", UNKNOWN_ID]),
        json.dumps(
            {"request_id": "m", "model": "other", "prompt_token_ids": [1], "output_token_ids": [2]}
        ),  # fmt: skip
        '{"request_id": "broken", ',
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_every_openai_completion_line_is_an_openai_completion(
    tokenizer_file: Path, mixed_input: Path
) -> None:
    lines = run_as(tokenizer_file, mixed_input, "openai-completion")
    objects = [openai.types.Completion.model_validate(line) for line in lines]
    assert [o.id for o in objects] == ["cmpl-stop", "cmpl-length", "cmpl-none", "cmpl-abort"]
    assert [o.choices[0].finish_reason for o in objects] == ["stop", "length", "stop", "stop"]
    first = objects[0]
    assert first.object == "text_completion" and first.model == "bytes"
    assert first.choices[0].text == " hi 👋" and first.choices[0].index == 0
    assert first.choices[0].logprobs is None and lines[0]["choices"][0]["logprobs"] is None
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (7, len(" hi 👋".encode()))
    assert first.usage.total_tokens == 7 + len(" hi 👋".encode())
    assert len({o.created for o in objects}) == 1


def test_every_openai_batch_line_has_a_completion_body_or_a_batch_error(
    tokenizer_file: Path, mixed_input: Path
) -> None:
    lines = run_as(tokenizer_file, mixed_input, "openai-batch")
    assert all(set(line) == {"id", "custom_id", "response", "error"} for line in lines)
    ok = [line for line in lines if line["response"] is not None]
    failed = [line for line in lines if line["response"] is None]
    for line in ok:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == line["custom_id"]
        body = openai.types.Completion.model_validate(line["response"]["body"])
        assert body.id == f"cmpl-{line['custom_id']}"
    assert [line["custom_id"] for line in ok] == ["stop", "length", "none", "abort"]
    # The line that never parsed has no request id to answer under: it is only a dead letter.
    assert [(line["custom_id"], line["error"]["code"]) for line in failed] == [
        ("fails", "strict_decode_failure"),
        ("m", "unknown_model"),
    ]
    for line in failed:
        error = openai.types.BatchError.model_validate(line["error"])
        assert error.message
    assert len({line["id"] for line in lines}) == len(lines)


def test_logprobs_and_stop_reason_map_to_the_legacy_completions_shape() -> None:
    def top(id_: int, token: str, logprob: float) -> TopLogprob:
        return TopLogprob(id=id_, token=token, bytes=list(token.encode()), logprob=logprob)

    completion = Completion(
        request_id="r",
        model="m",
        text="Hi!",
        status="ok",
        finish_reason="stop",
        prompt_tokens=3,
        generated_tokens=2,
        stop_reason="\n\n",
        logprobs=Logprobs(
            content=[
                TokenLogprob(id=1, token="Hi", bytes=[72, 105], text="Hi", text_offset=0,
                             logprob=-0.25, top_logprobs=[top(1, "Hi", -0.25), top(2, "Ho", -2.0)]),
                TokenLogprob(id=3, token="!", bytes=[33], text="!", text_offset=2,
                             logprob=-0.5, top_logprobs=[top(3, "!", -0.5)]),
            ]
        ),
    )  # fmt: skip
    shaped = completion_object(completion, created=1_700_000_000)
    parsed = openai.types.Completion.model_validate(shaped)
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["Hi", "!"]
    assert logprobs.token_logprobs == [-0.25, -0.5]
    assert logprobs.top_logprobs == [{"Hi": -0.25, "Ho": -2.0}, {"!": -0.5}]
    assert logprobs.text_offset == [0, 2]
    assert "".join(logprobs.tokens) == parsed.choices[0].text
    assert shaped["choices"][0]["stop_reason"] == "\n\n"
    assert parsed.created == 1_700_000_000


def vllm_batch_line(request_id: str, prompt: list[int], output: list[int], *, chat: bool) -> str:
    """A Batch output line as vLLM's run_batch writes it with `return_token_ids`: a completion
    carries both id lists on its choice, a chat completion its prompt ids on the body."""
    choice: dict = {"index": 0, "finish_reason": "stop", "token_ids": output}
    body: dict = {
        "id": f"cmpl-{request_id}",
        "model": "bytes",
        "choices": [choice],
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
    }
    if chat:
        choice["message"] = {"role": "assistant", "content": "..."}
        body["prompt_token_ids"] = prompt
    else:
        choice["text"] = "..."
        choice["prompt_token_ids"] = prompt
    return json.dumps(
        {
            "id": f"vllm-{request_id}",
            "custom_id": request_id,
            "response": {"status_code": 200, "request_id": f"vllm-{request_id}", "body": body},
            "error": None,
        }
    )


def test_a_batch_output_file_with_token_ids_is_read_as_logged_generations(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    batch = tmp_path / "batch-output.jsonl"
    batch.write_text(
        "\n".join(
            [
                vllm_batch_line("a", list(b"Hi"), list(" there 👋".encode()), chat=False),
                vllm_batch_line("b", list(b"Q:"), list(b" caf\xc3\xa9"), chat=True),
                json.dumps({"id": "x", "custom_id": "c", "response": None,
                            "error": {"code": "timeout", "message": "server gave up"}}),
                json.dumps({"id": "y", "custom_id": "d", "response": {"status_code": 200,
                            "request_id": "y", "body": {"model": "bytes",
                            "choices": [{"text": "no ids"}]}}, "error": None}),
            ]
        )
        + "\n",
        encoding="utf-8",
    )  # fmt: skip
    output, dead = tmp_path / "out.jsonl", tmp_path / "dead.jsonl"
    code = detok_run(f"bytes={tokenizer_file}", batch, output, "--input-format", "openai-batch",
                     "--dead-letter", str(dead))  # fmt: skip
    assert code == 0
    assert [(c["request_id"], c["text"], c["prompt_tokens"]) for c in read_jsonl(output)] == [
        ("a", " there 👋", 2),
        ("b", " café", 2),
    ]
    assert [(d["line"], d["reason"]) for d in read_jsonl(dead)] == [
        (3, "schema_violation"),
        (4, "schema_violation"),
    ]
    assert "token_ids" in read_jsonl(dead)[1]["error"]


def test_replay_cuts_a_batch_output_file_into_the_events_of_the_same_generations() -> None:
    batch = [vllm_batch_line("a", list(b"Hi"), list(b" there, you"), chat=False).encode()]
    logged = [generation("a", "Hi", " there, you", finish_reason="stop").encode()]
    assert list(replay_events(openai_batch_records(batch), 4)) == list(
        replay_events(jsonl_records(logged), 4)
    )


def test_a_run_with_stop_strings_and_logprobs_gives_valid_openai_logprobs(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    output_ids = list(b"Hi there.\n\nmore")
    source = tmp_path / "in.jsonl"
    source.write_text(
        generation("r", "Q:", output_ids, finish_reason="stop", stop=["\n\n"],
                   output_logprobs=[-0.1 * (i + 1) for i in range(len(output_ids))],
                   output_top_logprobs=[[[token_id, -0.1 * (n + 1)], [33, -5.0]]
                                        for n, token_id in enumerate(output_ids)]) + "\n",
        encoding="utf-8",
    )  # fmt: skip
    [line] = run_as(tokenizer_file, source, "openai-completion")
    parsed = openai.types.Completion.model_validate(line)
    choice = parsed.choices[0]
    assert choice.text == "Hi there." and line["choices"][0]["stop_reason"] == "\n\n"
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    assert choice.logprobs.token_logprobs[:2] == [-0.1, -0.2]
    assert choice.logprobs.top_logprobs[0] == {"H": -0.1, "!": -5.0}
    offsets = choice.logprobs.text_offset
    assert offsets is not None and offsets[:3] == [0, 1, 2]
