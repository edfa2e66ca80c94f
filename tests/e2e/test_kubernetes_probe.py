"""Probe mode as deploy/kubernetes/ sets it up, run for real: Debian's Prometheus with the
generated scrape configuration, two exporter replicas with the generated configuration, and
engine pages standing in for engine pods.

The discovery is file_sd handing Prometheus what pod discovery would (devtools/probe_discovery.py); the
generated relabel rules run unchanged. The Kubernetes discovery block itself is checked against the
Prometheus Operator's schema in test_kubernetes.py (the two configurations are asserted equal there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from deploy.kubernetes import probe
from deploy.kubernetes.deployment import METRICS_PATH_ANNOTATION, MODEL_ANNOTATION, ROLE_LABEL, Deployment, meta_label
from devtools import harness
from devtools.harness import REPO
from devtools.harness import PageServer, hang_before_headers, page
from devtools.probe_discovery import job, plain_config, with_file_discovery

KUBERNETES = REPO / "deploy" / "kubernetes"
EXPORTER_CONFIG = KUBERNETES / "base" / "exporter.yml"
FIXTURES = harness.FIXTURES
GIE_LABEL, LLMD_LABEL = "inference.networking.k8s.io/engine-type", "llm-d.ai/engine-type"
MAX_ENGINE_PODS = 24  # bounded: pods are added until both replicas have an engine to probe


def test_plain_scrape_config_passes_promtool(tmp_path):
    config = with_file_discovery(plain_config(), tmp_path / "pods.json", ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([harness.require_binary("promtool"), "check", "config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def hashmod_shard(value: str, modulus: int) -> int:
    """Prometheus's hashmod: the low 64 bits of the MD5 of the value, big-endian, modulo."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus


@dataclass
class EnginePod:
    name: str
    fixture: str  # the page it serves
    labels: dict[str, str] = field(default_factory=dict)
    phase: str = "Running"
    port_name: str = "http"
    init: bool = False
    expected_engine_param: str | None = "auto"  # None: the relabeling must drop it
    expected_engine: str = ""  # what the exporter reports
    hangs: bool = False  # accepts the connection and never answers
    path: str = "/metrics"  # where it serves its page; another one is named by the pod's annotation
    model: str | None = None  # the pod's model annotation
    expected_role_param: str | None = None  # the probe's role parameter; None: none passed
    server: PageServer | None = None

    def route(self):
        return hang_before_headers() if self.hangs else page((FIXTURES / self.fixture).read_text())

    @property
    def address(self) -> str:
        return urllib.parse.urlsplit(self.server.url("/")).netloc

    @property
    def metrics_url(self) -> str:
        return self.server.url(self.path)

    @property
    def target_name(self) -> str:
        """The exporter's default name of the target: host:port, and the path where it is not /metrics."""
        return self.address if self.path == "/metrics" else self.address + self.path

    def discovery(self) -> dict:
        """What Kubernetes pod discovery would hand Prometheus for this pod's container port."""
        meta = {
            "__meta_kubernetes_namespace": "inference",
            "__meta_kubernetes_pod_name": self.name,
            "__meta_kubernetes_pod_ip": "127.0.0.1",
            "__meta_kubernetes_pod_phase": self.phase,
            "__meta_kubernetes_pod_container_name": "engine",
            "__meta_kubernetes_pod_container_init": str(self.init).lower(),
            "__meta_kubernetes_pod_container_port_name": self.port_name,
            "__meta_kubernetes_pod_container_port_number": self.address.rsplit(":", 1)[1],
            **{meta_label(key): value for key, value in self.labels.items()},
        }
        if self.path != "/metrics":
            meta[meta_label(METRICS_PATH_ANNOTATION, "annotation")] = self.path
        if self.model is not None:
            meta[meta_label(MODEL_ANNOTATION, "annotation")] = self.model
        return {"targets": [self.address], "labels": meta}

    def expected_query(self) -> dict[str, list[str]]:
        """The parameters of the pod's probe."""
        query = {"target": [self.metrics_url], "engine": [self.expected_engine_param]}
        if self.model is not None:
            query["model"] = [self.model]
        if self.expected_role_param is not None:
            query["role"] = [self.expected_role_param]
        return query


def engine_pods() -> list[EnginePod]:
    return [
        EnginePod("llama-0", "vllm-v1.txt", {GIE_LABEL: "vllm"}, expected_engine_param="vllm", expected_engine="vllm"),
        # A port named "metrics" is probed too.
        EnginePod("qwen-0", "sglang-0.5.txt", {GIE_LABEL: "sglang"}, port_name="metrics",
                  expected_engine_param="sglang", expected_engine="sglang"),
        # llm-d's key wins over the Inference Extension's.
        EnginePod("qwen-1", "sglang-0.5-no-retractions.txt", {GIE_LABEL: "vllm", LLMD_LABEL: "sglang"},
                  expected_engine_param="sglang", expected_engine="sglang"),
        # No engine label, or one naming another engine: the exporter detects it. A role llm-d may add
        # one day and the exporter does not know: no role passed.
        EnginePod("mistral-0", "vllm-v0.txt", {ROLE_LABEL: "encode"}, expected_engine="vllm"),
        EnginePod("gemma-0", "sglang-0.4.txt", {GIE_LABEL: "triton-trtllm"}, expected_engine="sglang"),
        # trtllm-serve's page is elsewhere: the pod's prometheus.io/path annotation says where.
        EnginePod("trtllm-0", "trtllm-1.3.txt", path="/prometheus/metrics", expected_engine="trtllm"),
        # The exporter's per-engine timeout ends before Prometheus's scrape timeout: the scrape
        # succeeds and says the engine is down.
        EnginePod("stuck-0", "vllm-v1.txt", {GIE_LABEL: "vllm"}, expected_engine_param="vllm", expected_engine="vllm",
                  hangs=True),
        # llm-d's roles. A decode replica still loading its engine (it does not answer): the model from
        # the pod's annotation, as the engine will name it, the role from llm-d's label.
        EnginePod("llama-decode-0", "vllm-v1.txt", {GIE_LABEL: "vllm", ROLE_LABEL: "decode"},
                  expected_engine_param="vllm", expected_engine="vllm", hangs=True,
                  model="meta-llama/Llama-3.1-70B-Instruct", expected_role_param="decode"),
        # vLLM's page does not say its role: the pod's label does, on every pool series.
        EnginePod("llama-prefill-0", "vllm-v1.txt", {ROLE_LABEL: "prefill"}, expected_engine="vllm",
                  expected_role_param="prefill"),
        # llm-d's older spelling of prefill-decode.
        EnginePod("qwen-both-0", "sglang-0.5.txt", {ROLE_LABEL: "both"}, expected_engine="sglang",
                  expected_role_param="unified"),
        # Never probed: not running yet, a port that does not serve /metrics, an init container.
        EnginePod("pending-0", "vllm-v1.txt", phase="Pending", expected_engine_param=None),
        EnginePod("llama-1", "vllm-v1.txt", port_name="grpc", expected_engine_param=None),
        EnginePod("llama-2", "vllm-v1.txt", init=True, expected_engine_param=None),
    ]


def start_pods(stack: contextlib.ExitStack, replicas: int) -> list[EnginePod]:
    """The pods, each serving its page; more probed pods while some replica would have none."""
    pods = engine_pods()
    while True:
        for pod in pods:
            if pod.server is None:
                pod.server = stack.enter_context(PageServer({pod.path: pod.route()}))
        probed = [pod for pod in pods if pod.expected_engine_param]
        if len({hashmod_shard(pod.address, replicas) for pod in probed}) == replicas:
            return pods
        assert len(pods) < MAX_ENGINE_PODS, "could not spread the engines over every replica"
        pods.append(EnginePod(f"extra-{len(pods)}", "vllm-v1.txt", expected_engine="vllm"))


def active_targets(prometheus_url: str, job_name: str) -> list[dict]:
    status, body = harness.http_get(f"{prometheus_url}/api/v1/targets?state=active")
    assert status == 200
    return [t for t in json.loads(body)["data"]["activeTargets"] if t["labels"]["job"] == job_name]


def vector_of(prometheus_url: str, expr: str, size: int) -> list[tuple[dict, float]]:
    """The result of `expr` once it has `size` series."""
    def complete():
        result = harness.prom_vector(prometheus_url, expr)
        return result if len(result) == size else None

    return harness.wait_until(complete, timeout=30, what=f"{size} series of {expr}")


def evaluated_rule_groups(prometheus_url: str) -> list[dict] | None:
    """The loaded rule groups once every rule has been evaluated without error."""
    status, body = harness.http_get(f"{prometheus_url}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"] if status == 200 else []
    rules = [rule for group in groups for rule in group["rules"]]
    return groups if rules and all(rule["health"] == "ok" for rule in rules) else None


def loopback_config(directory: Path) -> Path:
    """The generated exporter configuration, with the loopback engines of this test allowed to be probed."""
    config = yaml.safe_load(EXPORTER_CONFIG.read_text())
    config["probe"]["allow"].append("127.0.0.0/8")
    path = directory / "exporter.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def dashboard_filter_values(prometheus_url: str, name: str, **chosen: str) -> list[str]:
    """The values the fleet dashboard's variable `name` lists, the other variables at `chosen` or All."""
    board = json.loads((REPO / "dashboards" / "generated" / "kvcache-fleet.json").read_text())
    queries = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "query"}
    selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", queries[name]).groups()
    for variable in queries:
        selector = re.sub(rf"\${variable}\b", chosen.get(variable, ".*"), selector)
    status, body = harness.http_get(f"{prometheus_url}/api/v1/label/{label}/values?"
                                    + urllib.parse.urlencode({"match[]": selector}))
    assert status == 200, body
    return sorted(json.loads(body)["data"])


def test_probe_mode_end_to_end(tmp_path):
    deployment = Deployment()
    config = plain_config()
    rules = yaml.safe_load((KUBERNETES / "base" / "prometheusrule.yaml").read_text())["spec"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))

    with contextlib.ExitStack() as stack:
        replicas = []
        for ordinal in range(deployment.replicas):
            (tmp_path / f"replica-{ordinal}").mkdir()
            replicas.append(stack.enter_context(
                harness.exporter(tmp_path / f"replica-{ordinal}", "--config", str(loopback_config(tmp_path)))))
        for replica in replicas:  # probe mode: ready at once, nothing polled until Prometheus asks
            assert harness.http_get(replica.url + "/ready")[0] == 200
            assert harness.series(harness.scrape(replica.url), "kvcache_target_up") == {}

        pods = start_pods(stack, deployment.replicas)
        targets_file = tmp_path / "pods.json"
        targets_file.write_text(json.dumps([pod.discovery() for pod in pods]))
        prometheus_config = {**with_file_discovery(config, targets_file, [r.url for r in replicas]),
                             "global": {"evaluation_interval": "1s"}, "rule_files": [str(tmp_path / "rules.yml")]}
        prometheus = stack.enter_context(harness.prometheus(tmp_path / "prometheus", prometheus_config))

        probed = {pod.address: pod for pod in pods if pod.expected_engine_param}

        def scraped_once():
            targets = active_targets(prometheus.url, probe.PROBE_JOB)
            return targets if len(targets) == len(probed) and all(t["health"] == "up" for t in targets) else None

        targets = harness.wait_until(scraped_once, timeout=60, what="every engine pod probed once")
        replica_of = {urllib.parse.urlsplit(r.url).netloc: ordinal for ordinal, r in enumerate(replicas)}
        for target in targets:
            pod = probed[target["labels"]["instance"]]
            assert (target["labels"]["namespace"], target["labels"]["pod"]) == ("inference", pod.name)
            url = urllib.parse.urlsplit(target["scrapeUrl"])
            assert url.path == "/probe"
            assert urllib.parse.parse_qs(url.query) == pod.expected_query()
            # Each engine goes to the replica its hashmod shard names, every time.
            assert replica_of[url.netloc] == hashmod_shard(pod.address, deployment.replicas)
        assert set(replica_of.values()) == {replica_of[urllib.parse.urlsplit(t["scrapeUrl"]).netloc]
                                            for t in targets}

        up = vector_of(prometheus.url, f'kvcache_target_up{{job="{probe.PROBE_JOB}"}}', len(probed))
        assert {(labels["pod"], labels["engine"], labels["target"], value) for labels, value in up} == {
            (pod.name, pod.expected_engine, pod.target_name, 0.0 if pod.hangs else 1.0) for pod in probed.values()}
        [(_, timeouts)] = harness.prom_vector(
            prometheus.url, 'kvcache_target_scrape_failures_total{pod="stuck-0", reason="timeout"}')
        assert timeouts >= 1

        # The numbers come through: the vLLM V1 page's KV usage, as the fixture's expectations say.
        expected = yaml.safe_load((FIXTURES / "vllm-v1.txt.expected.yml").read_text())["ranks"]["0"]["usage_ratio"]
        [(_, usage)] = harness.prom_vector(prometheus.url, 'kvcache_usage_ratio{pod="llama-0"}')
        assert usage == pytest.approx(expected, rel=1e-9)

        # What each probed pod is a replica of: the starting one as its pod says, the others as their pages
        # say (the vLLM page names no role: the pod's label gives it).
        info = vector_of(prometheus.url, f'kvcache_target_replica_info{{job="{probe.PROBE_JOB}"}}', len(probed))
        replica_of_pod = {labels["pod"]: (labels.get("model"), labels.get("role")) for labels, _ in info}
        assert replica_of_pod["llama-decode-0"] == ("meta-llama/Llama-3.1-70B-Instruct", "decode")
        assert replica_of_pod["llama-prefill-0"] == ("meta-llama/Llama-3.1-8B-Instruct", "prefill")
        assert replica_of_pod["qwen-both-0"] == ("meta-llama/Llama-3.1-8B-Instruct", "unified")
        [(labels, _)] = harness.prom_vector(prometheus.url, 'kvcache_usage_ratio{pod="llama-prefill-0"}')
        assert labels["role"] == "prefill"

        # The fleet dashboard's namespace and pod filters, by their own queries, list where the engines run.
        assert dashboard_filter_values(prometheus.url, "namespace") == ["inference"]
        assert dashboard_filter_values(prometheus.url, "pod", namespace="inference") == sorted(
            pod.name for pod in probed.values())
        assert dashboard_filter_values(prometheus.url, "pod", namespace="elsewhere") == []

        # The exporter's own /metrics, one series per replica, keeps KVCacheExporterAbsent quiet;
        # the rule group from the PrometheusRule loads and evaluates.
        build_info = vector_of(prometheus.url, f'kvcache_exporter_build_info{{job="{probe.SELF_JOB}"}}', len(replicas))
        assert sorted(labels["instance"] for labels, _ in build_info) == sorted(
            urllib.parse.urlsplit(r.url).netloc for r in replicas)
        groups = harness.wait_until(lambda: evaluated_rule_groups(prometheus.url), timeout=30,
                                    what="every rule evaluated once")
        assert [g["name"] for g in groups] == [g["name"] for g in rules["groups"]]
        assert sum(len(g["rules"]) for g in groups) == sum(len(g["rules"]) for g in rules["groups"])
