"""Autoscaling an engine Deployment on the fleet rules' replica signal (alerts/rules/fleet.py):
a KEDA ScaledObject (Prometheus scaler) and, without KEDA, an HPA on an external metric that prometheus-adapter
serves from the same series. Both read kvcache:fleet_replicas:desired of one model and role (ready + starting +
the replicas its KV-bound backlog needs, or fewer while it queues nothing), with AverageValue 1 per replica:
the scaler's desired count is the series itself. docs/scaling.md, "Autoscaling on KV", says why not raw usage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .deployment import NAME

DESIRED = "kvcache:fleet_replicas:desired"
# External metric names cannot hold colons: prometheus-adapter serves the series under this name.
EXTERNAL_METRIC = "kvcache_fleet_replicas_desired"
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# Scale out at once on a held KV-bound backlog (the rules already count a queue held through their window), at
# most 4 replicas a minute; scale in one replica per 5 minutes after a 5-minute stable window, since a replica
# removed throws its prefix cache away.
SCALE_UP_WINDOW_SECONDS = 60
SCALE_DOWN_WINDOW_SECONDS = 300


@dataclass(frozen=True)
class Scaled:
    """The engine Deployment to scale and the model (P/D group label value) and role whose signal it follows."""

    deployment: str = "vllm-llama"
    namespace: str = "inference"
    model: str = "llama"
    role: str = "unified"
    min_replicas: int = 1
    max_replicas: int = 8

    @property
    def query(self) -> str:
        return f'max({DESIRED}{{model="{self.model}",role="{self.role}"}})'


# A disaggregated model's two Deployments: each role has its own shortage (a decode-side one asks for decode
# replicas, a prefill-side one for prefill replicas), so each follows its own series.
DISAGGREGATED = (Scaled(deployment="vllm-llama-prefill", role="prefill"),
                 Scaled(deployment="vllm-llama-decode", role="decode"))


def behavior() -> dict:
    return {
        "scaleUp": {"stabilizationWindowSeconds": SCALE_UP_WINDOW_SECONDS,
                    "policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}]},
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_SECONDS,
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]},
    }


def _target(scaled: Scaled) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": scaled.deployment}


def scaled_object(scaled: Scaled) -> dict:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": f"{scaled.deployment}-kv", "namespace": scaled.namespace,
                     "labels": {"app.kubernetes.io/part-of": NAME}},
        "spec": {
            "scaleTargetRef": _target(scaled),
            "minReplicaCount": scaled.min_replicas,
            "maxReplicaCount": scaled.max_replicas,
            "pollingInterval": 15,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior()}},
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",
                "metadata": {"serverAddress": PROMETHEUS_URL, "query": scaled.query, "threshold": "1",
                             # No series (Prometheus or the exporter down): hold, do not scale to the minimum.
                             "ignoreNullValues": "false"},
            }],
        },
    }


def horizontal_pod_autoscaler(scaled: Scaled) -> dict:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"{scaled.deployment}-kv", "namespace": scaled.namespace,
                     "labels": {"app.kubernetes.io/part-of": NAME}},
        "spec": {
            "scaleTargetRef": _target(scaled),
            "minReplicas": scaled.min_replicas,
            "maxReplicas": scaled.max_replicas,
            "metrics": [{"type": "External", "external": {
                "metric": {"name": EXTERNAL_METRIC,
                           "selector": {"matchLabels": {"model": scaled.model, "role": scaled.role}}},
                "target": {"type": "AverageValue", "averageValue": "1"},
            }}],
            "behavior": behavior(),
        },
    }


def adapter_rules() -> dict:
    """prometheus-adapter's external rule (its chart's `rules.external`) serving the series without the colons."""
    return {"externalRules": [{
        "seriesQuery": f'{{__name__="{DESIRED}"}}',
        "resources": {"namespaced": False},
        "name": {"matches": f"^{DESIRED}$", "as": EXTERNAL_METRIC},
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (model, role)",
    }]}
