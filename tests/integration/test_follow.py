"""Following requests' committed text (issue 31 item 3): `detok follow REQUEST_ID` started before
the request exists prints its text live and ends at its completion; the library iterator gives
every request's text; a request that never completes ends `follow --timeout` with exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import WAIT_BOUND_S, unique_name
from tests.integration.worker_harness import (
    completions_on,
    make_generations,
    pipeline_topics,
    start_worker,
    stop,
    topic_args,
    wait_for_log,
    worker_log,
)
from workers.io.follow import follow
from workers.io.publish import Publisher
from workers.kafka.topic_names import TopicNames

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def detok_follow(
    bootstrap: str, names: TopicNames, request_id: str, *flags: str
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "follow", request_id, "--bootstrap-servers",
         bootstrap, *topic_args(names)[2:6], *flags],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ.copy(),
    )  # fmt: skip


def finished(process: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=WAIT_BOUND_S * 2)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("detok follow did not end")
    return process.returncode, out, err


def test_follow_prints_a_live_request_and_the_library_follows_all(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    names = pipeline_topics(kafka_bootstrap, partitions=2)
    generations = [g for g in make_generations(6, seed=3) if g["output_token_ids"]]
    live = generations[0]
    followers = {
        "json": detok_follow(kafka_bootstrap, names, live["request_id"], "--json"),
        "plain": detok_follow(kafka_bootstrap, names, live["request_id"]),
        "never": detok_follow(kafka_bootstrap, names, "never-published", "--timeout", "3"),
    }
    log = worker_log(tmp_path, "follow")
    worker = start_worker(kafka_bootstrap, names, unique_name("g"), instance_id="follow",
                          log_dir=tmp_path, log_path=log)  # fmt: skip
    try:
        wait_for_log(log, "restored")
        with Publisher(kafka_bootstrap, names.input, linger_s=0.01) as publisher:
            for g in generations:
                publisher.open(g["request_id"], g["model"], g["prompt_token_ids"])
            # The live request is streamed over a few of the worker's commit intervals.
            for index, token in enumerate(live["output_token_ids"]):
                publisher.append(live["request_id"], [token])
                if index % 5 == 4:
                    time.sleep(0.1)
            publisher.finish(live["request_id"], "stop")
            for g in generations[1:]:
                publisher.append(g["request_id"], g["output_token_ids"])
                publisher.finish(g["request_id"], "stop")
        results = {name: finished(process) for name, process in followers.items()}
        completions = completions_on(kafka_bootstrap, names)
    finally:
        stop(worker)
        for process in followers.values():
            if process.poll() is None:
                process.kill()
                process.communicate()

    expected = completions[live["request_id"]]
    code, out, err = results["json"]
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert "".join(line["text"] for line in lines) == expected["text"]
    assert [line["text_offset"] for line in lines] == [
        sum(len(line["text"]) for line in lines[:i]) for i in range(len(lines))
    ]
    assert lines[-1]["completion"] == expected
    code, out, err = results["plain"]
    assert (code, out) == (0, expected["text"] + "\n"), err
    code, out, err = results["never"]
    assert (code, out) == (1, ""), err
    assert "no completion of 'never-published' before --timeout" in err

    texts: dict[str, str] = {}
    ended = set()
    for update in follow(kafka_bootstrap, names, idle_timeout_s=3):
        texts[update.request_id] = texts.get(update.request_id, "") + update.text
        if update.completion is not None:
            ended.add(update.request_id)
    assert texts == {request_id: c["text"] for request_id, c in completions.items()}
    assert ended == set(completions) and len(ended) == len(generations)
