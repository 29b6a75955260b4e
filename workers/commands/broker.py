"""`detok broker start|stop|status`: the local Kafka broker of `workers.local.broker`, one node by
default or a cluster with `--brokers N` (a data directory holds one or the other)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.commands.options import positive_int
from workers.local.broker import (
    DEFAULT_DATA_DIR,
    DEFAULT_PORT,
    LOOPBACK,
    BrokerError,
    answers_metadata,
    broker_status,
    cluster_layout,
    cluster_status,
    is_cluster,
    single_node_status,
    start_broker,
    start_cluster,
    start_node,
    stop_broker,
    stop_cluster,
    stop_node,
)
from workers.local.secure_broker import probe_properties, start_secure_broker


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "broker",
        help="run a local Apache Kafka broker (KRaft), or a cluster, from Maven Central jars",
        description=(
            f"A real Kafka broker on {LOOPBACK} for tests and the demo. Default port "
            f"{DEFAULT_PORT} (controller: port+1); default data dir {DEFAULT_DATA_DIR}. "
            "With --brokers N, a cluster of N combined broker+controller nodes: clients on "
            "ports P..P+N-1, controllers on P+N..P+2N-1."
        ),
    )
    actions = parser.add_subparsers(dest="broker_action", required=True, metavar="ACTION")

    start = actions.add_parser(
        "start",
        help="fetch jars if needed, start, wait until ready; prints KAFKA_BOOTSTRAP_SERVERS",
    )
    start.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help="client port")
    start.add_argument(
        "--brokers",
        type=positive_int,
        default=1,
        help="nodes: 1 (default) is a single broker; 3 is a replicated cluster",
    )
    start.add_argument(
        "--security",
        choices=["plaintext", "sasl-ssl"],
        default="plaintext",
        help="sasl-ssl (one broker only): TLS + SCRAM users admin/worker/reader/producer, ACLs "
        "enforced; writes <user>.properties client configs into the data dir "
        "(see workers/local/secure_broker.py)",
    )
    start.set_defaults(func=_cli_start)

    stop = actions.add_parser("stop", help="stop the broker or every node (SIGTERM, SIGKILL)")
    stop.set_defaults(func=_cli_stop)

    status = actions.add_parser("status", help="say whether the broker (or each node) runs")
    status.add_argument("--json", action="store_true", help="every node as a JSON list")
    status.set_defaults(func=_cli_status)

    for action in (start, stop):
        action.add_argument(
            "--node",
            type=positive_int,
            help="only this node of a cluster (start restarts it in the existing cluster)",
        )
    for action in (start, stop, status):
        action.add_argument(
            "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="broker state directory"
        )


def _cli_start(args: argparse.Namespace) -> int:
    try:
        if args.security != "plaintext" and (args.node is not None or args.brokers > 1):
            print("detok broker start: --security is for one broker", file=sys.stderr)
            return 2
        if args.node is not None:
            node = start_node(args.data_dir, args.node)
            print(f"Kafka node {node.node_id} pid {node.pid}, data dir {node.data_dir}")
            bootstrap = cluster_layout(args.data_dir).bootstrap_servers
        elif args.brokers > 1:
            layout = start_cluster(args.brokers, args.port, args.data_dir)
            for node in cluster_status(args.data_dir, layout):
                print(f"Kafka node {node.node_id} pid {node.pid} on {LOOPBACK}:{node.port}")
            print(f"cluster data dir {layout.data_dir}")
            bootstrap = layout.bootstrap_servers
        elif args.security == "sasl-ssl":
            secured = start_secure_broker(port=args.port, data_dir=args.data_dir)
            print(f"Kafka broker pid {secured.running.pid}, data dir {secured.running.data_dir}")
            for user, path in secured.client_configs.items():
                print(f"KAFKA_CONFIG_{user.upper()}={path}")
            bootstrap = secured.running.bootstrap_servers
        else:
            broker = start_broker(port=args.port, data_dir=args.data_dir)
            print(f"Kafka broker pid {broker.pid}, data dir {broker.data_dir}")
            bootstrap = broker.bootstrap_servers
    except BrokerError as error:
        print(f"detok broker start: {error}", file=sys.stderr)
        return 1
    # Last line of stdout, so `eval "$(detok broker start | tail -1)"` or `export $(...)` works.
    print(f"KAFKA_BOOTSTRAP_SERVERS={bootstrap}")
    return 0


def _cli_stop(args: argparse.Namespace) -> int:
    try:
        if args.node is not None:
            node = stop_node(args.data_dir, args.node)
            state = f"stopped pid {node.pid}" if node.running else "was not running"
            print(f"Kafka node {node.node_id} on {LOOPBACK}:{node.port} {state}")
            return 0
        if is_cluster(args.data_dir):
            for node in stop_cluster(args.data_dir):
                state = f"stopped pid {node.pid}" if node.running else "was not running"
                print(f"Kafka node {node.node_id} on {LOOPBACK}:{node.port} {state}")
            return 0
    except BrokerError as error:
        print(f"detok broker stop: {error}", file=sys.stderr)
        return 1
    stopped = stop_broker(args.data_dir)
    if stopped is None:
        print(f"no Kafka broker was running for {args.data_dir.resolve()}")
    else:
        print(f"stopped Kafka broker pid {stopped.pid} on {stopped.bootstrap_servers}")
    return 0


def _cli_status(args: argparse.Namespace) -> int:
    if args.json:
        nodes = (
            cluster_status(args.data_dir)
            if is_cluster(args.data_dir)
            else [single_node_status(args.data_dir)]
        )
        print(json.dumps([node.to_json() for node in nodes], indent=2))
        return 0 if any(node.running for node in nodes) else 1
    if is_cluster(args.data_dir):
        layout = cluster_layout(args.data_dir)
        nodes = cluster_status(args.data_dir, layout)
        for node in nodes:
            state = f"running, pid {node.pid}" if node.running else "not running"
            print(f"node {node.node_id} ({'+'.join(node.roles)}) {LOOPBACK}:{node.port}: {state}")
        print(f"KAFKA_BOOTSTRAP_SERVERS={layout.bootstrap_servers}")
        return 0 if any(node.running for node in nodes) else 1
    broker = broker_status(args.data_dir)
    if broker is None:
        print(f"not running (data dir {args.data_dir.resolve()})")
        return 1
    probe = probe_properties(broker.data_dir)
    ready = answers_metadata(broker.bootstrap_servers, probe)
    state = "ready" if ready else "starting or unresponsive"
    print(f"running ({state}): pid {broker.pid}, data dir {broker.data_dir}")
    print(f"KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap_servers}")
    return 0
