"""A client refused at start-up is freed once its error is handled (issue 32 #14).

confluent-kafka keeps a reference to an exception raised in a callback (`RefusalWatch`), which kept
the refused admin client alive, through the traceback's frames, until interpreter exit: there its
background thread could still call into Python, and a worker pointed at a listener that closes
every connection exited with SIGSEGV now and then. The crash is rare; what is tested is its cause:
the client outliving its error. The listener is a real socket that closes every connection.
"""

from __future__ import annotations

import gc
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from workers.kafka.clients import KafkaConnection, cluster_metadata, make_admin
from workers.kafka.topic_names import TopicNames
from workers.runtime.output_limits import read_output_limits

BOUND_S = 30.0  # the refusal comes within a second; this only turns a hang into a failure


@pytest.fixture
def closing_listener() -> Iterator[str]:
    """A loopback port whose listener accepts and at once closes every connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # so the thread sees `stop`: closing the socket does not end accept()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


def admin_clients() -> int:
    gc.collect()
    return sum(isinstance(thing, AdminClient) for thing in gc.get_objects())


def by_metadata(address: str) -> None:
    cluster_metadata(make_admin(KafkaConnection(address)), BOUND_S)


def by_topic_limits(address: str) -> None:
    read_output_limits(KafkaConnection(address), TopicNames(), BOUND_S, lambda: False)


@pytest.mark.parametrize("start_up", [by_metadata, by_topic_limits], ids=["commands", "worker"])
def test_a_refused_start_up_client_does_not_outlive_its_error(
    closing_listener: str, start_up: Callable[[str], None]
) -> None:
    before = admin_clients()
    with pytest.raises(KafkaException, match="closed every connection"):
        start_up(closing_listener)
    assert admin_clients() == before
