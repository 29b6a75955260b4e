"""Chat outputs on a real broker: a worker killed with kill -9 while its requests are inside a
reasoning block, a marker or a call's arguments restores each request's parser from the
changelog and ends with `detok run`'s reasoning, content and tool calls, every piece of every
delta field published once (issue 30 item 6)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.worker_harness import (
    NewPipelineRun,
    models,
    read_topic,
    wait_exit,
    worker_tokenizers,
)
from workers.io.replay import replay

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARSERS = [
    "--reasoning-parser", "qwen2=qwen3", "--tool-parser", "qwen2=hermes",
    "--reasoning-parser", "gpt2=deepseek_r1", "--tool-parser", "gpt2=llama3_json",
]  # fmt: skip
IDLE_EXIT = ["--exit-when-idle", "3"]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
]
WORDS = (
    "the", "city", "sky", "is", "clear", "today", "so", "we", "check", "rain", "wind", "and",
    "sun", "over", "the", "hills",
)  # fmt: skip
# Every marker character the workload's text holds only inside markers: a delta field holding
# one shows a marker (or a piece of one) leaked to a reader.
MARKER_CHARS = ("<", ">")


def chat_generations(count: int, seed: int) -> list[dict]:
    """Logged generations whose text has reasoning, content and calls, the markers spelled as
    plain text: qwen2 with qwen3 + hermes (half the prompts end in `<think>`), gpt2 with
    deepseek_r1 + llama3_json; three requests in four offer tools (a qwen2 one that does not
    keeps its calls as content)."""
    rng = random.Random(seed)
    tokenizers = worker_tokenizers()
    generations = []
    for index in range(count):
        model = "qwen2" if index % 2 == 0 else "gpt2"

        def words(low: int, high: int) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

        city = rng.choice(["Paris", "Oslo", "Lima", "Kyoto"])
        if model == "qwen2":
            calls = "".join(
                '<tool_call>\n{"name": "get_weather", "arguments": '
                f'{{"city": "{city}", "day": {day}}}}}\n</tool_call>'
                for day in range(rng.randint(0, 2))
            )
            prompt = "Weather?<think>\n" if index % 4 == 0 else "Weather?"
            text = f"{words(4, 24)}</think>\n\n{words(0, 10)}{calls}"
        else:
            prompt = "Weather?"
            if index % 4 == 1:
                answer = f'{{"name": "get_weather", "parameters": {{"city": "{city}"}}}}'
            else:
                answer = words(1, 12)
            text = f"<think>{words(4, 24)}</think>{answer}"
        tok = tokenizers[model]
        generation = {
            "request_id": f"chat-{index:04d}",
            "model": model,
            "prompt_token_ids": tok.encode(prompt, add_special_tokens=False).ids,
            "output_token_ids": tok.encode(text, add_special_tokens=False).ids,
            "finish_reason": "stop",
        }
        if index % 8 not in (2, 3):
            generation["tools"] = TOOLS
        generations.append(generation)
    return generations


def detok_run(source: Path, tmp_path: Path) -> dict[str, dict]:
    """`detok run` with the same parsers: the answer the Kafka run must equal."""
    output = tmp_path / "offline.jsonl"
    command = [
        sys.executable, "-m", "workers.cli", "run", *models().worker_args(), *PARSERS,
        "--input", str(source), "--output", str(output),
        "--dead-letter", str(tmp_path / "offline-dead.jsonl"),
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    lines = output.read_text(encoding="utf-8").splitlines()
    return {c["request_id"]: c for c in map(json.loads, lines)}


def place(have: str, offset: int, piece: str) -> str:
    """A delta field's piece placed by its offset: only the characters past those held."""
    assert offset <= len(have), (offset, have, piece)
    return have + piece[len(have) - offset :]


def assemble(deltas: list[dict]) -> tuple[str, str, dict[int, dict]]:
    """One request's content, reasoning and calls (by index) from its deltas, each piece placed
    by its field's offset, as an at-least-once reader does (docs/chat-outputs.md)."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content = place(content, delta["text_offset"], delta["text"])
        if delta["reasoning"]:
            reasoning = place(reasoning, delta["reasoning_offset"], delta["reasoning"])
        for piece in delta["tool_calls"] or ():
            call = calls.setdefault(piece["index"], {"arguments": ""})
            if piece.get("id") is not None:
                call["id"] = piece["id"]
            function = piece.get("function") or {}
            if function.get("name") is not None:
                call["name"] = function["name"]
            arguments = function.get("arguments") or ""
            call["arguments"] = place(call["arguments"], piece["arguments_offset"], arguments)
    return content, reasoning, calls


def test_chat_outputs_survive_kill_9_with_two_workers(
    pipeline_run: NewPipelineRun, tmp_path: Path
) -> None:
    run = pipeline_run(chat_generations(120, seed=30))
    run.expected = detok_run(run.source, tmp_path)
    expected = run.expected
    assert sum(bool(c["reasoning"]) for c in expected.values()) > 100
    assert sum(c["finish_reason"] == "tool_calls" for c in expected.values()) > 30
    untouched = [c for c in expected.values() if "<tool_call>" in c["text"]]
    assert untouched, "a request without tools must keep its calls as content"

    # Two ids an event: kill -9 lands inside reasoning, markers and arguments of many requests.
    producer = threading.Thread(
        target=replay,
        args=(run.bootstrap, run.source, run.names.input),
        kwargs={"rate": 150.0, "progress": False, "chunk_size": 2},
    )
    producer.start()
    steady = run.start_worker("steady", extra=[*PARSERS, *IDLE_EXIT])
    crashy = run.start_worker("crashy", extra=PARSERS)
    run.wait_for_log(steady, "restored")
    run.wait_for_first_commit(crashy, producer)
    crashy.kill()  # SIGKILL: its open transaction is aborted, its partitions move on
    crashy.wait()
    crashy = run.start_worker("crashy", extra=[*PARSERS, *IDLE_EXIT])
    producer.join()
    assert wait_exit(crashy) == 0
    assert wait_exit(steady) == 0

    run.assert_exactly_once()  # completions equal detok run's; deltas tile the seqs once
    assert list(read_topic(run.bootstrap, run.names.dead_letters)) == []
    deltas: dict[str, list[dict]] = {}
    for _, value, _ in read_topic(run.bootstrap, run.names.deltas):
        delta = json.loads(value)
        deltas.setdefault(delta["request_id"], []).append(delta)
    for request_id, completion in expected.items():
        parts = deltas[request_id]
        for delta in parts:
            offers_tools = "<tool_call>" not in completion["text"]
            fields = [delta["reasoning"] or ""]
            fields += [delta["text"]] if offers_tools else []
            fields += [
                (piece.get("function") or {}).get("arguments") or ""
                for piece in delta["tool_calls"] or ()
            ]
            assert not any(m in f for f in fields for m in MARKER_CHARS), (request_id, delta)
        content, reasoning, calls = assemble(parts)
        assert content == completion["text"], request_id
        assert reasoning == (completion["reasoning"] or ""), request_id
        assert [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for _, c in sorted(calls.items())
        ] == (completion["tool_calls"] or []), request_id
