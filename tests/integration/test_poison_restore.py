"""Issue 16 item 4: a changelog record that cannot be restored fails its request, not the worker.

A worker opens requests (prompt and a first tokens event, no finish), writes their snapshots to
the changelog and is stopped with SIGTERM. Then one request's state is made unrestorable, the
way it happens in production: its model is no longer configured, a garbage record lands on the
changelog, or a snapshot lacks a field (an older or newer format). Two workers in turn must then
start, keep running and exit 0 with `--exit-when-idle`; the unrestorable changelog record goes
to the dead-letter topic with its original bytes and reason `restore_failed`, and every other
request, restored or new, completes exactly as `detok run` decodes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.poison_harness import (
    Pipeline,
    Record,
    assert_good_requests_completed,
    assert_runs_twice_cleanly,
    dead_letters,
    expected_completions,
    finish,
    generation_records,
    header_values,
    new_pipeline,
    produce,
    prompt,
    started_worker,
    tokens,
    wait_for_keys,
)
from tests.integration.worker_harness import make_generations, models

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Requests left open across the restart: (request id, model, prompt ids, output ids).
OPEN_REQUESTS = [
    ("open-gpt2-a", "gpt2", [15496, 995], [11, 995, 15496, 995, 13]),
    ("open-gpt2-b", "gpt2", [464, 2068, 7586], [21831, 18045, 625, 262, 16931, 3290]),
    ("open-qwen2", "qwen2", [9707, 11, 1879], [1879, 11, 9707, 13]),
]
FIRST_CHUNK = 2  # ids of each open request sent before the restart (as seq 1)


def _open_generation(request_id: str, model: str, prompt_ids: list[int], ids: list[int]) -> dict:
    return {
        "request_id": request_id,
        "model": model,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": ids,
        "finish_reason": "stop",
    }


def _without_a_field(snapshot: bytes) -> bytes:
    """The worker's own snapshot with one required field taken out (wherever it is nested)."""

    def drop(node: object) -> bool:
        if isinstance(node, dict):
            for name in ("model", "next_seq"):  # `model` has no default in any format
                if name in node:
                    del node[name]
                    return True
            return any(drop(child) for child in node.values())
        if isinstance(node, list):
            return any(drop(child) for child in node)
        return False

    decoded = json.loads(snapshot)
    assert drop(decoded), f"no model/next_seq field in the snapshot to remove: {decoded}"
    return json.dumps(decoded).encode()


def _open_requests_and_stop(pipeline: Pipeline) -> dict[bytes, bytes | None]:
    """Open the requests with a running worker, wait for their snapshots, SIGTERM it.

    Returns the changelog's latest value per key once the worker is gone.
    """
    produce(
        pipeline.bootstrap,
        pipeline.names.input,
        [
            record
            for request_id, model, prompt_ids, ids in OPEN_REQUESTS
            for record in (
                Record(request_id.encode(), prompt(request_id, model, prompt_ids)),
                Record(request_id.encode(), tokens(request_id, 1, ids[:FIRST_CHUNK])),
            )
        ],
    )
    keys = {request_id.encode() for request_id, *_ in OPEN_REQUESTS}
    with started_worker(pipeline, instance_id="opener") as worker:
        wait_for_keys(pipeline.bootstrap, pipeline.names.changelog, keys)
        worker.terminate()
        code = worker.wait()
        assert code == 0, f"the opening worker did not stop cleanly on SIGTERM:\n{worker.tail()}"
    return wait_for_keys(pipeline.bootstrap, pipeline.names.changelog, keys)


@pytest.mark.parametrize("fault", ["model_removed", "garbage_record", "snapshot_missing_field"])
def test_item4_unrestorable_changelog_record_fails_its_request_not_the_worker(
    kafka_bootstrap: str, tmp_path: Path, fault: str
) -> None:
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    changelog = _open_requests_and_stop(pipeline)

    tokenizer_specs = None  # both models, as before the restart
    if fault == "model_removed":
        victim = "open-qwen2"
        tokenizer_specs = [spec for spec in models().specs if spec.startswith("gpt2=")]
        unrestorable = changelog[victim.encode()]
        assert unrestorable is not None
    else:
        victim = "open-gpt2-a"
        if fault == "garbage_record":
            unrestorable = b"\x00\xffnot a snapshot{"
        else:
            unrestorable = _without_a_field(changelog[victim.encode()])
        produce(
            kafka_bootstrap,
            pipeline.names.changelog,
            [Record(victim.encode(), unrestorable, partition=0)],
        )

    # The open requests' remaining events, and new requests, behind the restart.
    good = [g for g in make_generations(20, seed=404) if g["model"] == "gpt2"]
    survivors = [_open_generation(*request) for request in OPEN_REQUESTS if request[0] != victim]
    expected = expected_completions(good + survivors, tmp_path)
    produce(
        kafka_bootstrap,
        pipeline.names.input,
        [
            *(
                record
                for request_id, _, _, ids in OPEN_REQUESTS
                for record in (
                    Record(request_id.encode(), tokens(request_id, 2, ids[FIRST_CHUNK:])),
                    Record(request_id.encode(), finish(request_id, 3)),
                )
            ),
            *generation_records(good),
        ],
    )

    assert_runs_twice_cleanly(pipeline, tokenizer_specs=tokenizer_specs)

    assert_good_requests_completed(pipeline, expected)
    restore_failures = [
        (value, headers)
        for key, value, headers in dead_letters(pipeline)
        if header_values(headers, "__detok.errors.reason") == [b"restore_failed"]
    ]
    assert any(value == unrestorable for value, _ in restore_failures), (
        f"no restore_failed dead letter holds the changelog record of {victim} "
        f"({len(restore_failures)} restore_failed dead letters in all)"
    )
