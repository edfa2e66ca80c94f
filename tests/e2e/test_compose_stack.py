"""The compose stack's own configuration, run for real without Docker.

The very files docker-compose.yml mounts (found through the resolved compose model) run on
Debian's Prometheus and Alertmanager, the exporter and the simulator, on loopback. The only
change is the one Docker's network makes: every `service:port` becomes 127.0.0.1 and a free
port, and container paths become the host paths that compose mounts there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.compose_model import (DATASOURCE_UID, DEMO_SERVICES, command_option, container_ports,
                                    healthcheck_command, host_path, load_launcher, provisioned, resolved,
                                    service_address_pattern)


class Loopback:
    """Stands in for the compose network: each service's `name:port` maps to 127.0.0.1:<free port>."""

    def __init__(self, model: dict):
        self.container_ports = container_ports(model)
        self.local_ports = {(name, port): harness.free_port()
                            for name, ports in self.container_ports.items() for port in ports}
        self.pattern = service_address_pattern(self.container_ports)

    def port(self, name: str) -> int:
        """The local port standing for the service's HTTP port."""
        return self.local_ports[name, self.container_ports[name][0]]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name)}"

    def _replace(self, match) -> str:
        name, port = match.group(1), int(match.group(2))
        # A port that the service does not listen on stays as written, and fails.
        return f"127.0.0.1:{self.local_ports[name, port]}" if (name, port) in self.local_ports else match.group(0)

    def rewrite(self, node):
        """A copy of a loaded YAML document with every service address mapped to loopback."""
        if isinstance(node, dict):
            return {key: self.rewrite(value) for key, value in node.items()}
        if isinstance(node, list):
            return [self.rewrite(value) for value in node]
        if isinstance(node, str):
            return self.pattern.sub(self._replace, node)
        return node


def write_yaml(path: Path, document) -> Path:
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def start_demo_engines(stack: contextlib.ExitStack, model: dict, net: Loopback) -> None:
    """The demo profile's simulators, with the flavor, scenario, speed and seed compose gives them."""
    for name in sorted(DEMO_SERVICES):
        svc = model["services"][name]
        # It binds all interfaces inside its container; here, the loopback port standing for name:port.
        events = net.rewrite(command_option(svc, "kv-events-endpoint").replace("0.0.0.0", name))
        stack.enter_context(start_engine(
            command_option(svc, "flavor"), scenario=command_option(svc, "scenario"),
            port=net.port(name), speed=float(command_option(svc, "speed")),
            seed=int(command_option(svc, "seed")), kv_events_endpoint=events))


def exporter_config(model: dict, net: Loopback, work: Path) -> Path:
    """What the launcher hands the exporter in the demo profile, on loopback."""
    exporter = model["services"]["exporter"]
    launcher = load_launcher()
    launched = launcher.plan(str(host_path(exporter, launcher.USER_CONFIG)), str(host_path(exporter, launcher.DEMO_CONFIG)),
                             str(work / "launched.yml"), {}, lambda host: host in DEMO_SERVICES)
    assert launched == str(work / "launched.yml")
    return write_yaml(work / "exporter.yml", net.rewrite(yaml.safe_load(Path(launched).read_text())))


def prometheus_config(model: dict, net: Loopback) -> dict:
    prometheus = model["services"]["prometheus"]
    config = net.rewrite(yaml.safe_load(host_path(prometheus, command_option(prometheus, "config.file")).read_text()))
    config["rule_files"] = [str(host_path(prometheus, path)) for path in config["rule_files"]]
    return config


def alertmanager_config(model: dict, net: Loopback, work: Path) -> Path:
    alertmanager = model["services"]["alertmanager"]
    source = host_path(alertmanager, command_option(alertmanager, "config.file"))
    return write_yaml(work / "alertmanager.yml", net.rewrite(yaml.safe_load(source.read_text())))


def run_healthcheck(env: dict[str, str]) -> int:
    """The Dockerfile's HEALTHCHECK command, with this interpreter standing in for the image's python."""
    argv = healthcheck_command()
    assert argv[0] == "python"
    return subprocess.run([sys.executable, *argv[1:]], env={**os.environ, **env}, capture_output=True).returncode


def api(url: str) -> dict:
    status, body = harness.http_get(url)
    assert status == 200, f"GET {url}: {status} {body[:500]}"
    return json.loads(body)["data"]


def targets_all_up(prometheus_url: str) -> list[dict] | None:
    targets = api(f"{prometheus_url}/api/v1/targets")["activeTargets"]
    return targets if targets and all(t["health"] == "up" for t in targets) else None


def rule_groups_evaluated(prometheus_url: str) -> list[dict] | None:
    groups = api(f"{prometheus_url}/api/v1/rules")["groups"]
    evaluated = groups and all(not g["lastEvaluation"].startswith("0001-") for g in groups)
    return groups if evaluated else None


def test_compose_configuration_runs_with_the_demo_engines(tmp_path):
    model = resolved("demo")
    net = Loopback(model)
    amtool = harness.require_binary("amtool")
    am_config = alertmanager_config(model, net, tmp_path)
    check = subprocess.run([amtool, "check-config", str(am_config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    with contextlib.ExitStack() as stack:
        start_demo_engines(stack, model, net)
        exporter = stack.enter_context(harness.exporter(tmp_path, "--config", str(exporter_config(model, net, tmp_path)),
                                                        port=net.port("exporter")))
        stack.enter_context(harness.alertmanager(tmp_path / "alertmanager", am_config,
                                                 port=net.port("alertmanager")))
        prometheus = stack.enter_context(harness.prometheus(tmp_path / "prometheus", prometheus_config(model, net),
                                                           port=net.port("prometheus")))

        # The image's HEALTHCHECK passes on this exporter once it has polled, and fails where none listens.
        healthy = {"KVCACHE_EXPORTER_LISTEN": exporter.url.removeprefix("http://")}
        harness.wait_until(lambda: run_healthcheck(healthy) == 0, timeout=30, what="exporter HEALTHCHECK")
        assert run_healthcheck({"KVCACHE_EXPORTER_LISTEN": f"127.0.0.1:{harness.free_port()}"}) != 0

        # Every scrape target of the compose configuration is up: the exporter, Prometheus, Alertmanager.
        targets = harness.wait_until(lambda: targets_all_up(prometheus.url), timeout=60, what="all targets up")
        assert sorted((t["labels"]["job"], t["scrapeUrl"]) for t in targets) == sorted([
            ("alertmanager", f"{net.url('alertmanager')}/metrics"),
            ("kvcache-exporter", f"{net.url('exporter')}/metrics"),
            ("prometheus", f"{net.url('prometheus')}/metrics"),
        ])

        # Every rule group of alerts/ is loaded and evaluates without an error.
        groups = harness.wait_until(lambda: rule_groups_evaluated(prometheus.url), timeout=60, what="rule evaluation")
        rule_files = prometheus_config(model, net)["rule_files"]
        expected = [(group["name"], len(group["rules"])) for path in rule_files
                    for group in yaml.safe_load(Path(path).read_text())["groups"]]
        assert sorted((g["name"], len(g["rules"])) for g in groups) == sorted(expected)
        assert sum(count for _, count in expected) >= 10
        errors = [(g["name"], r["name"], r.get("lastError")) for g in groups for r in g["rules"]
                  if r["health"] != "ok" or r.get("lastError")]
        assert errors == []

        # Prometheus sends to the compose Alertmanager.
        alertmanagers = api(f"{prometheus.url}/api/v1/alertmanagers")["activeAlertmanagers"]
        assert [a["url"] for a in alertmanagers] == [f"{net.url('alertmanager')}/api/v2/alerts"]

        # The exporter watches both demo engines, and Grafana's datasource reaches those series.
        datasource = next(ds for doc in provisioned("datasources") for ds in doc["datasources"]
                          if ds["uid"] == DATASOURCE_UID)
        datasource_url = net.rewrite(datasource["url"])
        assert datasource_url == net.url("prometheus")

        def engines_up():
            up = harness.prom_vector(datasource_url, 'kvcache_target_up{job="kvcache-exporter"}')
            return sorted((labels["target"], labels["engine"], value) for labels, value in up) or None

        engines = harness.wait_until(engines_up, timeout=60, what="demo engines in Prometheus")
        failures = harness.prom_vector(datasource_url, "kvcache_target_scrape_failures_total > 0")
        assert engines == [("sim-sglang", "sglang", 1.0), ("sim-vllm", "vllm", 1.0)], (
            "failed polls: " + str([(labels["target"], labels["reason"], value) for labels, value in failures]))
        usage = harness.prom_vector(datasource_url, 'kvcache_usage_ratio{job="kvcache-exporter"}')
        assert {labels["target"] for labels, _ in usage} == DEMO_SERVICES
        assert all(0.0 <= value <= 1.0 for _, value in usage)

        # Both engines' KV event streams reach the exporter, for the "What more KV would buy" panels.
        def streaming():
            stored = harness.prom_vector(datasource_url, 'kvcache_events_blocks_stored_total{job="kvcache-exporter"} > 0')
            return {labels["target"] for labels, _ in stored} == DEMO_SERVICES

        harness.wait_until(streaming, timeout=60, what="KV events of both demo engines in Prometheus")
        dropped = harness.prom_vector(datasource_url, "kvcache_events_dropped_total > 0")
        assert dropped == []


def test_the_alerts_runbook_links_land_on_the_runbook_prometheus_serves(tmp_path):
    """The compose Prometheus, with its own flags for the runbook (console templates, external URL), fires
    KVCacheExporterAbsent as the compose rules word it (nothing is scraped; its `for` left out), and the alert's
    runbook_url opens a page with a section for every alert of the rules."""
    model = resolved()
    net = Loopback(model)
    service = model["services"]["prometheus"]
    config = prometheus_config(model, net)
    [rule_file] = config["rule_files"]
    rules = [rule for group in yaml.safe_load(Path(rule_file).read_text())["groups"] for rule in group["rules"]]
    absent = {key: value for key, value in next(r for r in rules if r.get("alert") == "KVCacheExporterAbsent").items()
              if key != "for"}
    config["rule_files"] = [str(write_yaml(tmp_path / "absent.yml", {"groups": [{"name": "kvcache", "rules": [absent]}]}))]
    config["global"]["evaluation_interval"] = "1s"
    port = net.port("prometheus")
    external_url = f"http://127.0.0.1:{port}"
    consoles = host_path(service, command_option(service, "web.console.templates"))
    with harness.prometheus(tmp_path / "prometheus", config, port=port, extra_args=(
            f"--web.console.templates={consoles}", f"--web.external-url={external_url}")):
        [alert] = harness.wait_until(lambda: api(f"{external_url}/api/v1/alerts")["alerts"], timeout=30,
                                     what="KVCacheExporterAbsent")
        link = alert["annotations"]["runbook_url"]
        assert link == f"{external_url}/consoles/runbook.html#kvcacheexporterabsent"
        status, page = harness.http_get(link)
    assert status == 200, page[:500]
    anchors = set(re.findall(r'<h\d id="([^"]+)">', page))
    assert {rule["alert"].lower() for rule in rules if "alert" in rule} <= anchors


def test_alertmanager_starts_with_none_of_its_secret_files(tmp_path):
    # alerts/alertmanager.yml names files under /etc/alertmanager/secrets/; none exist here, as on
    # a fresh checkout with no secret configured, and Alertmanager must start all the same.
    model = resolved()
    net = Loopback(model)
    am_config = alertmanager_config(model, net, tmp_path)
    assert "/etc/alertmanager/secrets/" in am_config.read_text()
    assert not Path("/etc/alertmanager/secrets").exists()
    with harness.alertmanager(tmp_path / "alertmanager", am_config, port=net.port("alertmanager")) as am:
        status, body = harness.http_get(f"{am.url}/api/v2/status")
        assert status == 200
        assert json.loads(body)["config"]["original"].count("/etc/alertmanager/secrets/") >= 4
