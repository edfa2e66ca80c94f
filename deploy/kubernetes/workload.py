"""The exporter itself: its headless Service and its StatefulSet, in probe mode by default."""

from __future__ import annotations

from .deployment import IMAGE_NAME, NAME, PORT, PORT_NAME, Deployment, image_transform

CONFIG_MAP = NAME + "-config"
CONFIG_DIR = "/etc/kvcache-exporter"
CONFIG_FILE = "exporter.yml"
UID = 10490  # the image's kvcache user (Dockerfile)


def service(deployment: Deployment) -> dict:
    """Headless: it gives each replica the DNS name that the probe relabeling shards engines to,
    and lets the ServiceMonitor find every replica's own /metrics."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": deployment.metadata(),
        "spec": {
            "clusterIP": "None",
            "selector": deployment.labels,
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def _http_probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": PORT_NAME}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def container(deployment: Deployment) -> dict:
    return {
        "name": "exporter",
        "image": IMAGE_NAME,  # made the deployment's image by the kustomization's `images:`
        "args": [f"--config.file={CONFIG_DIR}/{CONFIG_FILE}"],
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "livenessProbe": _http_probe("/healthz", period=10, failures=3),
        "readinessProbe": _http_probe("/ready", period=5, failures=2),
        # Probes keep an engine's history, not its page: memory grows with the engines a
        # replica probes, and a poll reads at most max_response_bytes (16 MiB) at a time.
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def stateful_set(deployment: Deployment) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": deployment.metadata(),
        "spec": {
            "serviceName": NAME,
            "replicas": deployment.replicas,
            # Replicas are independent shards: no reason to start or stop them one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": deployment.labels},
            "template": {
                "metadata": {"labels": {**deployment.labels, "app.kubernetes.io/part-of": NAME}},
                "spec": {
                    "automountServiceAccountToken": False,  # the exporter never calls the API server
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": UID,
                        "runAsGroup": UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "terminationGracePeriodSeconds": 10,
                    # Spread shards over nodes, so one node's loss blinds as few engines as it can.
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": deployment.labels},
                    }],
                    "containers": [container(deployment)],
                    "volumes": [
                        {"name": "config", "configMap": {"name": CONFIG_MAP}},
                        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
                    ],
                },
            },
        },
    }


def kustomization(resources: list[str], deployment: Deployment) -> dict:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": deployment.namespace,
        "resources": resources,
        # The one place the exporter's image is set (`kustomize edit set image`, an overlay's `images:`, --image).
        "images": [image_transform(deployment.image)],
        # The config's content hash becomes part of the ConfigMap's name, so a changed
        # configuration rolls the replicas instead of waiting for them to notice.
        "configMapGenerator": [{"name": CONFIG_MAP, "files": [CONFIG_FILE],
                                "options": {"labels": {"app.kubernetes.io/part-of": NAME}}}],
    }
