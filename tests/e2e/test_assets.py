"""`kvcache-exporter assets`: with --config, the files the generators build for that configuration;
every problem one line and exit 2. (tests/e2e/test_packaging.py covers the packaged copies.)"""

from __future__ import annotations

import subprocess
import sys

from devtools import harness
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
    for unchanged in ("alertmanager.yml", "runbook.md"):
        assert (tmp_path / "out" / "alerts" / unchanged).read_bytes() == (REPO / "alerts" / unchanged).read_bytes()


def test_a_broken_configuration_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water: 0.8}\n")
    result = subprocess.run([sys.executable, "-m", "kvcache_exporter", "assets", "--out", str(tmp_path / "out"),
                             "--config", str(config)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"kvcache-exporter assets: {config}: pressure.high_water: unknown key (known: ")
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()

