"""End to end on loopback: simulator -> exporter -> Prometheus (the shipped rules) -> Alertmanager
(the shipped routing) -> an HTTP receiver inside the test that records every notification.

Time is compressed TIME_SCALE times: the simulator runs that much faster than real time, and the
exporter's pressure thresholds and the rule file are the shipped defaults on the same faster clock
(`alerts.generate.compress`): `for: 2m` becomes 6s, the 60s window 3s, rates 20 times higher.
The offload test needs no Alertmanager: the alert is read from Prometheus's ALERTS series.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvcache_exporter.alerts import generate
from kvcache_exporter import units
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.simulator import scenarios
from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.alerting import SECRETS, SHIPPED_AM, Recorder, alertmanager_test_config, diagnostics, prometheus_config

TIME_SCALE = 20
COMPRESSED = generate.compress(DEFAULT, TIME_SCALE)
SHORTAGE_FOR = units.parse_duration(COMPRESSED.shortage_for)
INTERVAL = "1s"  # exporter poll, Prometheus scrape and rule evaluation
SEED = 7
def exporter_config(path: Path, targets: dict[str, str]) -> Path:
    """A config polling vLLM targets (name -> URL) on the compressed clock."""
    path.write_text(yaml.safe_dump({
        "poll_interval": INTERVAL,
        "labels": {"cluster": "e2e"},
        "pressure": dataclasses.asdict(COMPRESSED),
        "targets": [{"name": name, "url": url, "engine": "vllm"} for name, url in targets.items()],
    }))
    return path


def critical_notifications(recorder, target: str) -> list[tuple[dict, dict]]:
    return [(headers, alert) for headers, alert in recorder.webhook_alerts("KVCacheShortageQueueing", target)
            if alert["labels"].get("severity") == "critical"]


@pytest.fixture
def recorder():
    rec = Recorder()
    yield rec
    rec.close()


def test_shortage_notification_for_kv_saturation_and_none_for_concurrency_cap(tmp_path, recorder):
    rules = tmp_path / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    shipped = yaml.safe_load(SHIPPED_AM.read_text())
    am_config = alertmanager_test_config(shipped, recorder.url, tmp_path)
    assert am_config["route"]["routes"] == shipped["route"]["routes"]
    assert am_config["inhibit_rules"] == shipped["inhibit_rules"]
    am_path = tmp_path / "alertmanager.yml"
    am_path.write_text(yaml.safe_dump(am_config, sort_keys=False))
    exporter_ports = [harness.free_port(), harness.free_port()]
    for log_dir in ("sat", "cap"):
        (tmp_path / log_dir).mkdir()

    with harness.alertmanager(tmp_path / "am", am_path) as am, \
            harness.prometheus(tmp_path / "prom", prometheus_config(rules, am.url, exporter_ports)) as prom:

        # Phase 1: kv-saturation. At this speed the pool is full and requests queue for KV within
        # ~8s of wall time, for ~25s; the alert fires `for` (6s) after the exporter says so.
        with start_engine("vllm-v1", "kv-saturation", speed=TIME_SCALE, seed=SEED) as engine, \
                harness.exporter(tmp_path / "sat", "--config", str(exporter_config(
                    tmp_path / "sat.yml", {"llama-sat": engine.url})), port=exporter_ports[0]):
            try:
                # The warning may be notified first, while the queue has not yet grown over a whole window.
                harness.wait_until(lambda: critical_notifications(recorder, "llama-sat"),
                                   timeout=60, interval=0.5, what="a critical KVCacheShortageQueueing notification")
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{diagnostics(prom.url, 'llama-sat')}\n{am.log_tail(15)}") from None
            model = engine.model_name

        headers, alert = critical_notifications(recorder, "llama-sat")[0]
        assert headers["Authorization"] == f"Bearer {SECRETS['relay-token']}"  # credentials_file was read
        labels = alert["labels"]
        assert {k: labels[k] for k in ("alertname", "severity", "target", "model", "engine", "cluster", "job")} == {
            "alertname": "KVCacheShortageQueueing", "severity": "critical", "target": "llama-sat", "model": model,
            "engine": "vllm", "cluster": "e2e", "job": "kvcache-exporter",
        }
        annotations = alert["annotations"]
        # kv-saturation's queue builds while the pool is full, so users wait: the page, not only the warning.
        assert annotations["summary"] == (f"llama-sat (model {model}): requests are queueing because the KV cache is "
                                          "full, and users wait (the queue grows, or mean TTFT above "
                                          f"{COMPRESSED.shortage_critical_ttft_seconds:g} s)")
        waiting, rest = annotations["description"].split(" ", 1)
        assert float(waiting) >= 1
        assert rest.startswith(f"requests wait for KV on llama-sat (model {model}) while the engine answers, and the "
                               f"queue grew over {units.format_duration(COMPRESSED.window_seconds)} or the mean time to "
                               f"first token is above {COMPRESSED.shortage_critical_ttft_seconds:g} s")
        assert annotations["runbook_url"] == f"{generate.RUNBOOK_URL_BASE}#kvcacheshortagequeueing"

        # The critical route also paged, with the routing key read from its file.
        pages = [body for _, body in recorder.received("/pagerduty")
                 if body["payload"]["custom_details"]["replicas"].split() == ["llama-sat"]]
        assert pages and pages[0]["routing_key"] == SECRETS["pagerduty-routing-key"]
        assert pages[0]["payload"]["severity"] == "critical"
        # ... and posted to chat, through the Slack URL read from its file.
        assert any("KVCacheShortageQueueing" in json.dumps(body) for _, body in recorder.received("/slack"))

        # Phase 2: concurrency-cap. Requests queue behind the running cap while KV has room.
        # Wait until the queue has been non-empty for three times the alert's `for`: a shortage
        # alert would be firing and notified by then.
        queued_for = 3 * SHORTAGE_FOR
        queue_held = harness.held_above_zero('sum without (dp_rank) (kvcache_requests_waiting{target="llama-cap"})',
                                             queued_for, units.parse_duration(INTERVAL))
        with start_engine("vllm-v1", "concurrency-cap", speed=TIME_SCALE, seed=SEED) as engine, \
                harness.exporter(tmp_path / "cap", "--config", str(exporter_config(
                    tmp_path / "cap.yml", {"llama-cap": engine.url})), port=exporter_ports[1]):
            try:
                harness.wait_until(lambda: harness.prom_vector(prom.url, queue_held), timeout=60, interval=0.5,
                                   what=f"a concurrency-cap queue held for {queued_for}s")
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{diagnostics(prom.url, 'llama-cap')}") from None
            time.sleep(3)  # one more evaluation, group_wait and delivery
            alerts_seen = harness.prom_vector(
                prom.url, 'count_over_time(ALERTS{alertname="KVCacheShortageQueueing",target="llama-cap"}[5m])')
            cap_diagnostics = diagnostics(prom.url, "llama-cap")

        assert alerts_seen == [], f"shortage alert pending or firing on the concurrency-cap run\n{cap_diagnostics}"
        assert recorder.webhook_alerts("KVCacheShortageQueueing", "llama-cap") == []
        assert [body for _, body in recorder.received("/pagerduty") if "llama-cap" in json.dumps(body)] == []


def tier_full_then_idle() -> scenarios.Scenario:
    """offload-tier-full's phase, then no more arrivals for good: once the engine has drained, its counters
    stand still, so the exporter's reading can be compared with the model's own count exactly."""
    builtin = scenarios.BUILTIN_SCENARIOS["offload-tier-full"]
    return scenarios.parse_scenario({**builtin, "then": "hold", "phases": [
        *builtin["phases"], {"name": "idle", "duration_s": 1, "arrival_rate": 0}]},
        source="offload-tier-full", name="offload-tier-full-then-idle")


def test_offload_tier_full_fires_for_a_refusing_tier_and_not_for_a_tier_that_keeps_up(tmp_path):
    """KVCacheOffloadTierFull through the real exporter and Prometheus: it fires for a saturated pool whose small,
    slow CPU tier refuses stores, never for the offload-tier pool; the refusals counted are the model's own."""
    rules = tmp_path / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    scenario = tier_full_then_idle()
    phase_s = scenario.phases[0].duration_s
    with start_engine("vllm-v1", scenario, speed=TIME_SCALE, seed=SEED) as full, \
            start_engine("vllm-v1", "offload-tier", speed=TIME_SCALE, seed=SEED) as steady, \
            harness.exporter(tmp_path, "--config", str(exporter_config(
                tmp_path / "exporter.yml", {"tier-full": full.url, "tier-steady": steady.url}))) as exporter, \
            harness.prometheus(tmp_path / "prom", prometheus_config(
                rules, None, [int(exporter.url.rsplit(":", 1)[1])])) as prom:
        started = time.monotonic()
        firing = 'ALERTS{alertname="KVCacheOffloadTierFull",alertstate="firing",target="tier-full"}'
        try:
            # Refusals and a queue for KV from ~3 s of wall time, `for` 15 s: well within the 30 s phase.
            [(labels, _)] = harness.wait_until(lambda: harness.prom_vector(prom.url, firing), timeout=phase_s / TIME_SCALE,
                                               interval=0.5, what="KVCacheOffloadTierFull firing for tier-full")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{diagnostics(prom.url, 'tier-full')}") from None
        assert (labels["tier"], labels["severity"], labels["engine"]) == ("cpu", "warning", "vllm")

        def drained():
            state = full.state().ranks[0]
            return full.sim_time > phase_s and state.report.running == state.report.waiting == 0

        harness.wait_until(drained, timeout=30, interval=0.5, what="the tier-full engine to drain after its phase")
        refused = full.state().ranks[0].counters.offload_store_failures
        time.sleep(3 * units.parse_duration(INTERVAL))  # a few more polls
        samples = harness.scrape(exporter.url)
        seconds = int(time.monotonic() - started) + 5
        steady_alerts = harness.prom_vector(
            prom.url, f'count_over_time(ALERTS{{alertname="KVCacheOffloadTierFull",target="tier-steady"}}[{seconds}s])')
        steady_diagnostics = diagnostics(prom.url, "tier-steady")
        steady_refused = steady.state().ranks[0].counters.offload_store_failures
        assert full.state().ranks[0].counters.offload_store_failures == refused  # the count stood still
    assert refused > 0
    assert harness.value(samples, "kvcache_tier_store_failures_total", target="tier-full", tier="cpu") == refused
    assert steady_refused == 0
    assert harness.value(samples, "kvcache_tier_store_failures_total", target="tier-steady", tier="cpu") == 0
    assert steady_alerts == [], f"KVCacheOffloadTierFull pending or firing for tier-steady\n{steady_diagnostics}"


def test_admission_stalled_fires_for_a_wedged_engine_within_its_for_and_not_for_a_capped_one(tmp_path):
    """KVCacheAdmissionStalled through the real exporter and Prometheus, judged on Prometheus' own timestamps: it is
    pending from the first evaluation whose window holds only the wedged engine's still counters (at most a window
    and a scrape after their last increase), fires `for` later, and never fires for a concurrency-capped engine
    (a queue beside free KV too, but it generates)."""
    rules = tmp_path / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    interval = units.parse_duration(INTERVAL)
    for_ = units.parse_duration(COMPRESSED.admission_stalled_for)
    wedge_at = scenarios.load_scenario("wedged").phases[0].duration_s / TIME_SCALE  # wall seconds
    started = time.time()
    with start_engine("vllm-v1", "wedged", speed=TIME_SCALE, seed=SEED) as wedged, \
            start_engine("vllm-v1", "concurrency-cap", speed=TIME_SCALE, seed=SEED) as capped, \
            harness.exporter(tmp_path, "--config", str(exporter_config(
                tmp_path / "exporter.yml", {"wedged": wedged.url, "capped": capped.url}))) as exporter, \
            harness.prometheus(tmp_path / "prom", prometheus_config(
                rules, None, [int(exporter.url.rsplit(":", 1)[1])])) as prom:
        firing = 'ALERTS{alertname="KVCacheAdmissionStalled",alertstate="firing"}'
        try:
            [(labels, _)] = harness.wait_until(
                lambda: harness.prom_vector(prom.url, firing), timeout=wedge_at + 3 * for_, interval=0.5,
                what="KVCacheAdmissionStalled firing")
        except TimeoutError as err:
            raise AssertionError(f"{err}\n{diagnostics(prom.url, 'wedged')}") from None
        end = time.time()
        seconds = int(end - started) + 5

        def samples(expr: str) -> list[tuple[float, float]]:
            [item] = harness.prom_query(prom.url, f"{expr}[{seconds}s]", time=end)["result"]
            return [(float(t), float(v)) for t, v in item["values"]]

        pending = samples('ALERTS{alertname="KVCacheAdmissionStalled",alertstate="pending",target="wedged"}')
        fired = samples(f'{firing[:-1]},target="wedged"}}')
        counters = [samples(f'kvcache_{family}_total{{target="wedged"}}')
                    for family in ("prompt_tokens", "generation_tokens")]
        capped_alerts = harness.prom_vector(
            prom.url, f'count_over_time(ALERTS{{alertname="KVCacheAdmissionStalled",target="capped"}}[{seconds}s])')
        capped_queue = harness.prom_vector(prom.url, f'max_over_time(kvcache_requests_waiting{{target="capped"}}[{seconds}s])')
    assert (labels["target"], labels["severity"], labels["dp_rank"]) == ("wedged", "critical", "0")
    # The last scrape at which either counter had grown: the stall as Prometheus saw it begin.
    last_increase = max(t for series in counters for (t, v), (_, before) in zip(series[1:], series) if v > before)
    assert pending[0][0] - last_increase <= COMPRESSED.window_seconds + 2 * interval, (pending[0][0], last_increase)
    assert for_ <= fired[0][0] - pending[0][0] <= for_ + 2 * interval, (pending[0][0], fired[0][0])
    assert capped_queue and capped_queue[0][1] >= 20  # the capped engine did queue beside free KV
    assert capped_alerts == [], "KVCacheAdmissionStalled pending or firing for the capped engine"


def test_alertmanager_inhibits_nearly_full_during_a_shortage_on_the_same_target(tmp_path, recorder):
    """The shipped inhibition, in a real Alertmanager fed through its API."""
    am_path = tmp_path / "alertmanager.yml"
    am_path.write_text(yaml.safe_dump(alertmanager_test_config(yaml.safe_load(SHIPPED_AM.read_text()), recorder.url, tmp_path)))

    def alert(name: str, severity: str, target: str) -> dict:
        return {"labels": {"alertname": name, "severity": severity, "target": target, "model": "m"},
                "annotations": {"summary": f"{name} on {target}"}}

    with harness.alertmanager(tmp_path / "am", am_path) as am:
        body = json.dumps([alert("KVCacheShortageQueueing", "critical", "a"), alert("KVCacheNearlyFull", "warning", "a"),
                           alert("KVCacheNearlyFull", "warning", "b")]).encode()
        request = urllib.request.Request(f"{am.url}/api/v2/alerts", data=body,
                                                 headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200

        def states():
            _, text = harness.http_get(f"{am.url}/api/v2/alerts")
            return {(a["labels"]["alertname"], a["labels"]["target"]): a["status"]["state"] for a in json.loads(text)}

        harness.wait_until(lambda: len(states()) == 3 and recorder.webhook_alerts("KVCacheNearlyFull", "b")
                           and recorder.webhook_alerts("KVCacheShortageQueueing", "a"),
                           timeout=20, what="the three alerts and the notifications for the shortage and target b")
        time.sleep(1)  # the chat group of target a was due at the same time as target b's
        assert states() == {("KVCacheShortageQueueing", "a"): "active", ("KVCacheNearlyFull", "a"): "suppressed",
                            ("KVCacheNearlyFull", "b"): "active"}
        assert recorder.webhook_alerts("KVCacheShortageQueueing", "a")
        assert recorder.webhook_alerts("KVCacheNearlyFull", "a") == []
