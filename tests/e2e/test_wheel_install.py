"""`pip install .` into a clean virtual environment, used from another directory: the package alone
serves the demo and writes out the dashboards, rules, Alertmanager example and runbook the
repository commits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from devtools import harness

REPO = Path(__file__).resolve().parents[1]
# Output path of `kvcache-exporter assets` -> the committed file it must equal byte for byte.
COMMITTED = {
    "dashboards/kvcache-fleet.json": "dashboards/generated/kvcache-fleet.json",
    "dashboards/kvcache-target.json": "dashboards/generated/kvcache-target.json",
    "alerts/kvcache-rules.yml": "alerts/kvcache-rules.yml",
    "alerts/alertmanager.yml": "alerts/alertmanager.yml",
    "alerts/runbook.md": "alerts/runbook.md",
}
# What a fresh clone holds: no virtual environment, build leftovers or caches of this checkout.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                        ".pytest_cache", ".hypothesis", "node_modules", "bench", "fuzz")


def run(argv: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_wheel_install_serves_the_demo_and_writes_the_committed_assets(tmp_path):
    source, venv, elsewhere = tmp_path / "clone", tmp_path / "venv", tmp_path / "elsewhere"
    shutil.copytree(REPO, source, ignore=NOT_IN_A_CLONE)
    elsewhere.mkdir()
    # An empty PYTHONPATH adds nothing (harness.Process merges this into the environment, so unset is not enough).
    env = {**{key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}, "PYTHONPATH": ""}
    created = run([sys.executable, "-m", "venv", venv], tmp_path, env)
    assert created.returncode == 0, created.stderr
    installed = run([venv / "bin" / "python", "-m", "pip", "install", "-q", source], tmp_path, env)
    assert installed.returncode == 0, installed.stderr
    command = venv / "bin" / "kvcache-exporter"

    # The package's own copy, not this checkout's: nothing of the repository is on the path.
    where = run([venv / "bin" / "python", "-c", "import exporter, dashboards, alerts; "
                 "print(exporter.__file__, dashboards.__file__, alerts.__file__)"], elsewhere, env)
    assert where.returncode == 0, where.stderr
    assert all(path.startswith(str(venv)) for path in where.stdout.split()), where.stdout

    written = run([command, "assets", "--out", "out"], elsewhere, env)
    assert written.returncode == 0, written.stderr
    files = {str(path.relative_to(elsewhere / "out")) for path in (elsewhere / "out").rglob("*") if path.is_file()}
    assert files == set(COMMITTED)
    for output, committed in COMMITTED.items():
        assert (elsewhere / "out" / output).read_bytes() == (REPO / committed).read_bytes(), output

    # Without the dashboards extra, rebuilding for a configuration says which extra to install.
    config = elsewhere / "exporter.yml"
    config.write_text("pressure: {high_water_ratio: 0.8}\n")
    rebuilt = run([command, "assets", "--out", "rebuilt", "--config", config], elsewhere, env)
    assert (rebuilt.returncode, rebuilt.stdout) == (2, "")
    assert rebuilt.stderr == ("kvcache-exporter assets: --config: rebuilding the dashboards needs "
                              "grafana-foundation-sdk: pip install 'kvcache-exporter[dashboards]'\n")

    port = harness.free_port()
    with harness.Process("demo", [str(command), "--demo", "--listen", f"127.0.0.1:{port}"], tmp_path,
                         f"http://127.0.0.1:{port}/healthz", env=env, cwd=elsewhere) as demo:
        demo.wait_ready()
        harness.wait_until(lambda: {"demo-vllm", "demo-sglang", "demo-trtllm"} <= {
            dict(key[1])["target"] for key in harness.series(harness.scrape(f"http://127.0.0.1:{port}"),
                                                             "kvcache_usage_ratio")}, 60,
            what="every simulated engine's usage in the demo's /metrics")
