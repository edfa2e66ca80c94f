"""The shipped alert rules, runbook and Alertmanager configuration as files; tests/integration/test_alerts_tools.py
runs them through promtool and amtool."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from kvcache_exporter.alerts import generate, runbook
from kvcache_exporter.alerts.rules import disaggregated
from kvcache_exporter.thresholds import DEFAULT
from devtools.harness import REPO

ALERTS = REPO / "alerts"
UNIT_TESTS = sorted((ALERTS / "tests").glob("*.test.yml"))
EXPECTED_ALERTS = {
    "KVCacheShortageQueueing", "KVCachePreemptionStorm", "KVCacheNearlyFull", "KVCachePrefixHitRateDrop",
    "KVCacheQueueDominatesTTFT", "KVCacheTargetDown", "KVCacheExporterDown", "KVCacheExporterAbsent",
    "KVCacheExporterWorkerFailing",
    "KVCacheCapacityMisses", "KVCacheOffloadTierFull", "KVCacheOffloadLoadSlow",
    "KVCacheTransfersFailing", "KVCacheTransferLeaseExpiries", "KVCacheTransferNotificationsAfterExpiry",
    "KVCachePDBackpressure", "KVCacheTransferBandwidthLow", "KVCacheRoutingImbalance", "KVCacheAdmissionStalled",
    "KVCacheRoutingLoss",
}
# Alerts about one engine's KV (their descriptions name target and model); four are about polling, where a
# target without answers has no model, P/D backpressure and routing imbalance are about a group of pools (the
# P/D group label), and the routing loss about a model's replicas together.
PER_MODEL_ALERTS = EXPECTED_ALERTS - {"KVCacheTargetDown", "KVCacheExporterDown", "KVCacheExporterAbsent",
                                      "KVCacheExporterWorkerFailing", "KVCachePDBackpressure", "KVCacheRoutingImbalance",
                                      "KVCacheRoutingLoss"}


def shipped_alerts() -> list[dict]:
    rules = yaml.safe_load((ALERTS / "kvcache-rules.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


# --- the rule file -------------------------------------------------------------------------

def test_committed_rule_file_is_what_the_generator_builds():
    committed = (ALERTS / "kvcache-rules.yml").read_text()
    assert committed == generate.render(generate.build()), "run `python -m kvcache_exporter.alerts.generate` and commit the result"


def test_generator_cli_writes_the_same_file(tmp_path):
    out = tmp_path / "rules.yml"
    assert generate.main(["--output", str(out)]) == 0
    assert out.read_text() == (ALERTS / "kvcache-rules.yml").read_text()


def test_rule_file_has_every_alert_with_severity_and_annotations():
    alerts = shipped_alerts()
    assert {a["alert"] for a in alerts} == EXPECTED_ALERTS
    for rule in alerts:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert annotations["runbook_url"] == f"{generate.RUNBOOK_URL_BASE}#{rule['alert'].lower()}"
        if rule["alert"] in PER_MODEL_ALERTS:
            for text in (annotations["summary"], annotations["description"]):
                assert "$labels.target" in text and "$labels.model" in text, rule["alert"]
    by_name = {(a["alert"], a["labels"]["severity"]) for a in alerts}
    assert ("KVCacheShortageQueueing", "critical") in by_name
    assert {("KVCachePreemptionStorm", "warning"), ("KVCachePreemptionStorm", "critical")} <= by_name


def test_rules_read_only_the_contract():
    text = (ALERTS / "kvcache-rules.yml").read_text()
    assert "vllm:" not in text and "sglang:" not in text
    assert len(set(re.findall(r"\bkvcache_[a-z0-9_]+", text))) >= 10
    assert generate.problems(yaml.safe_load(text)) == []


def test_the_rules_lint_names_a_series_outside_the_contract():
    """A misspelt family, and a histogram's bare name (only its _bucket, _sum and _count are series)."""
    rules = generate.build()
    first = rules["groups"][0]["rules"][0]
    first["expr"] += " + kvcache_usage_ratios + kvcache_queue_time_seconds + kvcache_queue_time_seconds_sum"
    assert generate.problems(rules) == [
        f"{first['record']}: kvcache_queue_time_seconds is not in the kvcache_* contract",
        f"{first['record']}: kvcache_usage_ratios is not in the kvcache_* contract"]


def test_headline_alert_builds_on_the_exporters_pressure_state():
    rules = {r.get("record") or r.get("alert"): r for r in
             yaml.safe_load((ALERTS / "kvcache-rules.yml").read_text())["groups"][0]["rules"]}
    kv_queue = rules["kvcache:requests_waiting_for_kv:sum"]["expr"]
    assert 'kvcache_pressure_state{state=~"saturated|thrashing"} == 1' in kv_queue
    assert "kvcache_requests_waiting > 0" in kv_queue
    shortage = rules["KVCacheShortageQueueing"]["expr"]
    assert "kvcache:requests_waiting_for_kv:sum" in shortage and "kvcache_target_up" in shortage
    assert rules["KVCacheShortageQueueing"]["for"] == DEFAULT.shortage_for


# --- thresholds and overrides ---------------------------------------------------------------

def test_config_overrides_flow_into_the_rules(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({
        "poll_interval": "5s",
        "pressure": {"high_water_ratio": 0.8, "preemption_storm_critical_per_second": 3, "shortage_for": "90s"},
    }))
    out = tmp_path / "rules.yml"
    generate.main(["--config", str(config), "--output", str(out)])
    alerts = {(r["alert"], r["labels"]["severity"]): r for g in yaml.safe_load(out.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert "kvcache:usage_ratio:max >= 0.8\n" in alerts[("KVCacheNearlyFull", "warning")]["expr"]
    assert "kvcache:preemptions:rate > 3\n" in alerts[("KVCachePreemptionStorm", "critical")]["expr"]
    assert alerts[("KVCacheShortageQueueing", "critical")]["for"] == "90s"
    assert "above 3/s" in alerts[("KVCachePreemptionStorm", "critical")]["annotations"]["description"]


def test_the_pd_group_label_groups_the_cross_pool_rules(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"labels": {"pair": "a"}, "pd_group_label": "pair", "targets": []}))
    out = tmp_path / "rules.yml"
    assert generate.main(["--config", str(config), "--output", str(out)]) == 0
    rules = {r.get("record") or r["alert"]: r for g in yaml.safe_load(out.read_text())["groups"] for r in g["rules"]}
    assert "sum by (pair) (kvcache_kv_transfer_requests_waiting_for_kv{role=\"decode\"}) > 0\nand on (pair)" in \
        rules[disaggregated.PD_BACKPRESSURE]["expr"]
    assert "by (model)" not in rules["kvcache:kv_transfer_share_of_ttft:ratio"]["expr"]
    assert "{{ $labels.pair }}" in rules["KVCachePDBackpressure"]["annotations"]["summary"]


def test_unknown_pressure_key_is_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water: 0.8}\n")
    assert generate.main(["--config", str(config), "--output", str(tmp_path / "rules.yml")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"{config}: pressure.high_water: unknown key") and "\n" not in error, error
    assert not (tmp_path / "rules.yml").exists()


def _shape(rules: dict) -> str:
    """The rule file with every duration and number blanked out."""
    text = json.dumps(rules)
    text = re.sub(r"\b\d+(ms|s|m|h)\b", "D", text)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)


def test_time_scale_builds_the_same_rules_on_a_faster_clock():
    scaled = generate.build(generate.compress(DEFAULT, 20))
    assert _shape(scaled) == _shape(generate.build())
    alerts = {(r["alert"], r["labels"]["severity"]): r for r in scaled["groups"][0]["rules"] if "alert" in r}
    assert alerts[("KVCacheShortageQueueing", "critical")]["for"] == "6s"    # 2m / 20
    assert alerts[("KVCachePrefixHitRateDrop", "warning")]["for"] == "45s"   # 15m / 20
    assert "[3s]" in alerts[("KVCacheShortageQueueing", "critical")]["expr"]  # 60s window / 20
    assert "predict_linear(kvcache_usage_ratio[3s], 90)" in alerts[("KVCacheNearlyFull", "warning")]["expr"]
    # Rates are per second of the faster clock: 20 times as many events per second.
    assert "kvcache:preemptions:rate > 20\nand kvcache:requests_finished:rate >= 1" in \
        alerts[("KVCachePreemptionStorm", "critical")]["expr"]
    assert "kvcache:usage_ratio:max >= 0.9\n" in alerts[("KVCacheNearlyFull", "warning")]["expr"]
    records = {r["record"]: r["expr"] for r in scaled["groups"][0]["rules"] if "record" in r}
    assert "offset 3m" in records["kvcache:prefix_cache_hit_ratio:baseline"]  # 1h / 20


def test_compress_knows_every_threshold():
    """A new threshold must be a duration, a per-second rate or one of the known ratios."""
    compressed = generate.compress(DEFAULT, 4)
    unchanged = {f.name for f in dataclasses.fields(DEFAULT) if getattr(compressed, f.name) == getattr(DEFAULT, f.name)}
    # Seconds per token loaded and bytes per second of transfer are quotients of two counters of the engine's
    # own: no clock enters them. Standard deviations of a count are a number of them.
    assert unchanged == {"high_water_ratio", "low_water_ratio", "prefix_hit_drop_fraction", "queue_share_of_ttft",
                         "capacity_miss_share", "offload_load_max_seconds_per_token", "kv_transfer_failure_ratio",
                         "kv_transfer_link_bytes_per_second", "kv_transfer_bandwidth_low_fraction",
                         "routing_imbalance_share", "routing_loss_share", "flow_confidence_sigmas",
                         "preemption_demand_share"}
    assert compressed.shortage_for == "30s" and compressed.window_seconds == 15
    assert compressed.thrashing_preemptions_per_second == pytest.approx(0.08)
    with pytest.raises(ValueError):
        generate.compress(DEFAULT, 0)


def test_generator_cli_time_scale(tmp_path):
    out = tmp_path / "rules.yml"
    generate.main(["--time-scale", "20", "--output", str(out)])
    assert out.read_text() == generate.render(generate.build(generate.compress(DEFAULT, 20)))


def test_runbook_url_base_is_a_setting(tmp_path):
    out = tmp_path / "rules.yml"
    generate.main(["--runbook-url-base", "https://wiki.example.org/kv", "--output", str(out)])
    urls = {r["annotations"]["runbook_url"] for g in yaml.safe_load(out.read_text())["groups"]
            for r in g["rules"] if "alert" in r}
    assert urls == {f"https://wiki.example.org/kv#{name.lower()}" for name in EXPECTED_ALERTS}


# --- runbook ----------------------------------------------------------------------------------

def test_committed_runbook_is_what_its_generator_builds(tmp_path, capsys):
    assert (ALERTS / "runbook.md").read_text() == runbook.render(), "run `make alerts` and commit the result"
    assert (runbook.main(["--check"]), capsys.readouterr().err) == (0, "")
    stale = tmp_path / "runbook.md"
    stale.write_text(runbook.render().replace("high-water mark 90%", "high-water mark 95%"))
    assert runbook.main(["--check", "--output", str(stale)]) == 1
    assert capsys.readouterr().err == f"{stale} is out of date: run `make alerts`\n"


def test_runbook_follows_a_configuration(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text("pressure: {high_water_ratio: 0.95, shortage_critical_ttft_seconds: 5}\n")
    out = tmp_path / "runbook.md"
    assert runbook.main(["--config", str(config), "--output", str(out)]) == 0
    text = out.read_text()
    assert "high-water mark 95%" in text and "mean time to first token over the window is above 5 s" in text
    assert "90%" not in text

def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_every_runbook_url_points_to_a_runbook_section():
    runbook = (ALERTS / "runbook.md").read_text()
    anchors = {github_anchor(m) for m in re.findall(r"^#+ (.+)$", runbook, flags=re.M)}
    for rule in shipped_alerts():
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in anchors, f"runbook.md has no section for #{anchor}"


def test_runbook_sections_say_how_to_confirm_and_what_to_change():
    runbook = (ALERTS / "runbook.md").read_text()
    sections = dict(re.findall(r"^## (KVCache\w+)\n(.*?)(?=^## |\Z)", runbook, flags=re.M | re.S))
    assert set(sections) == EXPECTED_ALERTS
    for name, body in sections.items():
        assert "```promql" in body, f"{name}: no query to confirm it"
        assert "Change:" in body, f"{name}: nothing says what to change"
        assert "Why these numbers:" in body, f"{name}: nothing says why its thresholds are what they are"
    remedies = ["max running requests", "gpu memory share", "max model length", "scale out",
                "prefix-aware routing", "kv offload", "quantized kv cache"]
    assert [r for r in remedies if r not in runbook.lower()] == []


# --- promtool unit tests ----------------------------------------------------------------------


def test_unit_tests_cover_every_alert_firing_and_not_firing():
    firing: dict[str, set[str]] = {}
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                if check.get("exp_alerts"):
                    firing.setdefault(name, set()).update(a["exp_labels"]["severity"] for a in check["exp_alerts"])
                else:
                    quiet.add(name)
    assert set(firing) == EXPECTED_ALERTS
    assert quiet == EXPECTED_ALERTS
    assert firing["KVCachePreemptionStorm"] == {"warning", "critical"}
    assert firing["KVCacheShortageQueueing"] == {"warning", "critical"}


def test_unit_tests_cover_the_named_situations():
    names = " | ".join(case["name"] for path in UNIT_TESTS for case in yaml.safe_load(path.read_text())["tests"])
    for situation in ("idle engine", "counter reset after a restart", "flaps", "concurrency-cap"):
        assert situation in names, situation


# --- Alertmanager -------------------------------------------------------------------------------

def alertmanager_config() -> dict:
    return yaml.safe_load((ALERTS / "alertmanager.yml").read_text())


def test_groups_by_alert_and_model_and_inhibits_nearly_full_during_a_shortage():
    config = alertmanager_config()
    assert config["route"]["group_by"] == ["alertname", "model"]
    assert {
        "source_matchers": ['alertname="KVCacheShortageQueueing"'],
        "target_matchers": ['alertname="KVCacheNearlyFull"'],
        "equal": ["target"],
    } in config["inhibit_rules"]


SECRET_FIELDS = {"api_url", "routing_key", "service_key", "auth_password", "credentials", "password",
                 "bearer_token", "slack_api_url", "smtp_auth_password", "api_key", "auth_secret"}


def _keys(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + (key,), value
            yield from _keys(value, path + (key,))
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item, path)


def test_receivers_read_every_secret_from_a_file():
    config = alertmanager_config()
    keys = list(_keys(config))
    inline = [".".join(path) for path, _ in keys if path[-1] in SECRET_FIELDS]
    assert inline == [], f"secrets written into the config: {inline}"
    file_fields = {path[-1] for path, _ in keys if path[-1].endswith("_file")}
    assert {"slack_api_url_file", "smtp_auth_password_file", "routing_key_file", "credentials_file"} <= file_fields
    kinds = {key for receiver in config["receivers"] for key in receiver if key.endswith("_configs")}
    assert kinds == {"webhook_configs", "slack_configs", "email_configs", "pagerduty_configs"}
