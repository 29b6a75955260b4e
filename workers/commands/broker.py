"""`detok broker start|stop|status`: the local single-node Kafka broker of `workers.broker`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workers.broker import (
    DEFAULT_DATA_DIR,
    DEFAULT_PORT,
    LOOPBACK,
    BrokerError,
    answers_metadata,
    broker_status,
    start_broker,
    stop_broker,
)
from workers.commands.options import positive_int
from workers.secure_broker import probe_properties, start_secure_broker


def add_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "broker",
        help="run a local single-node Apache Kafka broker (KRaft) from Maven Central jars",
        description=(
            f"A real Kafka broker on {LOOPBACK} for tests and the demo. Default port "
            f"{DEFAULT_PORT} (controller: port+1); default data dir {DEFAULT_DATA_DIR}."
        ),
    )
    actions = parser.add_subparsers(dest="broker_action", required=True, metavar="ACTION")

    start = actions.add_parser(
        "start",
        help="fetch jars if needed, start, wait until ready; prints KAFKA_BOOTSTRAP_SERVERS",
    )
    start.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help="client port")
    start.add_argument(
        "--security",
        choices=["plaintext", "sasl-ssl"],
        default="plaintext",
        help="sasl-ssl: TLS + SCRAM users admin/worker/reader/producer, ACLs enforced; writes "
        "<user>.properties client configs into the data dir (see workers/secure_broker.py)",
    )
    start.set_defaults(func=_cli_start)

    stop = actions.add_parser("stop", help="stop the broker (SIGTERM, then SIGKILL)")
    stop.set_defaults(func=_cli_stop)

    status = actions.add_parser("status", help="say whether the broker runs, and where")
    status.set_defaults(func=_cli_status)

    for action in (start, stop, status):
        action.add_argument(
            "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="broker state directory"
        )


def _cli_start(args: argparse.Namespace) -> int:
    try:
        if args.security == "sasl-ssl":
            secured = start_secure_broker(port=args.port, data_dir=args.data_dir)
            broker = secured.running
        else:
            broker = start_broker(port=args.port, data_dir=args.data_dir)
    except BrokerError as error:
        print(f"detok broker start: {error}", file=sys.stderr)
        return 1
    print(f"Kafka broker pid {broker.pid}, data dir {broker.data_dir}")
    if args.security == "sasl-ssl":
        for user, path in secured.client_configs.items():
            print(f"KAFKA_CONFIG_{user.upper()}={path}")
    # Last line of stdout, so `eval "$(detok broker start | tail -1)"` or `export $(...)` works.
    print(f"KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap_servers}")
    return 0


def _cli_stop(args: argparse.Namespace) -> int:
    stopped = stop_broker(args.data_dir)
    if stopped is None:
        print(f"no Kafka broker was running for {args.data_dir.resolve()}")
    else:
        print(f"stopped Kafka broker pid {stopped.pid} on {stopped.bootstrap_servers}")
    return 0


def _cli_status(args: argparse.Namespace) -> int:
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
