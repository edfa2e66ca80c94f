"""Poll mode sharded over replicas (docs/scaling.md, "Replicas in poll mode"): the exporter's file lists the
engines, and replica INDEX of the StatefulSet polls those whose name hashes to INDEX (`--shard INDEX/COUNT`, from
the pod's index). Prometheus scrapes every replica as a target of its own. Add a replica when
kvcache_exporter_poll_lead_ratio stays above exporter/thresholds.py's SHARD_LEAD_RATIO (docs/performance.md)."""

from __future__ import annotations

import copy

from kvcache_exporter import config as exporter_config
from kvcache_exporter.thresholds import SHARD_LEAD_RATIO

from . import operator, workload
from .deployment import Deployment, seconds

# The pod's index in its StatefulSet (Kubernetes 1.28 and later), which the shard is made of.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def poll_mode_config(generated_by: str) -> str:
    """The exporter's file: the engines to poll (examples to replace), the defaults spelled out."""
    defaults = exporter_config.build("defaults", {})
    return (
        generated_by
        + "# Poll mode, sharded: every replica reads this file and polls the targets whose name hashes to its index\n"
        + "# (KVCACHE_EXPORTER_SHARD, set from the pod's index). Replace the examples with your engines.\n"
        + f"poll_interval: {seconds(defaults.poll_interval)}\n"
        + f"timeout: {seconds(defaults.timeout)}\n"
        + "targets:\n"
        + "  - url: http://vllm-0.vllm.serving.svc:8000/metrics\n"
        + "  - url: http://vllm-1.vllm.serving.svc:8000/metrics\n"
        + "  - url: http://sglang-0.sglang.serving.svc:30000/metrics\n"
    )


def stateful_set(deployment: Deployment) -> dict:
    """The probe-mode StatefulSet with each pod's shard in its environment, as many shards as replicas."""
    stateful = copy.deepcopy(workload.stateful_set(deployment))
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [
        {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
        {"name": exporter_config.ENVIRONMENT["shard"], "value": f"$(POD_INDEX)/{deployment.replicas}"},
    ]
    # A replica keeps its share's pages' series, not only their histories: more memory than a probe replica.
    container["resources"] = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    stateful["metadata"]["annotations"] = {
        "kvcache-exporter/add-a-replica-when": f"kvcache_exporter_poll_lead_ratio > {SHARD_LEAD_RATIO:g}"}
    return stateful


def service_monitor(deployment: Deployment) -> dict:
    """Every replica (an endpoint of the headless Service) scraped as a target of its own; a target's series keep
    their identity whichever replica polls it: the replica's address stays on the exporter's own series only."""
    monitor = copy.deepcopy(operator.service_monitor(deployment))
    monitor["spec"]["endpoints"][0]["metricRelabelings"] = [
        {"sourceLabels": ["target"], "regex": ".+", "targetLabel": "instance", "replacement": ""}]
    return monitor
