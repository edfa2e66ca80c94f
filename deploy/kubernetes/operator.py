"""Prometheus Operator resources: the probe ScrapeConfig, the exporter's own ServiceMonitor and
the PrometheusRule that carries alerts/kvcache-rules.yml."""

from __future__ import annotations

from . import probe
from .deployment import NAME, PORT_NAME, PROBE_INTERVAL_SECONDS, Deployment, seconds

GROUP = "monitoring.coreos.com"


def scrape_config(deployment: Deployment) -> dict:
    plain = probe.probe_scrape_config(deployment)
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "ScrapeConfig",
        "metadata": deployment.metadata(probe.PROBE_JOB, component="probe"),
        "spec": {
            "jobName": plain["job_name"],
            "scrapeInterval": plain["scrape_interval"],
            "scrapeTimeout": plain["scrape_timeout"],
            "metricsPath": plain["metrics_path"],
            "kubernetesSDConfigs": [_operator_roles(sd) for sd in plain["kubernetes_sd_configs"]],
            "relabelings": probe.operator_relabelings(plain["relabel_configs"]),
        },
    }


def _operator_roles(discovery: dict) -> dict:
    """The operator spells discovery roles capitalised: Pod, Node, Service, ..."""
    return {**discovery, "role": discovery["role"].capitalize(),
            "selectors": [{**selector, "role": selector["role"].capitalize()} for selector in discovery["selectors"]]}


def service_monitor(deployment: Deployment) -> dict:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "ServiceMonitor",
        "metadata": deployment.metadata(),
        "spec": {
            "selector": {"matchLabels": deployment.labels},
            "endpoints": [{"port": PORT_NAME, "path": "/metrics", "interval": seconds(PROBE_INTERVAL_SECONDS)}],
        },
    }


def prometheus_rule(deployment: Deployment, rules: dict) -> dict:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "PrometheusRule",
        "metadata": deployment.metadata(NAME + "-rules", component="alerting"),
        "spec": {"groups": rules["groups"]},
    }
