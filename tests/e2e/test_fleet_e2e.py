"""Replicas of one model end to end: simulated vLLM engines -> the exporter -> Prometheus with the shipped rules
on a clock TIME_SCALE times faster. Each model is a small fleet:

- skewed: a router sends one replica more than it can hold while its peer idles: KVCacheRoutingImbalance fires;
- balanced: both replicas get the same overload (same scenario, same seed): no imbalance, and the autoscaling
  signal asks for replicas (every pool is KV-bound);
- capped: one replica queues behind its running-request cap with KV to spare: the signal asks for nothing;
- offload: one replica whose offload tier serves its hits: its GPU pool runs full, and the signal asks for nothing.

The balanced model also has a new replica that never answers (an autoscaler's, its model configured): it counts as
starting, so the signal does not ask for it again.
"""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import yaml

from devtools import harness, scaling_plots
from devtools.alerting import prometheus_config
from kvcache_exporter.alerts import generate
from kvcache_exporter.simulator import scenarios
from kvcache_exporter.simulator.server import start_engine
from kvcache_exporter.thresholds import DEFAULT

# 20x: the imbalance alert's 5m `for` is 15 s, the 1m window 3 s.
TIME_SCALE = 20
COMPRESSED = generate.compress(DEFAULT, TIME_SCALE)
INTERVAL = "1s"
SEED = 7
DEADLINE = 60.0
# kv-saturation's load, from the first second and for good: five requests per second against a 1,024-block pool.
OVERLOAD = {"name": "overload", "duration_s": 600, "arrival_rate": 5,
            "output_len": {"dist": "lognormal", "median": 240, "sigma": 0.5, "min": 16, "max": 1500}}
IDLE = {"name": "idle", "duration_s": 600, "arrival_rate": 0.2}
# offload-tier's small GPU pool and large CPU tier, at a load the pair serves: the GPU pool fills with prefixes and
# the tier serves them back.
OFFLOADED = {"name": "offloaded", "duration_s": 600, "arrival_rate": 0.7, "prefix_share": 0.9, "num_prefixes": 16,
             "prefix_len": 512}


def scenario(name: str, phase: dict, engine: dict | None = None) -> scenarios.Scenario:
    return scenarios.parse_scenario({"then": "hold", "phases": [phase], **({"engine": engine} if engine else {})},
                                    source=name, name=name)


# (model, target) -> scenario.
FLEET = {
    ("skewed", "skewed-hot"): scenario("hot", OVERLOAD),
    ("skewed", "skewed-idle"): scenario("idle", IDLE),
    ("balanced", "balanced-0"): scenario("overload", OVERLOAD),
    ("balanced", "balanced-1"): scenario("overload", OVERLOAD),
    ("capped", "capped-0"): "concurrency-cap",
    ("offload", "offload-0"): scenario("offloaded", OFFLOADED, {"num_blocks": 256, "offload_blocks": 4096}),
}


def over_run(prom_url: str, expr: str, seconds: int) -> dict[str, float]:
    """Per model, `expr`'s maximum over the last `seconds`."""
    return {labels.get("model", ""): value for labels, value in
            harness.prom_vector(prom_url, f"max by (model) (max_over_time(({expr})[{seconds}s:1s]))")}


def peak(prom_url: str, series: str, seconds: int) -> dict[str, float]:
    """Per model, the largest sample of `series` in the last `seconds`: every scrape's, where a subquery reads one
    per step, its steps on whole seconds, and so misses a sample newer than the last whole second (the pool's
    first full scrape, just waited for: 0.71 read once where the wait had seen 0.75)."""
    return {labels.get("model", ""): value for labels, value in
            harness.prom_vector(prom_url, f"max by (model) (max_over_time({series}[{seconds}s]))")}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    rules = tmp / "kvcache-rules.yml"
    # The never-answering replica stays starting for the whole run (30 s of lookback on this clock would end
    # before a run on a busy machine does; past it, a replica that never answered is broken, not starting).
    rules.write_text(generate.render(generate.build(
        dataclasses.replace(COMPRESSED, replica_starting_lookback=f"{int(DEADLINE) * 2}s"))))
    engines = {}
    # Bound and never listening: connections to it are refused, as to a replica still loading its weights.
    loading = socket.socket()
    loading.bind(("127.0.0.1", 0))
    try:
        for (model, target), run in FLEET.items():
            engines[target] = start_engine("vllm-v1", run, speed=TIME_SCALE, seed=SEED, model=model)
        config = tmp / "exporter.yml"
        config.write_text(yaml.safe_dump({
            "poll_interval": INTERVAL, "pressure": dataclasses.asdict(COMPRESSED),
            "targets": [{"name": target, "url": engine.url, "engine": "vllm"} for target, engine in engines.items()]
            + [{"name": "balanced-new", "url": f"http://127.0.0.1:{loading.getsockname()[1]}/metrics",
                "model": "balanced"}]}))
        started, unix_started = time.monotonic(), time.time()
        with harness.exporter(tmp, "--config", str(config)) as exporter, \
                harness.prometheus(tmp / "prom", prometheus_config(
                    rules, None, [int(exporter.url.rsplit(":", 1)[1])], INTERVAL)) as prom:
            firing = 'ALERTS{alertname="KVCacheRoutingImbalance",alertstate="firing",model="skewed"}'
            try:
                harness.wait_until(lambda: harness.prom_vector(prom.url, firing), timeout=DEADLINE, interval=0.5,
                                   what="KVCacheRoutingImbalance on the skewed fleet")
            except TimeoutError as err:
                seen = harness.prom_vector(prom.url, "kvcache:fleet_requests_waiting_for_kv_peer_headroom:ratio")
                raise AssertionError(f"{err}\nshare on pools whose peers have headroom: {seen}") from None
            # The offload replica's premise, a GPU pool run full while its tier serves hits: how soon the alert
            # above fires says nothing of how far that replica's own load has got (0.71 once, on a busy machine).
            full = (f'max_over_time(kvcache_usage_ratio{{model="offload"}}[{int(DEADLINE)}s])'
                    f' >= {DEFAULT.low_water_ratio}')
            harness.wait_until(lambda: harness.prom_vector(prom.url, full), timeout=DEADLINE, interval=0.5,
                               what="the offload replica's GPU pool full")
            seconds = int(time.monotonic() - started) + 2
            result = {
                "imbalance": over_run(prom.url, 'ALERTS{alertname="KVCacheRoutingImbalance"}', seconds),
                "share": over_run(prom.url, "kvcache:fleet_requests_waiting_for_kv_peer_headroom:ratio", seconds),
                "spread": over_run(prom.url, "kvcache:fleet_usage_ratio:spread", seconds),
                "delta": over_run(prom.url, "kvcache:fleet_replicas:delta", seconds),
                # The fewest replicas starting at any evaluation (a poll that times out on a busy machine reads
                # as a replica restarting, so the most says little).
                "starting": {m: -v for m, v in over_run(
                    prom.url, "-(sum by (model) (kvcache:fleet_replicas_starting:count)"
                              " or sum by (model) (0 * kvcache:fleet_replicas_ready:count))",
                    seconds).items()},
                "short": over_run(prom.url, "kvcache:fleet_replicas_short:count", seconds),
                # How far the delta ever was from the shortage less the one replica starting (and less those
                # that joined within the window: every replica, in the first one), while that one was all.
                "delta_off": over_run(prom.url, "abs(kvcache:fleet_replicas:delta - clamp_min("
                                                "kvcache:fleet_replicas_short:count - 1"
                                                " - kvcache:fleet_replicas_joined:count, 0))"
                                                " and kvcache:fleet_replicas_starting:count == 1", seconds),
                "min_delta": {m: -v for m, v in over_run(prom.url, "-kvcache:fleet_replicas:delta", seconds).items()},
                "waiting": over_run(prom.url, "sum by (model) (kvcache_requests_waiting)", seconds),
                "waiting_for_kv": over_run(prom.url, "sum by (model) (kvcache_requests_waiting_for_kv)", seconds),
                "usage": peak(prom.url, "kvcache_usage_ratio", seconds),
                "backlog": over_run(prom.url, "kvcache:fleet_kv_backlog_tokens:sum", seconds),
                "tier_hits": over_run(prom.url, f'increase(kvcache_cached_prompt_tokens_total{{source="cpu"}}[{seconds}s])',
                                      seconds),
            }
            scaling_plots.record(prom.url, "fleet", unix_started, TIME_SCALE)
        yield result
    finally:
        loading.close()
        for engine in engines.values():
            engine.stop()


def test_a_skewed_router_fires_the_imbalance_and_a_balanced_one_does_not(outcome):
    assert outcome["imbalance"].get("skewed") == 1
    assert outcome["share"]["skewed"] >= DEFAULT.routing_imbalance_share
    assert outcome["spread"]["skewed"] >= 0.5  # one pool full, the other nearly empty
    # The balanced pair was never even pending, though both its pools queued for KV.
    assert "balanced" not in outcome["imbalance"]
    assert outcome["waiting_for_kv"]["balanced"] >= 2


def test_scale_out_is_asked_only_for_kv_bound_pools(outcome):
    # Every balanced pool queues for KV and no peer has room: replicas are short.
    assert outcome["short"]["balanced"] >= 1
    assert outcome["backlog"]["balanced"] > 0
    # A queue behind the running-request cap, and a full pool whose offload tier keeps up, ask for none (and,
    # while anything queues or the pool holds more than the low-water mark, give none back).
    assert outcome["waiting"]["capped"] >= 1 and outcome["waiting_for_kv"]["capped"] == 0
    assert outcome["delta"]["capped"] == 0 and outcome["min_delta"]["capped"] == 0
    assert outcome["usage"]["offload"] >= DEFAULT.low_water_ratio and outcome["tier_hits"]["offload"] > 0
    assert outcome["delta"]["offload"] == 0 and outcome["min_delta"]["offload"] == 0


def test_a_new_replica_that_never_answered_counts_as_starting(outcome):
    # The one configured replica of balanced that does not answer, always; no other model's always.
    assert outcome["starting"] == {"balanced": 1, "skewed": 0, "capped": 0, "offload": 0}
    # The signal never asks for it again: at every evaluation the delta is the shortage less that one replica.
    assert outcome["delta_off"]["balanced"] == 0
