"""The shipped alert rules and Alertmanager configuration, run through Debian's promtool and amtool."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml

from devtools import harness
from devtools.alerting import SHIPPED_AM, Recorder, alertmanager_test_config
from devtools.harness import REPO, require_binary
from kvcache_exporter.alerts import generate
from kvcache_exporter.thresholds import DEFAULT, Thresholds

ALERTS = REPO / "alerts"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.test.yml"))
REPLICAS = 40  # the fleet: 40 replicas of one model short of KV


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
    # 13 recording rules, 10 for what more KV would buy (2, then 2 per factor), 9 for disaggregated prefill/decode
    # (with the share of transfers reported faster than the link), 24 for the replicas of a model (imbalance and
    # autoscaling, with the flow's confident count, the used KV less what prefill holds for export and the
    # preempted share of completions with its ask), 5 for routing across replicas (recomputed and stored rates,
    # their share, the fleet's hit ratio and with perfect affinity), 22 alerting (the shortage and the storm twice,
    # KVCacheAdmissionStalled and KVCacheRoutingLoss)
    assert "SUCCESS: 83 rules found" in result.stdout


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


def test_one_notification_per_model_lists_its_replicas(tmp_path):
    """The shipped grouping in Debian's Alertmanager, fed through its API: REPLICAS replicas of one model short of KV
    are one page, one chat message and one webhook post that name every replica, not REPLICAS of each; another
    model's shortage is a notification of its own."""
    replicas = [f"llama-{i}" for i in range(REPLICAS)]
    other = ["qwen-0", "qwen-1"]

    def shortage(target: str, model: str) -> dict:
        return {"labels": {"alertname": "KVCacheShortageQueueing", "severity": "critical", "target": target,
                           "model": model, "engine": "vllm", "job": "kvcache-exporter"},
                "annotations": {"summary": f"{target} (model {model}): requests are queueing because the KV cache is full",
                                "description": f"8 requests wait for KV on {target} (model {model}).",
                                "runbook_url": f"{generate.RUNBOOK_URL_BASE}#kvcacheshortagequeueing"}}

    recorder = Recorder()
    am_path = tmp_path / "alertmanager.yml"
    am_path.write_text(yaml.safe_dump(alertmanager_test_config(yaml.safe_load(SHIPPED_AM.read_text()), recorder.url,
                                                               tmp_path)))
    try:
        with harness.alertmanager(tmp_path / "am", am_path) as am:
            body = json.dumps([shortage(t, "llama-3-70b") for t in replicas] + [shortage(t, "qwen") for t in other])
            request = urllib.request.Request(f"{am.url}/api/v2/alerts", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200
            harness.wait_until(lambda: len(recorder.received("/webhook")) >= 2 and len(recorder.received("/slack")) >= 2
                               and len(recorder.received("/pagerduty")) >= 2,
                               timeout=20, what="a page, a chat message and a webhook post per model")
            time.sleep(3)  # past the test's group_interval (2s): a group that split per replica would have sent more
            webhook = [body for _, body in recorder.received("/webhook")]
            slack = [body for _, body in recorder.received("/slack")]
            pages = [body for _, body in recorder.received("/pagerduty")]
    finally:
        recorder.close()

    assert len(webhook) == len(slack) == len(pages) == 2
    by_model = {post["groupLabels"]["model"]: post for post in webhook}
    assert {model: sorted(a["labels"]["target"] for a in post["alerts"]) for model, post in by_model.items()} == {
        "llama-3-70b": sorted(replicas), "qwen": sorted(other)}
    [llama_chat] = [post for post in slack if "llama-3-70b" in post["attachments"][0]["title"]]
    chat = llama_chat["attachments"][0]
    assert chat["title"] == (f"[FIRING] KVCacheShortageQueueing, model llama-3-70b: {REPLICAS} firing, 0 resolved")
    assert sorted(line.split()[1] for line in chat["text"].splitlines() if line.startswith("- ")) == sorted(replicas)
    [llama_page] = [page for page in pages if "llama-3-70b" in page["payload"]["summary"]]
    assert llama_page["payload"]["summary"] == f"KVCacheShortageQueueing: {REPLICAS} replicas of model llama-3-70b"
    assert sorted(llama_page["payload"]["custom_details"]["replicas"].split()) == sorted(replicas)
