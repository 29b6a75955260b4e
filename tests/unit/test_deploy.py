"""deploy/: the compose file, the Dockerfile, Prometheus' scrape targets and the Grafana dashboards
agree with each other and with what the worker actually exports. (No Docker engine is needed: the
files are parsed, not run.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from workers.runtime.prometheus import DEFAULT_METRICS_PORT, PrometheusMetrics
from workers.runtime.settings import WorkerSettings

DEPLOY = REPO_ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").rglob("*.json"))
# What the issue asks the dashboards to show, as the metrics that show it.
REQUIRED_PANELS = {
    "throughput": "detok_generated_tokens_decoded_total",
    "lag": "detok_consumer_lag_messages",
    "dead letters by reason": "detok_dead_letters_total",
    "filtered prompt ids": "detok_prompt_ids_filtered_total",
    "commit latency": "detok_commit_duration_seconds_bucket",
    "restores": "detok_state_restore_duration_seconds_bucket",
    "active requests": "detok_active_requests",
}
METRIC_NAME = re.compile(r"\bdetok_[A-Za-z0-9_]+")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def worker_services() -> dict[str, dict]:
    return {
        name: service
        for name, service in compose()["services"].items()
        if service.get("command") == ["worker"]
    }


def exported_metric_names() -> set[str]:
    """Every series name a fresh worker exposes, plus labelled gauges that have no series until
    their first observation (consumer lag appears with the first statistics callback)."""
    names = set()
    for family in PrometheusMetrics(["gpt2"], registry=None).registry.collect():
        names.update(sample.name for sample in family.samples)
        if family.type == "gauge":
            names.add(family.name)
    return names


def dashboard_expressions(dashboard: dict) -> list[str]:
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            expressions.append(variable["query"]["query"])
    return expressions


def metric_names(expression: str) -> set[str]:
    # Quoted label values are not metric names (a job called "detok_x" would otherwise count).
    return set(METRIC_NAME.findall(QUOTED.sub('""', expression)))


# -- compose and Dockerfile ---------------------------------------------------------------------


def test_compose_wires_kafka_workers_prometheus_and_grafana() -> None:
    services = compose()["services"]
    assert {"kafka", "prometheus", "grafana"} <= services.keys()
    assert len(worker_services()) >= 2
    kafka = services["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert not any("zookeeper" in name for name in services)
    # One node cannot host a transaction log with the defaults (RF 3, min ISR 2).
    assert kafka["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert kafka["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    for service in worker_services().values():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert service["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        assert service["environment"]["DETOK_BOOTSTRAP_SERVERS"].split(":")[0] == "kafka"


def test_worker_environment_names_real_settings_and_unique_instances() -> None:
    fields = set(WorkerSettings.model_fields)
    instance_ids = set()
    for service in worker_services().values():
        environment = service["environment"]
        for variable in environment:
            assert variable.startswith("DETOK_")
            assert variable.removeprefix("DETOK_").lower() in fields, variable
        instance_ids.add(environment["DETOK_INSTANCE_ID"])
        WorkerSettings(**{k.removeprefix("DETOK_").lower(): _env_value(v)
                          for k, v in environment.items()})  # fmt: skip
    # Two workers with one transactional id would fence each other forever.
    assert len(instance_ids) == len(worker_services())


def _env_value(raw: str) -> object:
    return json.loads(raw) if raw.startswith("[") else raw


def test_published_ports_bind_to_loopback_only() -> None:
    for name, service in compose()["services"].items():
        for mapping in service.get("ports", []):
            assert mapping.startswith("127.0.0.1:"), (name, mapping)


def test_prometheus_scrapes_every_worker_on_its_metrics_port() -> None:
    workers = worker_services()
    prometheus = compose()["services"]["prometheus"]
    mounted = {
        volume.split(":")[1]: DEPLOY / volume.split(":")[0]
        for volume in prometheus["volumes"]
        if volume.startswith("./")
    }
    config = yaml.safe_load(mounted["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "detok-workers"]
    targets = {t for static in job["static_configs"] for t in static["targets"]}
    ports = {int(s["environment"]["DETOK_METRICS_PORT"]) for s in workers.values()}
    assert ports == {DEFAULT_METRICS_PORT}
    assert targets == {f"{name}:{DEFAULT_METRICS_PORT}" for name in workers}


def test_local_prometheus_config_scrapes_the_demo_workers() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-local.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {t for static in job["static_configs"] for t in static["targets"]}
    assert targets == {f"127.0.0.1:{DEFAULT_METRICS_PORT + i}" for i in range(2)}


def test_dockerfile_serves_metrics_on_the_default_port_and_copies_every_package() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"DETOK_METRICS_PORT={DEFAULT_METRICS_PORT}" in dockerfile
    assert re.search(rf"^EXPOSE {DEFAULT_METRICS_PORT}$", dockerfile, re.MULTILINE)
    for package in ("pipeline", "schemas", "workers"):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.MULTILINE), package
    assert "README.md" in dockerfile  # pyproject's `readme`: the build fails without it


def test_grafana_provisioning_points_at_the_mounted_dashboards_and_prometheus() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "detok.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file"
    assert (DEPLOY / mounts[provider["options"]["path"]]).resolve() == (
        DEPLOY / "grafana" / "dashboards"
    ).resolve()
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"


# -- dashboards ---------------------------------------------------------------------------------


def test_there_are_dashboards() -> None:
    assert DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_a_stable_uid_and_a_datasource_variable(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert re.fullmatch(r"detok-[a-z0-9-]+", dashboard["uid"])
    assert dashboard.get("id") is None  # ids are per Grafana instance; uids are the identity
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_uids_are_unique() -> None:
    uids = [json.loads(path.read_text())["uid"] for path in DASHBOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_expression_names_only_exported_metrics(path: Path) -> None:
    exported = exported_metric_names()
    for expression in dashboard_expressions(json.loads(path.read_text())):
        names = metric_names(expression)
        assert names, f"no detok metric in {expression!r}"
        assert names <= exported, f"{sorted(names - exported)} not exported: {expression!r}"


def test_dashboards_show_what_operators_need() -> None:
    used = {
        name
        for path in DASHBOARDS
        for expression in dashboard_expressions(json.loads(path.read_text()))
        for name in metric_names(expression)
    }
    missing = {panel: metric for panel, metric in REQUIRED_PANELS.items() if metric not in used}
    assert not missing


def test_metric_name_extraction_ignores_label_values_and_functions() -> None:
    expression = 'sum by (reason) (rate(detok_dead_letters_total{job="detok_x"}[1m])) / time()'
    assert metric_names(expression) == {"detok_dead_letters_total"}
