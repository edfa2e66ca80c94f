"""Disaggregated prefill/decode end to end: simulated prefill/decode pairs (vLLM with the NIXL connector's
series, SGLang in --disaggregation-mode) -> the exporter -> Prometheus with the shipped rules on a clock
TIME_SCALE times faster. Each P/D scenario fires exactly the alerts it must: the ones listed fire, and no other
alert fires before they all have (the P/D alerts not listed are never even pending).

Every pair serves one model of its own, the P/D group the rules aggregate by. vLLM's pages name no role: its
targets carry `role:`; SGLang's say it (`engine_type`).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import yaml

from devtools import harness
from devtools.alerting import prometheus_config
from kvcache_exporter.alerts import generate
from kvcache_exporter.alerts.rules import disaggregated
from kvcache_exporter.simulator.pd import start_pd_pair
from kvcache_exporter.thresholds import DEFAULT

# 40x: a 5m `for` is 7.5 s, the 1m window 1.5 s (three polls and scrapes at 500ms).
TIME_SCALE = 40
COMPRESSED = generate.compress(DEFAULT, TIME_SCALE)
INTERVAL = "500ms"
SEED = 7
PD_ALERTS = {"KVCachePDBackpressure", "KVCacheTransfersFailing", "KVCacheTransferLeaseExpiries",
             "KVCacheTransferNotificationsAfterExpiry", "KVCacheTransferBandwidthLow"}
# (scenario, engine) -> the alerts that must fire. A decode pool short of KV with transfers waiting for their KV to
# be allocated is also `saturated` (KVCacheShortageQueueing) on both engines: vLLM counts them under the
# `capacity` reason, SGLang in its pre-allocation queue, part of its decode queue.
RUNS = {
    ("pd-steady", "vllm"): set(),
    ("pd-steady", "sglang"): set(),
    ("pd-decode-short", "vllm"): {"KVCachePDBackpressure", "KVCacheShortageQueueing"},
    ("pd-decode-short", "sglang"): {"KVCachePDBackpressure", "KVCacheShortageQueueing"},
    ("pd-lease-expiry", "vllm"): {"KVCacheTransferLeaseExpiries", "KVCacheTransferNotificationsAfterExpiry"},
    ("pd-transfer-failures", "vllm"): {"KVCacheTransfersFailing"},
    ("pd-transfer-failures", "sglang"): {"KVCacheTransfersFailing"},
}
# The expected alerts fire within ~10 s of the first scrape (a 7.5 s `for` after a 1.5 s window); alerts that
# could follow them in a run (KVCacheNearlyFull on a decode pool short of KV, KVCacheQueueDominatesTTFT on one
# that keeps requests waiting: a 10m `for`, 15 s) come later.
DEADLINE = 90.0  # a wait, not a bound: on a busy machine the scrapes and evaluations come late


def model_of(run: tuple[str, str]) -> str:
    return f"{run[0]}/{run[1]}"


def target_of(run: tuple[str, str], role: str) -> str:
    return f"{run[0]}-{run[1]}-{role}"


def alerts_seen(prom_url: str, seconds: int, state: str = "firing") -> dict[str, set[str]]:
    """Per model, the alert names Prometheus had in `state` (any state where None) over the last `seconds`."""
    selector = f'alertstate="{state}"' if state else ""
    seen: dict[str, set[str]] = {}
    for labels, _ in harness.prom_vector(prom_url, f"count by (alertname, model) "
                                                   f"(count_over_time(ALERTS{{{selector}}}[{seconds}s]))"):
        seen.setdefault(labels.get("model", ""), set()).add(labels["alertname"])
    return seen


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """What Prometheus saw once every run's expected alerts fired, the exporter's page then, and the pairs'
    own counts."""
    tmp = tmp_path_factory.mktemp("pd")
    rules = tmp / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    pairs = {run: start_pd_pair(run[1], run[0], speed=TIME_SCALE, seed=SEED, model=model_of(run)) for run in RUNS}
    try:
        targets = [{"name": target_of(run, role), "url": url, **({"role": role} if run[1] == "vllm" else {})}
                   for run, pair in pairs.items() for role, url in (("prefill", pair.prefill_url),
                                                                     ("decode", pair.decode_url))]
        config = tmp / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": INTERVAL, "labels": {"cluster": "e2e"},
                                          "pressure": dataclasses.asdict(COMPRESSED), "targets": targets}))
        started = time.monotonic()
        with harness.exporter(tmp, "--config", str(config)) as exporter, \
                harness.prometheus(tmp / "prom", prometheus_config(
                    rules, None, [int(exporter.url.rsplit(":", 1)[1])], INTERVAL)) as prom:

            # Each run is judged when its own expected alerts have all fired: what fired by then, and what was
            # pending or firing, for its model.
            firing: dict[tuple[str, str], set[str]] = {}
            any_state: dict[tuple[str, str], set[str]] = {}

            def judged() -> bool:
                window = int(time.monotonic() - started) + 2
                seen, seen_any = alerts_seen(prom.url, window), alerts_seen(prom.url, window, state="")
                for run, expected in RUNS.items():
                    if run not in firing and expected and expected <= seen.get(model_of(run), set()):
                        firing[run], any_state[run] = seen.get(model_of(run), set()), seen_any.get(model_of(run), set())
                if all(run in firing for run, expected in RUNS.items() if expected):
                    for run in RUNS:  # the quiet runs, judged over the whole time
                        firing.setdefault(run, seen.get(model_of(run), set()))
                        any_state.setdefault(run, seen_any.get(model_of(run), set()))
                    return True
                return False

            try:
                harness.wait_until(judged, timeout=DEADLINE, interval=0.5, what="every run's expected alerts")
            except TimeoutError as err:
                seen = alerts_seen(prom.url, int(time.monotonic() - started) + 2, state="")
                raise AssertionError(f"{err}\nseen (any state): {seen}") from None
            window = int(time.monotonic() - started) + 2
            backpressure = {labels["model"]: value for labels, value in
                            harness.prom_vector(prom.url, disaggregated.PD_BACKPRESSURE)}
            states = {(labels["target"], labels["state"]) for labels, _ in harness.prom_vector(
                prom.url, f'max_over_time(kvcache_pressure_state[{window}s]) == 1')}
            page = harness.scrape(exporter.url)
            counts = {run: {role: pair.state(role)[1] for role in ("prefill", "decode")} for run, pair in pairs.items()}
        yield firing, any_state, backpressure, states, page, counts
    finally:
        for pair in pairs.values():
            pair.stop()


@pytest.mark.parametrize("run", RUNS, ids=lambda run: model_of(run))
def test_exactly_the_expected_alerts_fire(outcome, run):
    firing, any_state, *_ = outcome
    assert firing[run] == RUNS[run]
    # The P/D alerts it must not fire were never even pending.
    assert any_state[run] & PD_ALERTS == RUNS[run] & PD_ALERTS


def test_backpressure_counts_the_decode_sides_held_transfers(outcome):
    """Only the decode-short groups read backpressure, and its value is the decode side's transfers waiting for
    KV, which are the decode pool's requests waiting for KV on both engines: both pools read saturated while they
    hold their prefill peers back."""
    _, _, backpressure, states, page, _ = outcome
    assert set(backpressure) <= {model_of(("pd-decode-short", "vllm")), model_of(("pd-decode-short", "sglang"))}
    for engine in ("vllm", "sglang"):
        run = ("pd-decode-short", engine)
        waiting = harness.value(page, "kvcache_kv_transfer_requests", target=target_of(run, "decode"),
                                stage="waiting_to_start", role="decode")
        assert waiting >= 5
        assert harness.value(page, "kvcache_kv_transfer_requests_waiting_for_kv", target=target_of(run, "decode")) \
            == waiting == harness.value(page, "kvcache_requests_waiting_for_kv", target=target_of(run, "decode"))
        assert harness.value(page, "kvcache_requests_waiting_with_kv_room", target=target_of(run, "decode")) == 0
        decode_states = {state for target, state in states if target == target_of(run, "decode")}
        assert "saturated" in decode_states and "capped" not in decode_states
    # Its prefill side waits for the handshake (the bootstrap queue), holding no KV of those requests.
    assert harness.value(page, "kvcache_kv_transfer_requests", target=target_of(("pd-decode-short", "sglang"),
                                                                                "prefill"),
                         stage="waiting_to_start", role="prefill") >= 5


def test_the_exporter_reads_the_engines_counts(outcome):
    """Counters as the exporter last polled them: never above the pair's own count by now, and counting."""
    *_, page, counts = outcome
    lease = ("pd-lease-expiry", "vllm")
    expired = harness.value(page, "kvcache_kv_transfer_lease_expiries_total", target=target_of(lease, "prefill"))
    late = harness.value(page, "kvcache_kv_transfer_notifications_after_expiry_total",
                         target=target_of(lease, "prefill"))
    assert 0 < expired <= counts[lease]["prefill"].lease_expiries
    assert 0 < late <= counts[lease]["prefill"].notifications_after_expiry
    for engine, side in (("vllm", "decode"), ("sglang", "prefill")):  # the side that times the transfers
        run = ("pd-transfer-failures", engine)
        failed = harness.value(page, "kvcache_kv_transfer_failures_total", target=target_of(run, side), kind="transfer")
        timed = harness.value(page, "kvcache_kv_transfer_seconds_count", target=target_of(run, side))
        assert 0 < failed <= counts[run][side].failed_transfers
        assert 0.1 < failed / (failed + timed) < 0.3  # one transfer in five fails
    steady = ("pd-steady", "vllm")
    # vLLM's decode side reads the peer's prompt tokens; the steady groups never lose a transfer.
    assert harness.value(page, "kvcache_kv_transfer_prompt_tokens_total", target=target_of(steady, "decode")) > 0
    assert harness.value(page, "kvcache_kv_transfer_failures_total", target=target_of(steady, "decode"),
                         kind="transfer") == 0
