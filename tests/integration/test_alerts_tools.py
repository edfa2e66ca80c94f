"""The shipped alert rules and Alertmanager configuration, run through Debian's promtool and amtool."""

from __future__ import annotations

import subprocess

import pytest

from devtools.harness import REPO, require_binary
from kvcache_exporter.alerts import generate
from kvcache_exporter.thresholds import DEFAULT, Thresholds

ALERTS = REPO / "alerts"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.test.yml"))


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("variant", ["shipped", "time-scale-20", "overridden"])
def test_promtool_check_rules_passes(tmp_path, variant):
    if variant == "shipped":
        path = ALERTS / "kvcache-rules.yml"
    else:
        path = tmp_path / "rules.yml"
        thresholds = (Thresholds(high_water_ratio=0.8, prefix_hit_baseline_offset="1d") if variant == "overridden"
                      else generate.compress(DEFAULT, 20))
        path.write_text(generate.render(generate.build(thresholds)))
    result = run(require_binary("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    # 12 recording rules, 10 for what more KV would buy (2, then 2 per factor), 8 for disaggregated prefill/decode,
    # 20 for the replicas of a model (imbalance and autoscaling), 19 alerting (the storm twice)
    assert "SUCCESS: 69 rules found" in result.stdout


def test_promtool_unit_tests_pass():
    assert len(UNIT_TESTS) >= 5
    result = run(require_binary("promtool"), "test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS)


def test_amtool_accepts_the_alertmanager_config():
    result = run(require_binary("amtool"), "check-config", str(ALERTS / "alertmanager.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("labels,receiver", [
    (["alertname=KVCacheShortageQueueing", "severity=critical", "target=llama-0"], "kvcache-page"),
    (["alertname=KVCacheNearlyFull", "severity=warning", "target=llama-0"], "kvcache-chat"),
    (["alertname=Unrelated", "target=llama-0"], "kvcache-relay"),
])
def test_routes_by_severity(labels, receiver):
    result = run(require_binary("amtool"), "config", "routes", "test",
                 f"--config.file={ALERTS / 'alertmanager.yml'}", f"--verify.receivers={receiver}", *labels)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [receiver]
