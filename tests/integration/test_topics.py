"""`detok topics ensure` against the real broker: creates the pipeline's topics with the right
shape, is idempotent, and refuses (without touching anything) topics of the wrong shape."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
from pydantic import ValidationError

from tests.conftest import REPO_ROOT
from tests.integration.conftest import WAIT_BOUND_S, free_port_pair, unique_name
from workers.kafka.topics import (
    OUTPUT_MAX_MESSAGE_BYTES,
    TopicConfigurationMismatch,
    TopicNames,
    ensure_topics,
)

pytestmark = pytest.mark.integration


def unique_topic_names() -> TopicNames:
    """The default names under a per-test prefix, so tests never see each other's topics."""
    prefix = unique_name("t")
    return TopicNames(
        **{role: f"{prefix}.{name}" for role, name in TopicNames().model_dump().items()}
    )


def topic_shapes(bootstrap: str, names: TopicNames) -> dict[str, tuple[int, str]]:
    """(partition count, cleanup.policy) of each topic in `names` that exists."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = admin.list_topics(timeout=WAIT_BOUND_S).topics
    present = [name for name in names.model_dump().values() if name in topics]
    if not present:
        return {}
    resources = [ConfigResource(ResourceType.TOPIC, name) for name in present]
    configs = admin.describe_configs(resources)
    return {
        resource.name: (
            len(topics[resource.name].partitions),
            future.result(timeout=WAIT_BOUND_S)["cleanup.policy"].value,
        )
        for resource, future in configs.items()
    }


def wait_until_listed(bootstrap: str, topic: str) -> None:
    """A topic is created a moment before every broker lists it; `ensure` can only validate a
    topic it sees, so a test that wants one refused waits until it is listed."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + WAIT_BOUND_S
    while topic not in admin.list_topics(timeout=WAIT_BOUND_S).topics:
        if time.monotonic() > deadline:
            pytest.fail(f"{topic} was not listed within the wait bound")
        time.sleep(0.1)


def run_detok(*arguments: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap},
        timeout=120,  # the command itself bounds each admin call at 30 s
        check=False,
    )


def test_default_topic_names() -> None:
    names = TopicNames()
    assert names.input == "detok.tokens"
    assert names.compacted == ("detok.completions", "detok.state-changelog")
    assert names.dead_letters == "detok.dead-letters"


def test_topic_names_must_differ() -> None:
    with pytest.raises(ValidationError, match="own topic"):
        TopicNames(changelog="detok.tokens")


def test_ensure_creates_the_right_shape_then_only_validates(kafka_bootstrap: str) -> None:
    names = unique_topic_names()
    first = ensure_topics(kafka_bootstrap, names, partitions=3)
    assert sorted(first.created) == sorted(names.model_dump().values())
    assert first.validated == ()

    compacted = {names.completions, names.changelog}
    expected = {
        name: (3, "compact" if name in compacted else "delete")
        for name in names.model_dump().values()
    }
    assert topic_shapes(kafka_bootstrap, names) == expected

    second = ensure_topics(kafka_bootstrap, names, partitions=3)
    assert second.created == ()
    assert sorted(second.validated) == sorted(names.model_dump().values())
    assert topic_shapes(kafka_bootstrap, names) == expected


def test_ensure_refuses_a_changelog_unlike_the_input_and_creates_nothing(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    changelog = create_topic("wrong-changelog", partitions=3)  # neither 4 nor compacted
    wait_until_listed(kafka_bootstrap, changelog)
    names = unique_topic_names().model_copy(update={"changelog": changelog})
    with pytest.raises(TopicConfigurationMismatch, match="changelog") as refusal:
        ensure_topics(kafka_bootstrap, names, partitions=4)
    assert "cleanup.policy=compact" in str(refusal.value)
    assert set(topic_shapes(kafka_bootstrap, names)) == {changelog}


def test_cli_ensure_is_idempotent_and_refuses_a_mismatch(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    names = unique_topic_names()
    flags = [
        argument
        for role, name in names.model_dump().items()
        for argument in (f"--{role.replace('_', '-')}-topic", name)
    ]
    for _ in range(2):
        result = run_detok(
            "topics", "ensure", "--partitions", "2", *flags, bootstrap=kafka_bootstrap
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout.count("validated") == len(names.all) == 7
    assert {count for count, _ in topic_shapes(kafka_bootstrap, names).values()} == {2}

    wrong_changelog = create_topic("cli-wrong-changelog", partitions=5)
    wait_until_listed(kafka_bootstrap, wrong_changelog)
    mismatched = [*flags[:-1], wrong_changelog]
    refused = run_detok(
        "topics", "ensure", "--partitions", "2", *mismatched, bootstrap=kafka_bootstrap
    )
    assert refused.returncode != 0
    assert "refused" in refused.stderr and "changelog" in refused.stderr


def topic_limits(bootstrap: str, names: TopicNames) -> dict[str, int]:
    """max.message.bytes of each topic in `names`, by role."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resources = {ConfigResource(ResourceType.TOPIC, name): role for role, name in names}
    return {
        resources[resource]: int(future.result(timeout=WAIT_BOUND_S)["max.message.bytes"].value)
        for resource, future in admin.describe_configs(list(resources)).items()
    }


def test_ensure_sets_record_limits_the_outputs_and_dead_letters_need(kafka_bootstrap: str) -> None:
    """Contract 6: every output and the changelog accept records up to 8 MiB, and the dead-letter
    topic any record of the input or the changelog plus its error headers."""
    names = unique_topic_names()
    ensure_topics(kafka_bootstrap, names, partitions=1)
    limits = topic_limits(kafka_bootstrap, names)
    assert limits.pop("input") == 1_048_588  # left at the broker's default
    assert limits.pop("dead_letters") == OUTPUT_MAX_MESSAGE_BYTES + 64 * 1024
    # Stop signals are small, but the limit bounds a batch: 20k requests ending together fill one.
    assert limits.pop("control") == OUTPUT_MAX_MESSAGE_BYTES
    assert limits == dict.fromkeys(["deltas", "completions", "metrics", "changelog"], 8 << 20)


def test_ensure_follows_a_larger_input_limit_and_raises_lower_existing_ones(
    kafka_bootstrap: str, create_topic: Callable[..., str]
) -> None:
    big_input = create_topic("big-input", partitions=1, config={"max.message.bytes": "20000000"})
    low_deltas = create_topic("low-deltas", partitions=1, config={"max.message.bytes": "1000"})
    for topic in (big_input, low_deltas):
        wait_until_listed(kafka_bootstrap, topic)
    names = unique_topic_names().model_copy(update={"input": big_input, "deltas": low_deltas})
    result = ensure_topics(kafka_bootstrap, names, partitions=1)
    assert result.raised_limits == (low_deltas,)
    limits = topic_limits(kafka_bootstrap, names)
    assert limits["input"] == 20_000_000
    assert limits["dead_letters"] == 20_000_000 + 64 * 1024
    assert limits["deltas"] == 8 << 20
    assert ensure_topics(kafka_bootstrap, names, partitions=1).raised_limits == ()


def test_cli_ensure_with_the_broker_down_says_so() -> None:
    result = run_detok("topics", "ensure", bootstrap=f"127.0.0.1:{free_port_pair()}")
    assert result.returncode == 1
    assert "no Kafka broker answered" in result.stderr and "Traceback" not in result.stderr
