"""A broker stopped mid-publish (issue 31 item 1): the publisher gives the caller an error for
what it could not deliver in time, or delivers it by retrying once the broker is back; never a
silent loss. The broker is this test's own (`workers.local.broker` on a free port, stopped by pid):
the session's broker is shared by every other test."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import REPO_ROOT, missing_resource
from tests.integration.conftest import WAIT_BOUND_S
from tests.integration.worker_harness import read_topic
from workers.io.publish import FailedRecord, Publisher
from workers.kafka.clients import UndeliveredRecords
from workers.local import broker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUESTS = 10
IDS_PER_REQUEST = 40


@pytest.fixture
def own_broker() -> Iterator[broker.RunningBroker]:
    data_dir = REPO_ROOT / ".kafka-local" / f"publisher-down-{uuid.uuid4().hex[:8]}"
    try:
        # Below the ephemeral range, so the port is still free when the broker restarts.
        running = broker.start_broker(port=broker.free_port_block(2), data_dir=data_dir)
    except broker.BrokerError as error:
        shutil.rmtree(data_dir, ignore_errors=True)
        missing_resource(f"the test's own broker did not start: {error}")
    try:
        yield running
    finally:
        broker.stop_broker(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def publish_half(publisher: Publisher, prefix: str, first_half: bool) -> None:
    """Open every request and append the first half of its ids, or the second half and finish."""
    half = IDS_PER_REQUEST // 2
    for index in range(REQUESTS):
        request_id = f"{prefix}-{index}"
        if first_half:
            publisher.open(request_id, "gpt2", [1, 2, 3])
        for token in range(half) if first_half else range(half, IDS_PER_REQUEST):
            publisher.append(request_id, [token])
        if not first_half:
            publisher.finish(request_id, "length")


def test_a_stopped_broker_gives_an_error_or_a_retry_that_succeeds(
    own_broker: broker.RunningBroker,
) -> None:
    bootstrap = own_broker.bootstrap_servers
    topic = f"pub-down-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=WAIT_BOUND_S)
    # Patient: a delivery timeout longer than the broker's restart, coalescing on. Hasty: 3 s,
    # one event per append (so every event it was asked for is known), failures to on_error.
    patient = Publisher(bootstrap, topic, delivery_timeout_s=600)
    failures: list[FailedRecord] = []
    hasty = Publisher(bootstrap, topic, linger_s=0, delivery_timeout_s=3, on_error=failures.append)
    for publisher, prefix in ((patient, "patient"), (hasty, "hasty")):
        publish_half(publisher, prefix, first_half=True)
        publisher.flush()

    broker.stop_broker(own_broker.data_dir)
    for publisher, prefix in ((patient, "patient"), (hasty, "hasty")):
        publish_half(publisher, prefix, first_half=False)
    with pytest.raises(UndeliveredRecords) as raised:
        hasty.close()
    assert raised.value.report.undelivered == len(failures) > 0

    broker.start_broker(port=own_broker.port, data_dir=own_broker.data_dir)
    report = patient.close()
    assert report.undelivered == 0

    on_topic: dict[str, list[dict]] = {}
    for _, value, _ in read_topic(bootstrap, topic):
        event = json.loads(value)
        on_topic.setdefault(event["request_id"], []).append(event)
    for index in range(REQUESTS):
        # The patient publisher's retries delivered everything, once and in order.
        events = on_topic[f"patient-{index}"]
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert [t for e in events if e["type"] == "tokens" for t in e["token_ids"]] == list(
            range(IDS_PER_REQUEST)
        )
        assert events[-1]["type"] == "finish"
        # The hasty one's events are each on the topic or reported to the caller.
        request_id = f"hasty-{index}"
        asked = set(range(IDS_PER_REQUEST + 2))  # prompt, one event per id, finish
        delivered = {e["seq"] for e in on_topic.get(request_id, [])}
        reported = {f.seq for f in failures if f.request_id == request_id}
        assert asked == delivered | reported, request_id
    assert {f.error for f in failures} == {"_MSG_TIMED_OUT"}
