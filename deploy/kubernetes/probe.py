"""Probe mode in Prometheus terms: which engine pods to probe, through which exporter replica.

One list of relabel rules, in Prometheus's own spelling, serves both the Prometheus Operator's
ScrapeConfig (renamed to the operator's camelCase by `operator_relabelings`) and the plain
scrape config for a Prometheus without the operator, so the two cannot disagree.
"""

from __future__ import annotations

from .deployment import (DEFAULT_ENGINE, ENGINE_LABELS, ENGINE_METRICS_PATH, ENGINE_PORT_NAMES, ENGINES,
                         METRICS_PATH_ANNOTATION, MODEL_ANNOTATION, NAME, PROBE_INTERVAL_SECONDS, ROLE_LABEL,
                         ROLE_OF_LABEL_VALUE, Deployment, meta_label, seconds)

PROBE_JOB = "kvcache-probe"
SELF_JOB = NAME
PROBE_PATH = "/probe"
SHARD_LABEL = "__tmp_kvcache_shard"
# Prometheus's relabel keys -> the operator's RelabelConfig fields.
OPERATOR_KEYS = {"source_labels": "sourceLabels", "target_label": "targetLabel", "separator": "separator",
                 "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


def relabel_rules(deployment: Deployment) -> list[dict]:
    rules = [
        # Pending pods have no address yet; finished ones no longer serve.
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_container_init"], "regex": "true", "action": "drop"},
        # One target per pod: the container port that serves the engine's /metrics.
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"],
         "regex": "|".join(ENGINE_PORT_NAMES), "action": "keep"},
        # The URL the exporter polls: the pod's address (IP:port, IPv6 in brackets) and the path.
        {"source_labels": ["__address__"], "target_label": "__param_target",
         "replacement": f"http://$1{ENGINE_METRICS_PATH}"},
        # ... or the path the pod's prometheus.io/path annotation names, where it is an absolute path.
        {"source_labels": ["__address__", meta_label(METRICS_PATH_ANNOTATION, "annotation")],
         "regex": "([^;]+);(/.*)", "target_label": "__param_target", "replacement": "http://$1$2"},
        {"target_label": "__param_engine", "replacement": DEFAULT_ENGINE},
    ]
    # The engine from the pod's label when it names one the exporter knows; otherwise detection.
    rules += [{"source_labels": [meta_label(key)], "regex": f"({'|'.join(ENGINES)})", "target_label": "__param_engine"}
              for key in ENGINE_LABELS]
    # What the pod is a replica of, for the exporter's replica_info until the engine's page says it.
    rules.append({"source_labels": [meta_label(MODEL_ANNOTATION, "annotation")], "regex": "(.+)",
                  "target_label": "__param_model"})
    rules += [{"source_labels": [meta_label(ROLE_LABEL)], "regex": "|".join(values), "target_label": "__param_role",
               "replacement": role} for role, values in _label_values_by_role().items()]
    rules += [
        # The engine's own address as instance (the exporter names the target the same way),
        # and where it runs.
        {"source_labels": ["__address__"], "target_label": "instance"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        # Every probe of one engine goes to the same exporter replica, which keeps that engine's
        # history (pressure state, counter resets) between probes: shard i is StatefulSet pod i.
        {"source_labels": ["__address__"], "modulus": deployment.replicas, "target_label": SHARD_LABEL,
         "action": "hashmod"},
        {"source_labels": [SHARD_LABEL], "target_label": "__address__",
         "replacement": deployment.replica_address("$1")},
    ]
    return rules


def _label_values_by_role() -> dict[str, list[str]]:
    by_role: dict[str, list[str]] = {}
    for value, role in ROLE_OF_LABEL_VALUE.items():
        by_role.setdefault(role, []).append(value)
    return by_role


def operator_relabelings(rules: list[dict]) -> list[dict]:
    return [{OPERATOR_KEYS[key]: value for key, value in rule.items()} for rule in rules]


def probe_scrape_config(deployment: Deployment) -> dict:
    return {
        "job_name": PROBE_JOB,
        "scrape_interval": seconds(PROBE_INTERVAL_SECONDS),
        # The exporter's per-engine timeout (0.8 x its poll interval) ends first, so a hung
        # engine is reported as kvcache_target_up 0 rather than as a failed scrape.
        "scrape_timeout": seconds(PROBE_INTERVAL_SECONDS),
        "metrics_path": PROBE_PATH,
        "kubernetes_sd_configs": [{"role": "pod", "selectors": [{"role": "pod", "label": deployment.pod_selector}]}],
        "relabel_configs": relabel_rules(deployment),
    }


def self_scrape_config(deployment: Deployment) -> dict:
    """The exporter's own /metrics (kvcache_exporter_build_info feeds KVCacheExporterAbsent)."""
    return {
        "job_name": SELF_JOB,
        "scrape_interval": seconds(PROBE_INTERVAL_SECONDS),
        "static_configs": [{"targets": [deployment.replica_address(i) for i in range(deployment.replicas)]}],
    }


def plain_scrape_configs(deployment: Deployment) -> dict:
    return {"scrape_configs": [self_scrape_config(deployment), probe_scrape_config(deployment)]}
