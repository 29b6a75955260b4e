"""deploy/kubernetes/: every manifest is valid against the Kubernetes schemas, offline, and what
the manifests tell the worker (flags, DETOK_* variables) is something the worker understands.

The outside judge is PyPI `kubernetes-validate` (schemas bundled per Kubernetes release), in
strict mode (an unknown field is an error, as a misspelt one would be silently ignored by the
API server) against one pinned release. It has no schemas for custom resources: the KEDA
ScaledObject and the prometheus-operator ServiceMonitor are listed in CUSTOM_RESOURCES, checked
to be refused only for that reason, and their links to the rest (the scaled StatefulSet, the
group and topic, the partition cap, the scraped port) are checked here instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from tests.conftest import REPO_ROOT
from workers.cli import build_parser
from workers.kafka.topic_names import TopicNames
from workers.runtime.prometheus import DEFAULT_METRICS_PORT
from workers.runtime.settings import WorkerSettings

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
# The release the manifests are written for (PodDisruptionBudget policy/v1, batch/v1 Jobs with
# ttlSecondsAfterFinished: all GA long before it).
KUBERNETES_VERSION = "1.33"
# Custom resources kubernetes-validate has no schema for: validated structurally below.
CUSTOM_RESOURCES = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
# Not an API object: kustomize's own file, read by `kubectl apply -k`.
KUSTOMIZATION = "kustomization.yaml"
# Read by the Kafka configuration (security's workers/kafka/config.py), not a WorkerSettings
# field of its own: the properties file every client reads.
CONFIG_FILE_ENV = "DETOK_KAFKA_CONFIG_FILE"


def manifests() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == KUSTOMIZATION:
            continue
        found += [(path, document) for document in yaml.safe_load_all(path.read_text()) if document]
    return found


def by_kind(kind: str) -> dict:
    (document,) = [d for _, d in manifests() if d["kind"] == kind]
    return document


def container(kind: str) -> dict:
    (found,) = by_kind(kind)["spec"]["template"]["spec"]["containers"]
    return found


def env(kind: str) -> dict[str, dict]:
    return {item["name"]: item for item in container(kind).get("env", [])}


@pytest.mark.parametrize(
    ("path", "document"), manifests(), ids=[f"{p.name}:{d['kind']}" for p, d in manifests()]
)
def test_every_manifest_is_valid_kubernetes(path: Path, document: dict) -> None:
    if (document["apiVersion"], document["kind"]) in CUSTOM_RESOURCES:
        with pytest.raises(SchemaNotFoundError):
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        return
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / KUSTOMIZATION).read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {KUSTOMIZATION}
    assert set(kustomization["resources"]) == files


def test_the_worker_understands_every_variable_the_manifests_set() -> None:
    fields = {f"DETOK_{name.upper()}" for name in WorkerSettings.model_fields}
    for kind in ("StatefulSet", "Job"):
        for name in env(kind):
            assert name in fields or name == CONFIG_FILE_ENV, f"{kind} sets unknown {name}"


def test_the_worker_settings_the_statefulset_gives_are_valid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The StatefulSet's literal values, read from the environment as the pod's worker reads
    them (pydantic-settings parses and validates types and bounds), with the pod name where the
    downward API puts it."""
    for name in [n for n in os.environ if n.startswith("DETOK_")]:
        monkeypatch.delenv(name)
    for name, item in env("StatefulSet").items():
        if name != CONFIG_FILE_ENV:  # read when connecting, from the mounted Secret
            monkeypatch.setenv(name, item.get("value", "detok-worker-0"))
    settings = WorkerSettings()
    assert settings.instance_id == "detok-worker-0"
    assert settings.metrics_port == DEFAULT_METRICS_PORT
    assert settings.static_membership is True


def test_instance_id_is_the_pod_name() -> None:
    """So a restarted pod's transactional id fences its own zombie."""
    assert env("StatefulSet")["DETOK_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )


def test_the_commands_the_manifests_run_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)  # the pods have none either
    parser = build_parser()
    for kind in ("StatefulSet", "Job"):
        args = container(kind)["args"]
        parsed = parser.parse_args(args)  # argparse exits (SystemExit) on an unknown flag
        assert isinstance(parsed, argparse.Namespace)


def test_graceful_shutdown_outlasts_a_commit_and_the_shutdown_timeout() -> None:
    variables = {name: item.get("value") for name, item in env("StatefulSet").items()}
    grace = by_kind("StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    commit_s = int(variables["DETOK_COMMIT_INTERVAL_MS"]) / 1000
    assert grace > commit_s + float(variables["DETOK_SHUTDOWN_TIMEOUT_S"])


def test_probes_and_scraping_use_the_metrics_port() -> None:
    worker = container("StatefulSet")
    (port,) = worker["ports"]
    assert port["containerPort"] == DEFAULT_METRICS_PORT
    assert worker["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    annotations = by_kind("StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(DEFAULT_METRICS_PORT)
    (endpoint,) = by_kind("ServiceMonitor")["spec"]["endpoints"]
    service_ports = {p["name"] for p in by_kind("Service")["spec"]["ports"]}
    assert endpoint["port"] in service_ports


def test_keda_scales_the_statefulset_on_its_group_capped_at_the_partitions() -> None:
    scaled = by_kind("ScaledObject")["spec"]
    statefulset = by_kind("StatefulSet")
    assert scaled["scaleTargetRef"]["kind"] == "StatefulSet"
    assert scaled["scaleTargetRef"]["name"] == statefulset["metadata"]["name"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == env("StatefulSet")["DETOK_GROUP"]["value"]
    assert trigger["metadata"]["topic"] == TopicNames().input
    job_args = container("Job")["args"]
    partitions = int(job_args[job_args.index("--partitions") + 1])
    assert scaled["maxReplicaCount"] == partitions
    # Exactly-once commit markers leave a lag of one per partition: it must neither activate
    # the scaler nor ask for a second replica.
    assert int(trigger["metadata"]["activationLagThreshold"]) > partitions
    assert int(trigger["metadata"]["lagThreshold"]) > partitions


def test_the_secret_holds_the_properties_file_the_workers_read() -> None:
    secret = by_kind("Secret")
    path = Path(env("StatefulSet")[CONFIG_FILE_ENV]["value"])
    assert path.name in secret["stringData"]
    mounts = {m["name"]: m["mountPath"] for m in container("StatefulSet")["volumeMounts"]}
    volumes = by_kind("StatefulSet")["spec"]["template"]["spec"]["volumes"]
    (secret_volume,) = [v for v in volumes if v.get("secret")]
    assert secret_volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert mounts[secret_volume["name"]] == str(path.parent)
    tokenizers = json.loads(env("StatefulSet")["DETOK_TOKENIZERS"]["value"])
    for spec in tokenizers:
        assert spec.split("=", 1)[1].startswith(mounts["tokenizers"] + "/")
