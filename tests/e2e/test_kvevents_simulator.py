"""Simulated engines publish their prefix cache's KV events (vLLM's unsigned hashes, SGLang's signed) and
the exporter process, subscribed, shows the pools' stores, evictions and capacity misses."""

from __future__ import annotations

import time

import pytest
import yaml
import zmq

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.sources.kvevents import CLEARED, decode_message

from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.harness import scrape, series, value

SPEED = 40.0


def test_simulated_engines_streams_reach_the_exporter(tmp_path):
    endpoints = [f"tcp://127.0.0.1:{harness.free_port()}" for _ in range(2)]
    engines = [start_engine("vllm-v1", "kv-saturation", speed=SPEED, seed=0, kv_events_endpoint=endpoints[0]),
               start_engine("sglang", "prefix-collapse", speed=SPEED, seed=1, kv_events_endpoint=endpoints[1])]
    try:
        targets = [{"name": name, "url": engine.url, "kv_events": {"endpoint": endpoint}}
                   for name, engine, endpoint in zip(("vllm", "sglang"), engines, endpoints)]
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "targets": targets}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            def misses():
                samples = scrape(exporter.url)
                found = {name: value(samples, "kvcache_capacity_miss_blocks_total", target=name)
                         for name in ("vllm", "sglang")}
                return samples if all(found.values()) else None

            # kv-saturation overflows the pool from ~100 simulated s, prefix-collapse evicts its shared
            # prefixes once 10 % of the prompts use them (300 s): 10 wall seconds at 40x.
            samples = harness.wait_until(misses, 30, interval=0.5, what="capacity misses in both pools")
            for name, engine in zip(("vllm", "sglang"), engines):
                labels = dict(target=name, engine=name, model=engine.model_name, dp_rank="0")
                stored = value(samples, "kvcache_events_blocks_stored_total", **labels)
                evicted = value(samples, "kvcache_events_blocks_evicted_total", **labels)
                # The pool holds at most its capacity: what was stored and not evicted fits in it
                # (the exporter joined after the engine started: it may have missed stores, never evictions
                # of blocks it did not see, which it counts too).
                assert 0 < evicted and stored - evicted <= engine.scenario.engine.num_blocks
                for reason in ("gap", "decode", "overflow"):
                    assert value(samples, "kvcache_events_dropped_total", reason=reason, **labels) == 0
                for reason in ("unknown_type", "unknown_field", "other_medium", "other_group"):
                    assert value(samples, "kvcache_events_ignored_total", reason=reason, **labels) == 0
                assert value(samples, "kvcache_capacity_miss_distance_ratio_count", **labels) == value(
                    samples, "kvcache_capacity_miss_blocks_total", **labels)
                assert value(samples, "kvcache_block_residency_seconds_count", **labels) > 0
                check_holders(samples, labels, harness.http_get(exporter.url + "/metrics")[1])
    finally:
        for engine in engines:
            engine.stop()


def test_a_simulated_restart_publishes_a_clear(tmp_path):
    endpoint = f"tcp://127.0.0.1:{harness.free_port()}"
    engine = start_engine("vllm-v1", "restart", speed=SPEED, seed=0, kv_events_endpoint=endpoint)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    try:
        pool = PoolState(capacity=engine.scenario.engine.num_blocks)
        deadline = time.monotonic() + 20  # the restart comes at 180 simulated seconds: 4.5 wall seconds
        cleared_at = None
        while cleared_at is None and time.monotonic() < deadline:
            if not socket.poll(500):
                continue
            batch = decode_message(socket.recv_multipart(), 1 << 24)
            if any(event.kind == CLEARED for event in batch.events):
                cleared_at = batch.ts
            pool.apply(batch.ts, batch.events)
        assert cleared_at is not None and engine.restarts >= 1
        # Stamped with the restart's simulated time (180 s) after the engine's start (created_unix of the
        # new generation is that start plus 180 s / speed, in wall time).
        started = engine.state().created_unix - 180 / SPEED
        assert cleared_at == pytest.approx(started + 180, abs=1e-3)
        assert pool.resident == {} and pool.ghost == {}
    finally:
        socket.close(linger=0)
        context.term()
        engine.stop()


def test_one_stream_per_dp_rank_on_port_plus_rank(tmp_path):
    base = harness.free_port()
    while True:  # the simulator binds base and base + 1
        try:
            endpoint = f"tcp://127.0.0.1:{base}"
            engine = start_engine("vllm-v1", "kv-saturation", speed=SPEED, seed=3, dp=2, kv_events_endpoint=endpoint)
            break
        except zmq.ZMQError:
            base = harness.free_port()
    try:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "targets": [
            {"name": "vllm", "url": engine.url, "kv_events": {"endpoint": endpoint, "dp_ranks": 2}}]}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            def both_ranks():
                samples = scrape(exporter.url)
                stored = {rank: value(samples, "kvcache_events_blocks_stored_total", target="vllm", dp_rank=rank)
                          for rank in ("0", "1")}
                return stored if all(stored.values()) else None

            harness.wait_until(both_ranks, 20, interval=0.5, what="stores on both ranks' streams")
    finally:
        engine.stop()


def check_holders(samples: dict, labels: dict, body: str) -> None:
    """Every store and capacity miss the pool counts is some adapter's and some tenant's, in one scrape;
    the simulator's adapters by name, its four tenants as keyed hashes, their salts nowhere. vLLM names a
    request's salt on its first block only, and the exporter joined after the engine started: the later
    blocks of chains begun before it count as tenant `none` (tests/unit/test_simulator_kvevents.py reads a
    run from its first batch: no `none` there)."""
    for holder in ("adapter", "tenant"):
        for family, pool_family in (("blocks_stored_total", "events_blocks_stored_total"),
                                    ("capacity_miss_blocks_total", "capacity_miss_blocks_total")):
            by_holder = series(samples, f"kvcache_{holder}_{family}", **labels)
            assert sum(by_holder.values()) == value(samples, f"kvcache_{pool_family}", **labels) > 0
        assert value(samples, "kvcache_events_holders_folded", holder=holder, **labels) == 0
    adapters = {dict(key[1])["adapter"] for key in series(samples, "kvcache_adapter_blocks_resident", **labels)}
    assert adapters == {"base", "sql-lora", "chat-lora"}
    tenants = {dict(key[1])["tenant"] for key in series(samples, "kvcache_tenant_blocks_stored_total", **labels)}
    hashed = tenants - {"none"}
    assert len(hashed) == 4 and all(len(t) == 12 and int(t, 16) >= 0 for t in hashed)
    assert "tenant-" not in body


@pytest.mark.parametrize("router", ["round-robin", "prefix-affinity"])
def test_the_fleet_index_tells_the_simulators_routers_apart(tmp_path, router):
    """Two DP ranks of a simulated vLLM (the steady workload: 60 % of the requests start with one of 4 shared
    prefixes of 512 tokens; after 40 idle seconds, 1 wall second at 40x, in which the exporter's SUB sockets reach
    the engine's PUB), the exporter's fleet index on: round-robin sends every prefix to both ranks, so one rank computes
    what the other holds (at least once per prefix, 4 x 512 tokens); prefix affinity keeps each prefix on one rank
    and nothing else repeats, so the routing loss stays 0 however much is stored."""
    # The exporter subscribes before the engine serves: the first stores of each prefix are the ones that count.
    endpoint, port, model = f"tcp://127.0.0.1:{harness.free_port()}", harness.free_port(), "sim-model"
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "fleet_index": {"enabled": True}, "targets": [
        {"name": "sim", "url": f"http://127.0.0.1:{port}/metrics", "model": model,
         "kv_events": {"endpoint": endpoint, "dp_ranks": 2}}]}))
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        scenario = tmp_path / "idle-then-steady.yml"
        scenario.write_text(yaml.safe_dump({"name": "idle-then-steady", "then": "hold", "phases": [
            {"name": "idle", "duration_s": 40, "arrival_rate": 0}, {"name": "steady", "duration_s": 600,
                                                                   "arrival_rate": 3}]}))
        engine = start_engine("vllm-v1", str(scenario), port=port, speed=SPEED, seed=2, model=model, dp=2,
                              kv_events_endpoint=endpoint, router=router)
        try:
            def stored_enough():
                samples = scrape(exporter.url)
                stored = value(samples, "kvcache_fleet_stored_tokens_total", model=model)
                return samples if stored >= 20 * 4 * 512 else None

            samples = harness.wait_until(stored_enough, 60, interval=0.5, what="the fleet index to see prefill")
            assert value(samples, "kvcache_fleet_replicas", model=model) == 2
            recomputed = value(samples, "kvcache_routing_recomputed_tokens_total", model=model)
            if router == "round-robin":
                assert recomputed >= 4 * 512
            else:
                assert recomputed == 0
            assert value(samples, "kvcache_fleet_isolated_replicas", model=model) == 0
        finally:
            engine.stop()
