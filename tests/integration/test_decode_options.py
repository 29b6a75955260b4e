"""Stop strings and logprobs through two exactly-once workers on the real broker, with a kill -9
mid-stream (docs/decode-options.md): the completions equal `detok run`'s, each request has
exactly one committed completion, its deltas tile its seqs up to the stop and concatenate to
its text, and the events after a stop produce nothing (no delta, no dead letter)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    read_topic,
    wait_exit,
    worker_tokenizers,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE_EXIT = ["--exit-when-idle", "3"]
ALTERNATIVES = 3


def with_decode_options(generations: list[dict], seed: int) -> list[dict]:
    """Half the requests get stop strings taken from their own text (so most stop mid-stream
    and the server's later events arrive after the stop), a third get logprobs."""
    rng = random.Random(seed)
    tokenizers = worker_tokenizers()
    for index, generation in enumerate(generations):
        tok = tokenizers[generation["model"]]
        output = generation["output_token_ids"]
        text = tok.decode(output)
        if index % 2 == 0 and len(text) > 8:
            start = rng.randint(len(text) // 4, len(text) // 2)
            generation["stop"] = [text[start : start + rng.randint(1, 4)], "never-ever"]
            generation["include_stop_str_in_output"] = index % 4 == 0
        if index % 3 == 0:
            size = tok.get_vocab_size()
            generation["output_logprobs"] = [-0.125 * (i % 9) for i in range(len(output))]
            generation["output_top_logprobs"] = [
                [[(t + k) % size, -1.0 - k] for k in range(ALTERNATIVES)] for t in output
            ]
    return generations


def test_stop_strings_and_logprobs_survive_kill_9_with_two_workers(
    pipeline_run: NewPipelineRun,
) -> None:
    generations = with_decode_options(make_generations(160, seed=31), seed=31)
    run = pipeline_run(generations)
    kafka_bootstrap, names, expected = run.bootstrap, run.names, run.expected
    stopped = {r for r, c in expected.items() if c["stop_reason"] is not None}
    assert len(stopped) > 30, "the workload must stop requests mid-stream"
    assert sum(c["logprobs"] is not None for c in expected.values()) > 30
    producer = run.paced_replay(rate=60.0)
    steady = run.start_worker("steady", extra=IDLE_EXIT)
    crashy = run.start_worker("crashy")
    run.wait_for_log(steady, "restored")
    run.wait_for_first_commit(crashy, producer)  # both joined; it committed part of the stream
    crashy.kill()  # SIGKILL: its open transaction is aborted, its partitions move on
    crashy.wait()
    crashy = run.start_worker("crashy", extra=IDLE_EXIT)
    producer.join()
    assert wait_exit(crashy) == 0
    assert wait_exit(steady) == 0

    assert run.completions() == expected
    produced = Counter(key.decode() for key, _, _ in read_topic(kafka_bootstrap, names.completions))
    assert set(produced.values()) == {1}, "a later finish must not produce a second completion"
    run.assert_exactly_once()
    assert list(read_topic(kafka_bootstrap, names.dead_letters)) == []
    last_delta_seq: dict[str, int] = {}
    for _, value, _ in read_topic(kafka_bootstrap, names.deltas):
        delta = json.loads(value)
        last_delta_seq[delta["request_id"]] = delta["seq_end"]
    finish_seq = {g["request_id"]: 1 + -(-len(g["output_token_ids"]) // 16) for g in generations}
    cut_short = [r for r in stopped if last_delta_seq[r] < finish_seq[r]]
    assert cut_short, "events after a stop must have been consumed without output"
