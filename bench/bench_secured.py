"""The SASL_SSL row of `bench/bench_e2e.py --sasl-ssl`: what TLS and SCRAM cost one worker.

A second, secured local broker (`workers.local.secure_broker`: SASL_SSL, SCRAM-SHA-512, ACLs) runs
beside the plaintext one. Each repeat drains the same workload with one exactly-once worker on
the plaintext broker (bench_e2e's own `run_workers`) and then on the secured one, as the `worker`
principal holding only `detok acls grant --role worker`'s ACLs; the best of each is reported
with their ratio. Both brokers share the host, so the pair sees the same machine load.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition

from bench import bench_e2e
from workers.io.replay import replay
from workers.kafka.acls import grant, role_grants
from workers.kafka.clients import KafkaConnection, make_consumer
from workers.kafka.config import read_properties_file
from workers.kafka.topics import delete_topics, ensure_topics
from workers.local import broker
from workers.local.secure_broker import SecureBroker, start_secure_broker


def compare(
    workload: bench_e2e.Workload,
    logs: Path,
    repeats: int,
    plaintext_run: Callable[[Path | None], bench_e2e.WorkerRun],
    note: Callable[[str], None],
) -> dict[str, Any]:
    """Best plaintext and SASL_SSL tokens/s of one exactly-once worker, and the TLS cost."""
    data_dir = Path(tempfile.mkdtemp(prefix="detok-bench-secured-"))
    secured = start_secure_broker(_free_port_pair(), data_dir)
    try:
        admin = _connection(secured, "admin")
        input_topic = f"bench-{uuid.uuid4().hex[:8]}.tokens"
        ensure_topics(admin, bench_e2e.topics("unused", input_topic), bench_e2e.PARTITIONS)
        replay(admin, workload.path, input_topic, chunk_size=bench_e2e.CHUNK, progress=False)
        # One unmeasured drain first: the secured broker is a fresh JVM, and its first run would
        # pay for class loading and JIT, which the long-running plaintext broker paid long ago.
        _secured_run(secured, workload, input_topic, logs)
        plain, sasl_ssl = [], []
        for _ in range(repeats):
            plain.append(plaintext_run(None).tokens_per_s)  # None: no profile
            sasl_ssl.append(_secured_run(secured, workload, input_topic, logs))
            note(
                f"1 worker, exactly-once: plaintext {plain[-1]:,.0f} tokens/s, "
                f"SASL_SSL {sasl_ssl[-1]:,.0f} tokens/s"
            )
        delete_topics(admin, [input_topic])
    finally:
        broker.stop_broker(data_dir)
    best_plain, best_secured = max(plain), max(sasl_ssl)
    return {
        "plaintext_tokens_per_s": best_plain,
        "sasl_ssl_tokens_per_s": best_secured,
        "plaintext_runs": plain,
        "sasl_ssl_runs": sasl_ssl,
        "tls_cost": 1 - best_secured / best_plain,
    }


def _secured_run(
    secured: SecureBroker, workload: bench_e2e.Workload, input_topic: str, logs: Path
) -> float:
    """One exactly-once worker drains `input_topic` as the least-privileged `worker`: tokens/s
    between its first consume and last commit, as bench_e2e measures the plaintext runs."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    names = bench_e2e.topics(prefix, input_topic)
    group = f"{prefix}-group"
    admin = _connection(secured, "admin")
    ensure_topics(admin, names, bench_e2e.PARTITIONS)
    grant(admin, "User:worker", role_grants("worker", names, group))
    worker = bench_e2e.Kafka(
        _connection(secured, "worker"), ("--kafka-config", str(secured.client_configs["worker"]))
    )
    command = bench_e2e.worker_command(
        worker, names, group, workload.specs, "--instance-id", prefix
    )
    log = logs / f"{prefix}-sasl-ssl.log"
    process = bench_e2e.start(command, log)
    ends = _offsets(admin, input_topic, None)
    bench_e2e.wait_for(
        lambda: _offsets(admin, input_topic, group) == ends, "the SASL_SSL worker to commit"
    )
    process.send_signal(signal.SIGTERM)
    if process.wait(bench_e2e.WAIT_BOUND_S) != 0:
        raise RuntimeError(f"SASL_SSL worker failed; see {log}")
    (summary,) = bench_e2e.summaries(log)
    if summary["generated_tokens"] < workload.generated_tokens:
        raise RuntimeError(f"SASL_SSL worker decoded too little; see {log}")
    delete_topics(admin, [name for name in names.model_dump().values() if name != input_topic])
    return workload.generated_tokens / (summary["last_commit_at"] - summary["first_consume_at"])


def _offsets(connection: KafkaConnection, topic: str, group: str | None) -> dict[int, int]:
    """End offsets of `topic` (group None), or `group`'s committed ones."""
    consumer = make_consumer(connection, {"group.id": group or "bench-offsets"})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        if group is None:
            return {
                p: consumer.get_watermark_offsets(TopicPartition(topic, p), 30)[1]
                for p in partitions
            }
        committed = consumer.committed([TopicPartition(topic, p) for p in partitions], 30)
        return {tp.partition: tp.offset for tp in committed}
    finally:
        consumer.close()


def _connection(secured: SecureBroker, user: str) -> KafkaConnection:
    properties = read_properties_file(secured.client_configs[user])
    return KafkaConnection(secured.bootstrap_servers, properties)


def _free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((broker.LOOPBACK, 0))
            port = probe.getsockname()[1]
        if port < 65535 and broker.port_is_free(port) and broker.port_is_free(port + 1):
            return port
    raise RuntimeError("no free loopback port pair found")
