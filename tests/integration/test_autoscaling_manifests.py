"""deploy/kubernetes/autoscaling/: the HPA against the Kubernetes OpenAPI schemas kubernetes-validate ships (1.30,
the oldest the repo documents, to the newest), the KEDA ScaledObject against KEDA's own CRD schema (v2.20.2, vendored
in tests/integration/schemas/ with its source in the header: kubernetes-validate has no KEDA schema), and all three
files on the one series the shipped rules record."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

from deploy.kubernetes import autoscaling
from devtools.harness import REPO
from tests.integration.test_kubernetes import kubernetes_errors, kubernetes_versions

MANIFESTS = REPO / "deploy" / "kubernetes" / "autoscaling"
KEDA_CRD = Path(__file__).with_name("schemas") / "keda.sh_scaledobjects-v2.20.2.yaml"


def manifest(name: str) -> dict:
    return yaml.safe_load((MANIFESTS / name).read_text())


def closed(schema):
    """A structural CRD schema as the API server applies it to our objects: a declared object takes no other
    fields (the API server would prune them silently: here a misspelt field is an error)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


@functools.lru_cache(maxsize=None)
def keda_schema() -> dict:
    crd = next(doc for doc in yaml.safe_load_all(KEDA_CRD.read_text()) if doc)
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return closed(version["schema"]["openAPIV3Schema"])


def keda_errors(obj: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(keda_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_the_hpa_validates_against_every_kubernetes_schema():
    hpa = manifest("hpa.yaml")
    versions = kubernetes_versions()
    assert versions[0] == "1.30.0"
    assert [(version, error) for version in versions if (error := kubernetes_errors(hpa, version))] == []
    broken = copy.deepcopy(hpa)
    broken["spec"]["behavior"]["scaleUp"]["stabilisationWindowSeconds"] = broken["spec"]["behavior"]["scaleUp"].pop(
        "stabilizationWindowSeconds")
    assert "stabilisationWindowSeconds" in kubernetes_errors(broken, "1.30.0")


def test_the_scaled_object_validates_against_kedas_crd():
    scaled = manifest("keda-scaledobject.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert keda_errors(scaled) == []
    broken = copy.deepcopy(scaled)
    broken["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behaviour"] = (
        broken["spec"]["advanced"]["horizontalPodAutoscalerConfig"].pop("behavior"))
    broken["spec"]["maxReplicaCount"] = "8"
    errors = keda_errors(broken)
    assert any("'behaviour' was unexpected" in e for e in errors), errors
    assert any(e.startswith("spec/maxReplicaCount:") for e in errors), errors


def test_prefill_and_decode_are_scaled_apart_on_their_own_roles_signal():
    documents = [doc for doc in yaml.safe_load_all((MANIFESTS / "keda-scaledobjects-pd.yaml").read_text()) if doc]
    assert [keda_errors(doc) for doc in documents] == [[], []]
    targets = {doc["spec"]["scaleTargetRef"]["name"]: doc["spec"]["triggers"][0]["metadata"]["query"]
               for doc in documents}
    assert targets == {"vllm-llama-prefill": f'max({autoscaling.DESIRED}{{model="llama",role="prefill"}})',
                       "vllm-llama-decode": f'max({autoscaling.DESIRED}{{model="llama",role="decode"}})'}


def test_every_scaler_reads_the_recorded_replica_signal_with_stabilisation():
    recorded = {rule.get("record") for group in yaml.safe_load((REPO / "alerts" / "kvcache-rules.yml").read_text())
                ["groups"] for rule in group["rules"]}
    assert autoscaling.DESIRED in recorded
    scaled, hpa = manifest("keda-scaledobject.yaml"), manifest("hpa.yaml")
    adapter = manifest("prometheus-adapter-rules.yaml")["externalRules"][0]
    assert autoscaling.DESIRED in scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert adapter["name"]["as"] == hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert autoscaling.DESIRED in adapter["seriesQuery"]
    # One replica per unit of the signal: the scaler's desired count is the series.
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "1"
    assert hpa["spec"]["metrics"][0]["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    for behavior in (hpa["spec"]["behavior"], scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]):
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 60

