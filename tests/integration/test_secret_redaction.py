"""A secret librdkafka echoes in its error text never reaches a command's output (issue 32 #5).

The real error, caused for real: an OAUTHBEARER client with librdkafka's built-in unsecured-JWT
token maker and a `sasl.oauthbearer.config` it cannot parse fails to make its token with
"Unrecognized sasl.oauthbearer.config beginning at: <the rest of the value>", which the commands
printed. Every command that talks to Kafka shares the path (`RefusalWatch`, `failures.report`);
each entry point is run once, side by side, against the session's real broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.conftest import WAIT_BOUND_S, unique_name

pytestmark = pytest.mark.integration

# librdkafka reads `principal=bob`, then stops at the next word and quotes from there to the end.
SECRET = "Tr0ub4dor-never-printed"
OAUTH_CLIENT = [
    "-X", "security.protocol=SASL_PLAINTEXT",
    "-X", "sasl.mechanism=OAUTHBEARER",
    "-X", "enable.sasl.oauthbearer.unsecure.jwt=true",
    "-X", f"sasl.oauthbearer.config=principal=bob {SECRET}",
]  # fmt: skip


def command_lines(tmp_path: Path) -> dict[str, list[str]]:
    source = tmp_path / "in.jsonl"
    source.write_text('{"request_id": "a", "model": "m", "prompt_token_ids": [1], '
                      '"output_token_ids": [2]}\n')  # fmt: skip
    topic = unique_name("redaction")
    return {
        "worker": ["worker", "--tokenizer", "m=/not/loaded/before/the/cluster/answers",
                   "--input-topic", topic, "--startup-timeout", "20"],
        "topics ensure": ["topics", "ensure", "--input-topic", topic],
        "replay": ["replay", "--input", str(source), "--topic", topic],
        "collect": ["collect", "--output", str(tmp_path / "out.jsonl"), "--timeout", "5"],
        "dlq redrive": ["dlq", "redrive"],
        "acls grant": ["acls", "grant", "--principal", "User:x", "--role", "reader",
                       "--timeout", "20"],
    }  # fmt: skip


def test_no_command_prints_a_secret_librdkafka_echoed(kafka_bootstrap: str, tmp_path: Path) -> None:
    running = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli",
                *arguments,
                "--bootstrap-servers",
                kafka_bootstrap,
                *OAUTH_CLIENT,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=os.environ.copy(),
        )  # fmt: skip
        for name, arguments in command_lines(tmp_path).items()
    }
    outputs = {}
    for name, process in running.items():
        try:
            outputs[name] = (*process.communicate(timeout=WAIT_BOUND_S), process.returncode)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail(f"detok {name} did not end")
    for name, (stdout, stderr, code) in outputs.items():
        assert code == 1, (name, stderr)
        # The error was met (not some other failure) and is still told, without the secret.
        assert f"detok {name}: Kafka error: Failed to acquire SASL OAUTHBEARER token" in stderr, (
            name,
            stderr,
        )
        assert SECRET not in stdout + stderr, (name, stderr)
        assert "Traceback" not in stderr, (name, stderr)
