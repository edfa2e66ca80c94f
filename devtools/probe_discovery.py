"""The shipped probe-mode scrape configuration (deploy/kubernetes) run on loopback: Debian's Prometheus is built
without Kubernetes service discovery (promtool rejects `kubernetes_sd_configs` as an unknown field), so the tests
swap only the discovery for file_sd, which hands Prometheus the same `__meta_kubernetes_pod_*` labels that pod
discovery would, and map the exporter replicas' cluster DNS names to loopback addresses with relabel rules appended
after the generated ones; the generated relabel rules run unchanged."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import yaml

from deploy.kubernetes import probe
from deploy.kubernetes.deployment import Deployment
from devtools.harness import REPO

PLAIN_CONFIG = REPO / "deploy" / "kubernetes" / "prometheus" / "kvcache-scrape-configs.yml"


def plain_config() -> dict:
    return yaml.safe_load(PLAIN_CONFIG.read_text())


def job(config: dict, name: str) -> dict:
    [found] = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return found


def with_file_discovery(config: dict, targets_file: Path, replica_urls: list[str]) -> dict:
    """The generated configuration with file_sd instead of Kubernetes discovery, and each replica's
    cluster DNS name mapped to a loopback address (appended after the generated rules)."""
    config = json.loads(json.dumps(config))
    deployment = Deployment()
    to_loopback = [{"source_labels": ["__address__"], "regex": re.escape(deployment.replica_address(i)),
                    "target_label": "__address__", "replacement": urllib.parse.urlsplit(url).netloc}
                   for i, url in enumerate(replica_urls)]
    probe_job = job(config, probe.PROBE_JOB)
    del probe_job["kubernetes_sd_configs"]
    probe_job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
    probe_job["relabel_configs"] += to_loopback
    job(config, probe.SELF_JOB)["relabel_configs"] = to_loopback
    return config
