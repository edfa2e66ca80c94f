"""The dashboards as ConfigMaps that Grafana's dashboard sidecar (k8s-sidecar, as in the Grafana
and kube-prometheus-stack Helm charts) loads: one per dashboard, the JSON unchanged."""

from __future__ import annotations

from pathlib import PurePath

from .deployment import NAME, Deployment

# The sidecar's default label; kube-prometheus-stack looks for grafana_dashboard="1".
SIDECAR_LABEL = ("grafana_dashboard", "1")
# The sidecar's folderAnnotation (when enabled) puts the dashboards in the folder the compose stack uses.
FOLDER_ANNOTATION = ("grafana_folder", "KV cache")


def dashboard_config_map(deployment: Deployment, filename: str, text: str) -> dict:
    stem = PurePath(filename).stem
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": deployment.metadata(
            f"{NAME}-dashboard-{stem.removeprefix('kvcache-')}", component="dashboard",
            labels={SIDECAR_LABEL[0]: SIDECAR_LABEL[1]},
            annotations={FOLDER_ANNOTATION[0]: FOLDER_ANNOTATION[1]},
        ),
        "data": {filename: text},
    }
