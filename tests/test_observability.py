"""The observability profile (docs/operations.md, "Dashboards"): every query of the Grafana
dashboard names a metric that /metrics (web) or a worker's scrape exports, Prometheus scrapes
the ports compose gives web and workers, and `docker compose --profile observability config`
accepts the file; the broker's backlog per queue is exported for the dashboard."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conversations import metrics_endpoint
from conversations.metrics import registry
from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "observability" / "grafana" / "dashboards" / "chatmem.json"
SUFFIXES = ("_bucket", "_count", "_sum")

pytestmark = pytest.mark.django_db


def exported(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def queried(expression: str) -> set[str]:
    names = set(re.findall(r"\b(chatmem_[a-z_]+|[a-z]+_[a-z_]+)\b(?=\s*[\[{)\s]|$)", expression))
    return {re.sub(r"(_bucket|_count|_sum)$", "", name) for name in names if "_" in name}


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


@pytest.fixture
def broker_metrics(settings: Any, redis_url: str, monkeypatch: Any) -> str:
    settings.REDIS_URL = settings.CELERY_BROKER_URL = redis_url
    settings.MEMORY_DISPATCH = "celery"
    settings.METRICS_STATE_CACHE_SECONDS = 0.0
    monkeypatch.setattr(metrics_endpoint, "MEMORY_STATE", metrics_endpoint.MemoryStateCache())
    return redis_url


def test_every_dashboard_query_names_a_metric_web_or_workers_export(
    client: Any, broker_metrics: str
) -> None:
    web = client.get("/metrics")
    assert web.status_code == 200
    available = exported(web.content.decode()) | exported(generate_latest(registry()).decode())
    expressions = dashboard_expressions()
    assert len(expressions) >= 10
    used = set().union(*(queried(e) for e in expressions))
    functions = {"histogram_quantile", "sum", "rate", "count"}
    metrics = {name for name in used if name.startswith("chatmem_")}
    assert not (used - metrics - functions), used - metrics - functions  # e.g. `up`: not ours
    assert metrics - available == set()
    # Everything the issue asks the dashboard to show is on it.
    for shown in (
        "chatmem_turn_seconds",
        "chatmem_model_seconds",
        "chatmem_folds_total",
        "chatmem_consolidation_lag_seconds",
        "chatmem_queue_tasks",
        "chatmem_worker_pool_processes",
        "chatmem_summarizer_tokens_total",
        "chatmem_model_input_tokens_total",
    ):
        assert shown in metrics, shown


def test_the_backlog_per_queue_is_the_brokers(client: Any, broker_metrics: str) -> None:
    broker = redis.Redis.from_url(broker_metrics)
    broker.delete("memory", "memory-sweep")
    broker.rpush("memory", "a", "b", "c")
    text = client.get("/metrics").content.decode()
    found = {
        sample.labels["queue"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "chatmem_queue_tasks"
        for sample in family.samples
    }
    assert found == {"memory": 3.0, "memory-sweep": 0.0}
    broker.delete("memory")


def test_prometheus_scrapes_the_ports_compose_gives_web_and_workers() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((ROOT / "observability" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["chatmem-web"]["static_configs"][0]["targets"] == ["web:8000"]
    assert "8000:8000" in compose["services"]["web"]["ports"]
    worker_port = int(compose["services"]["worker"]["environment"]["WORKER_METRICS_PORT"])
    discovered = jobs["chatmem-worker"]["dns_sd_configs"][0]
    assert discovered["names"] == ["worker"] and discovered["port"] == worker_port
    services = compose["services"]
    for name in ("prometheus", "grafana", "flower"):
        assert services[name]["profiles"] == ["observability"], name
    mounted = " ".join(services["grafana"]["volumes"])
    assert "./observability/grafana/dashboards" in mounted
    provider = yaml.safe_load(
        (ROOT / "observability/grafana/provisioning/dashboards/chatmem.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy:
        return [legacy]
    require("docker compose", "neither `docker compose` nor `docker-compose` is installed")
    raise AssertionError("unreachable")


def test_the_observability_profile_is_a_valid_compose_file(tmp_path: Path) -> None:
    command = compose_command()
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    shutil.copytree(ROOT / "observability", tmp_path / "observability")
    checked = subprocess.run(
        [*command, "--profile", "observability", "config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COMPOSE_PROJECT_NAME": "chatmem"},
    )
    assert checked.returncode == 0, checked.stderr
    services = yaml.safe_load(checked.stdout)["services"]
    assert {"prometheus", "grafana", "flower", "web", "worker"} <= set(services)
