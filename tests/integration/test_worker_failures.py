"""How a worker fails: a fenced (zombie) worker stops with a non-zero exit and loses nothing."""

from __future__ import annotations

import pytest

from tests.integration.worker_harness import (
    NewPipelineRun,
    make_generations,
    paced_replay,
    wait_exit,
    write_jsonl,
)

pytestmark = pytest.mark.integration


def test_a_fenced_worker_exits_non_zero_and_its_successor_finishes_exactly(
    pipeline_run: NewPipelineRun,
) -> None:
    generations = make_generations(160, seed=31)
    run = pipeline_run(generations)
    # The zombie learns it was fenced only when it next commits, so input must still arrive once
    # the successor has started: the second part is replayed only then. (Replayed on a timer, a
    # zombie that started slowly could finish the whole input first and idle, never fenced.)
    first_part = write_jsonl(run.log_dir / "first.jsonl", generations[:100])
    second_part = write_jsonl(run.log_dir / "second.jsonl", generations[100:])
    producer = run.paced_replay(rate=60.0, source=first_part)
    zombie_dir, successor_dir = run.log_dir / "zombie", run.log_dir / "successor"
    zombie_dir.mkdir()
    successor_dir.mkdir()
    zombie = run.start_worker("same", log_dir=zombie_dir)
    # The successor starts only once the zombie has committed: started on a timer, a zombie
    # slowed by a loaded machine could run init_transactions after its successor and fence it
    # instead (the "successor" then exits non-zero, and the zombie, which never idles out,
    # runs until the wait bound).
    run.wait_for_first_commit(zombie, producer)
    # Same instance id, so the same transactional id: the newcomer's init_transactions fences
    # the first worker, whose next commit fails fatally.
    successor = run.start_worker("same", extra=["--exit-when-idle", "4"], log_dir=successor_dir)
    run.wait_for_log(successor, "assigned partitions")  # it joined: its transactions began
    producer.join()
    paced_replay(run.bootstrap, second_part, run.names.input, rate=60.0).join()
    codes = {"zombie": wait_exit(zombie), "successor": wait_exit(successor)}
    logs = "\n".join(
        f"--- {path.parent.name}/{path.name} ---\n{path.read_text()}"
        for path in sorted([*zombie_dir.glob("*.log"), *successor_dir.glob("*.log")])
    )
    assert codes["zombie"] != 0 and codes["successor"] == 0, f"{codes}\n{logs}"
    run.assert_exactly_once()
