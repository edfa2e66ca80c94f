"""What a Kubernetes deployment of the exporter is made of: names, namespace, replicas, image, and
how engine pods are found. Every manifest and the plain Prometheus scrape config read these."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvcache_exporter.adapters import ADAPTERS
from kvcache_exporter.config import DEFAULT_LISTEN, DEFAULT_POLL_INTERVAL

REPO = Path(__file__).resolve().parents[2]
NAME = "kvcache-exporter"
PORT = int(DEFAULT_LISTEN.rsplit(":", 1)[1])
PORT_NAME = "http"
# Prometheus probes each engine at the exporter's own default poll cadence, so an engine is
# polled as often in probe mode as in poll mode.
PROBE_INTERVAL_SECONDS = DEFAULT_POLL_INTERVAL
# Pod labels that name the engine; a later key wins. The Gateway API Inference Extension's key,
# then llm-d's newer one. Values other than the exporter's engines leave the engine to detection.
ENGINE_LABELS = ("inference.networking.k8s.io/engine-type", "llm-d.ai/engine-type")
DEFAULT_ENGINE = "auto"  # the exporter recognises the engine from its page
ENGINES = tuple(ADAPTERS)
DEFAULT_POD_SELECTOR = "kvcache-exporter/probe=true"
# Names of the container ports that serve an engine's /metrics (vLLM and SGLang serve it on their API port).
ENGINE_PORT_NAMES = ("http", "metrics")
ENGINE_METRICS_PATH = "/metrics"
# The conventional pod annotation naming another path (trtllm-serve serves /prometheus/metrics).
METRICS_PATH_ANNOTATION = "prometheus.io/path"
# What a pod is a replica of, passed to the probe so that a replica still loading its engine counts as
# starting (kvcache_target_replica_info). The model as the engine names it ("meta-llama/Llama-3.1-8B"),
# so an annotation: a label value cannot hold a "/", and llm-d's llm-d.ai/model label is a short name of
# its own, which would make the new replica one of another model than its pools' `model` label.
MODEL_ANNOTATION = "kvcache-exporter/model"
# llm-d's role label, and the exporter's role for each of its values ("both" is the older spelling).
ROLE_LABEL = "llm-d.ai/role"
ROLE_OF_LABEL_VALUE = {"prefill": "prefill", "decode": "decode", "prefill-decode": "unified", "both": "unified"}


def project_version() -> str:
    """The version in pyproject.toml: the image tag, the same whether or not the package is installed."""
    with open(REPO / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["project"]["version"]


# The exporter's image as the manifests name it: kustomize's image transformer (base/kustomization.yaml's
# `images:`, or an overlay's) maps it to the image the cluster pulls, the one place a user sets it.
IMAGE_NAME = NAME


def default_image() -> str:
    """The image `docker build -t kvcache-exporter:VERSION .` makes: no registry publishes it, so a cluster
    pulls it from where the user pushed it, set once in `images:`."""
    return f"{IMAGE_NAME}:{project_version()}"


def image_transform(image: str) -> dict[str, str]:
    """The kustomize `images:` entry that makes the manifests' IMAGE_NAME `image` (REPOSITORY[:TAG] or
    REPOSITORY@DIGEST)."""
    repository, at, digest = image.partition("@")
    if at:
        return {"name": IMAGE_NAME, "newName": repository, "digest": digest}
    head, colon, tag = repository.rpartition(":")
    if colon and "/" not in tag:  # a colon in the last part is a tag's, else a registry's port
        return {"name": IMAGE_NAME, "newName": head, "newTag": tag}
    return {"name": IMAGE_NAME, "newName": repository}


def meta_label(pod_label: str, kind: str = "label") -> str:
    """The discovery meta label under which Prometheus shows a pod label (or, with kind="annotation", an
    annotation)."""
    return f"__meta_kubernetes_pod_{kind}_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def seconds(value: float) -> str:
    """A duration as Prometheus and the exporter read it."""
    return f"{value:g}s"


@dataclass(frozen=True)
class Deployment:
    namespace: str = "monitoring"
    replicas: int = 2
    image: str = field(default_factory=default_image)
    pod_selector: str = DEFAULT_POD_SELECTOR

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")

    @property
    def labels(self) -> dict[str, str]:
        """The labels that select the exporter's pods (and so are fixed for the StatefulSet's life)."""
        return {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "exporter"}

    def metadata(self, name: str = NAME, component: str = "exporter", labels: dict | None = None,
                 annotations: dict | None = None) -> dict:
        metadata = {"name": name, "namespace": self.namespace, "labels": {
            "app.kubernetes.io/name": NAME, "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": NAME, **(labels or {})}}
        return {**metadata, "annotations": annotations} if annotations else metadata

    def replica_address(self, ordinal: int | str) -> str:
        """Replica `ordinal` through the headless Service: StatefulSet pods have stable DNS names."""
        return f"{NAME}-{ordinal}.{NAME}.{self.namespace}.svc:{PORT}"
