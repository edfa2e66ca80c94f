"""`kvcache-exporter assets`: with --config, the files the generators build for that configuration;
every problem one line and exit 2. (tests/e2e/test_packaging.py covers the packaged copies.)"""

from __future__ import annotations

import subprocess
import sys

import yaml

from devtools import harness
from kvcache_exporter.alerts import generate
from kvcache_exporter.commands import assets

REPO = harness.REPO


def generator(*argv) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *map(str, argv)], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result


def test_for_a_configuration_the_files_are_what_the_generators_build(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text("labels: {region: eu}\npressure: {high_water_ratio: 0.8}\n")
    assert assets.main(["--out", str(tmp_path / "out"), "--config", str(config)]) == 0
    rules = (tmp_path / "out" / "alerts" / "kvcache-rules.yml").read_text()
    assert rules == generator("kvcache_exporter.alerts.generate", "--config", config, "--output", "-").stdout
    assert rules != (REPO / "alerts" / "kvcache-rules.yml").read_text()  # the override took effect
    generator("devtools.build_dashboards", "--config", config, "--out", tmp_path / "built")
    for built in sorted((tmp_path / "built").glob("*.json")):
        written = (tmp_path / "out" / "dashboards" / built.name).read_text()
        assert written == built.read_text(), built.name
        assert '"region"' in written
    runbook = (tmp_path / "out" / "alerts" / "runbook.md").read_text()
    assert runbook == generator("kvcache_exporter.alerts.runbook", "--config", config, "--output", "-").stdout
    assert "high-water mark 80%" in runbook and "high-water mark 90%" not in runbook
    assert (tmp_path / "out" / "alerts" / "alertmanager.yml").read_bytes() == (REPO / "alerts" / "alertmanager.yml").read_bytes()


def runbook_urls(rules_path) -> set[str]:
    return {rule["annotations"]["runbook_url"] for group in yaml.safe_load(rules_path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


def test_runbook_url_base_points_every_alert_at_the_runbook_you_serve(tmp_path):
    base = "https://runbooks.example.org/kvcache/runbook.md"
    assert assets.main(["--out", str(tmp_path / "out"), "--runbook-url-base", base]) == 0
    rules = tmp_path / "out" / "alerts" / "kvcache-rules.yml"
    alert_names = {rule["alert"] for group in yaml.safe_load(rules.read_text())["groups"] for rule in group["rules"]
                   if "alert" in rule}
    assert runbook_urls(rules) == {f"{base}#{name.lower()}" for name in alert_names}
    assert len(alert_names) == 20  # the 18 before issue 43, KVCacheAdmissionStalled and KVCacheRoutingLoss (#47)
    # Apart from the links, the shipped rules; the runbook they link to is the shipped one.
    shipped = (REPO / "alerts" / "kvcache-rules.yml").read_text()
    assert rules.read_text() == shipped.replace(generate.RUNBOOK_URL_BASE + "#", base + "#")
    assert (tmp_path / "out" / "alerts" / "runbook.md").read_bytes() == (REPO / "alerts" / "runbook.md").read_bytes()


def test_a_configuration_without_a_runbook_url_base_says_where_the_links_point(tmp_path, capsys):
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water_ratio: 0.95}\n")
    assert assets.main(["--out", str(tmp_path / "out"), "--config", str(config)]) == 0
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "--runbook-url-base" in notice
    assert runbook_urls(tmp_path / "out" / "alerts" / "kvcache-rules.yml") >= {
        f"{generate.RUNBOOK_URL_BASE}#kvcachenearlyfull"}
    base = "http://localhost:3000/runbook.md"
    assert assets.main(["--out", str(tmp_path / "mine"), "--config", str(config), "--runbook-url-base", base]) == 0
    assert capsys.readouterr().err == ""
    assert runbook_urls(tmp_path / "mine" / "alerts" / "kvcache-rules.yml") >= {f"{base}#kvcachenearlyfull"}


def test_a_broken_configuration_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water: 0.8}\n")
    result = subprocess.run([sys.executable, "-m", "kvcache_exporter", "assets", "--out", str(tmp_path / "out"),
                             "--config", str(config)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"kvcache-exporter assets: {config}: pressure.high_water: unknown key (known: ")
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()

