"""With no broker, every Kafka command ends with one clear line and exit 1 within its bound
(issue 16 #16), instead of a traceback. The "broker" is a closed local port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import free_port_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_collect_replay_and_redrive_say_no_broker_answered(tmp_path: Path) -> None:
    bootstrap = f"127.0.0.1:{free_port_pair()}"
    source = tmp_path / "in.jsonl"
    source.write_text('{"request_id": "a", "model": "m", "prompt_token_ids": [1], '
                      '"output_token_ids": [2]}\n')  # fmt: skip
    commands = {
        "collect": ["collect", "--output", str(tmp_path / "out.jsonl")],
        "replay": ["replay", "--input", str(source)],
        "dlq redrive": ["dlq", "redrive"],
    }
    # Run side by side: each waits out its own metadata bound.
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "workers.cli", *arguments, "--bootstrap-servers", bootstrap],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=os.environ.copy(),
        )
        for name, arguments in commands.items()
    }
    for name, process in running.items():
        try:
            _, stderr = process.communicate(timeout=120)  # the commands bound themselves at 15 s
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail(f"detok {name} did not end with the broker down")
        assert process.returncode == 1, (name, stderr)
        assert f"detok {name}: no Kafka broker answered within 15 s" in stderr, (name, stderr)
        assert "Traceback" not in stderr, (name, stderr)
