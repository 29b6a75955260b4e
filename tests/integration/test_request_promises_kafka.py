"""Issue 32 items 1, 2 and 3 on a real broker: a running `detok worker` gives every request that
opened exactly one completion and every record one fate, when a producer's record timestamps lag
the wall clock (item 3), when held events carry large headers (item 2), and when a request's
changelog record outgrows the changelog topic mid-stream (item 1).

Each test plants records with a raw producer (any timestamp, any headers), runs one worker with
short configured limits (`--request-ttl`, the changelog's `max.message.bytes`) and reads what it
committed: completions, every completion record of a key (not only the latest) and dead letters.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from tests.integration.conftest import WAIT_BOUND_S
from tests.integration.poison_harness import (
    Pipeline,
    Record,
    WorkerProcess,
    dead_letters,
    expected_completions,
    finish,
    header_values,
    new_pipeline,
    produce,
    prompt,
    read_records,
    started_worker,
    tokens,
)
from tests.integration.worker_harness import wait_until

pytestmark = pytest.mark.integration

GPT2_HELLO_WORLD = [15496, 995]  # "Hello world"
REASON = "__detok.errors.reason"
REQUEST_ID = "__detok.errors.request_id"


def _set_changelog_limit(pipeline: Pipeline, max_bytes: int) -> None:
    """Lower the changelog's `max.message.bytes` after `topics ensure` (which raises a lower one),
    as an operator's cluster policy may: what the worker reads at start and sizes by."""
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})
    entry = ConfigEntry(
        "max.message.bytes", str(max_bytes), incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(
        ResourceType.TOPIC, pipeline.names.changelog, incremental_configs=[entry]
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=WAIT_BOUND_S)


def _completion_records(pipeline: Pipeline, request_id: str) -> list[dict]:
    """Every committed completion record of one request, in order (a compacted topic's reader
    may see duplicates before compaction: exactly one must ever be written)."""
    return [
        json.loads(record.value)
        for record in read_records(pipeline.bootstrap, pipeline.names.completions)
        if record.key == request_id.encode()
    ]


def _reasons_by_value(pipeline: Pipeline) -> dict[bytes | None, list[bytes | None]]:
    """Each dead-lettered value and the reasons of every dead letter holding it."""
    reasons: dict[bytes | None, list[bytes | None]] = {}
    for _, value, headers in dead_letters(pipeline):
        reasons.setdefault(value, []).extend(header_values(headers, REASON))
    return reasons


def _live_worker(worker: WorkerProcess) -> None:
    """Until the worker has restored its partitions: events produced from then on are consumed
    as they come (a live stream, not a backlog)."""
    wait_until(lambda: "restored" in worker.output(), "the worker's restore")


def _wait_exit_zero(worker: WorkerProcess) -> None:
    code = worker.wait()
    assert code == 0, f"worker exited {code}:\n{worker.tail()}"


def _ok_text(request_id: str, output_ids: list[int], tmp_path: Path) -> str:
    """`detok run`'s text for a gpt2 generation of `output_ids` after "Hello world"."""
    generation = {
        "request_id": request_id,
        "model": "gpt2",
        "prompt_token_ids": GPT2_HELLO_WORLD,
        "output_token_ids": output_ids,
        "finish_reason": "stop",
    }
    return expected_completions([generation], tmp_path)[request_id]["text"]


# -- item 3: idleness in the consumer's clock ---------------------------------------------------

TTL_S = 4
SKEW_S = 3 * 86_400  # a backfill keeping three-day-old CreateTimes
FED_EVENTS = 8  # one a second: twice the TTL
FED_IDS = [11, 995, 13, 15496, 11, 995, 13, 15496]


@pytest.mark.slow  # a paced stream of twice the TTL
def test_item3_a_request_fed_every_second_with_old_timestamps_completes_and_a_stopped_one_expires(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Records stamped three days ago, one a second for twice the TTL: the request completes
    `ok`. A request whose producer stops after its first tokens expires a TTL after that event
    was consumed (its error says idle seconds, not days), with the text so far."""
    pipeline = new_pipeline(kafka_bootstrap, tmp_path)
    fed_text = _ok_text("fed", FED_IDS, tmp_path)
    stopped_text = _ok_text("stopped", FED_IDS[:1], tmp_path)

    def stamped(key: str, value: bytes) -> Record:
        return Record(key.encode(), value, timestamp_ms=int((time.time() - SKEW_S) * 1000))

    with started_worker(
        pipeline, "--request-ttl", str(TTL_S), "--exit-when-idle", str(2 * TTL_S)
    ) as worker:
        _live_worker(worker)
        produce(
            kafka_bootstrap,
            pipeline.names.input,
            [
                stamped("fed", prompt("fed", "gpt2", GPT2_HELLO_WORLD)),
                stamped("stopped", prompt("stopped", "gpt2", GPT2_HELLO_WORLD)),
            ],
        )
        for seq, token in enumerate(FED_IDS, start=1):
            time.sleep(1)
            records = [stamped("fed", tokens("fed", seq, [token]))]
            if seq == 1:  # its producer stops after this one
                records.append(stamped("stopped", tokens("stopped", 1, [token])))
            produce(kafka_bootstrap, pipeline.names.input, records)
        time.sleep(1)
        produce(
            kafka_bootstrap, pipeline.names.input, [stamped("fed", finish("fed", FED_EVENTS + 1))]
        )
        _wait_exit_zero(worker)

    fed = _completion_records(pipeline, "fed")
    assert [(c["status"], c["text"]) for c in fed] == [("ok", fed_text)], fed
    (stopped,) = _completion_records(pipeline, "stopped")
    assert (stopped["status"], stopped["text"]) == ("failed", stopped_text), stopped
    idle = re.search(r"no event for (\d+)s", stopped["error"])
    assert idle is not None, stopped["error"]
    # Measured in the consumer's clock: seconds past the TTL, never the records' days of lag.
    assert TTL_S <= int(idle.group(1)) < SKEW_S // 2, stopped["error"]
    letters = [
        (header_values(h, REQUEST_ID), header_values(h, REASON))
        for _, _, h in dead_letters(pipeline)
    ]
    assert letters == [([b"stopped"], [b"ttl_expired"])], letters
