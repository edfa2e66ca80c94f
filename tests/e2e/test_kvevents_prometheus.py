"""End to end through real Prometheus: a KV event stream with capacity misses at a known distance -> the
exporter -> Prometheus with the shipped rules (on a clock 20 times faster, as tests/e2e/test_alerts_e2e.py) ->
the what-if recording rules, and the dashboards' queries, answer with the stream's arithmetic.

The stream cycles through M = 851 distinct blocks with 100 resident: each step stores block i (then the
block of its request's last token, one that stays cached: never a capacity miss) after evicting block
i - 100 (an eviction the storing request makes after its lookup, so not above its own blocks). From the second lap on, every store is a capacity miss whose block lies
M - 100 - 1 = 750 evictions below the pool (none of the blocks evicted after it came back before it):
distance ratio 750 / 1,000 (the polled capacity). So a pool 1.25x or 1.5x as large keeps none of them,
2x and 4x keep all. 5 steps every 0.1 s: 50 misses/s of 16 tokens = 800 tokens/s, against 4,000 prompt
tokens/s looked up (2,000 hit) on the polled page: share 0.2, projected hit ratio 0.5 at 1.25x and 1.5x,
0.7 at 2x and 4x.
"""

from __future__ import annotations

import json
import re
import threading
import time

import yaml

from kvcache_exporter.alerts import generate
from kvcache_exporter.dashboards import build, fleet
from kvcache_exporter.thresholds import DEFAULT
from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import Publisher
from devtools.harness import PageServer, dynamic

TIME_SCALE = 20
CYCLE, RESIDENT, STEPS_PER_BATCH, BATCH_EVERY = 851, 100, 5, 0.1
LAST_BLOCK = 1
QUERIED_PER_SECOND, HIT_PER_SECOND = 4000.0, 2000.0
MISS_TOKENS = STEPS_PER_BATCH / BATCH_EVERY * 16  # once every store is a miss
EXPECTED_KEPT = {"1.25": 0.0, "1.5": 0.0, "2": MISS_TOKENS, "4": MISS_TOKENS}


def page(started: float) -> str:
    elapsed = time.time() - started
    return f"""# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1001"}} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {QUERIED_PER_SECOND * elapsed}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {HIT_PER_SECOND * elapsed}
"""


def publish(publisher: Publisher, stop: threading.Event) -> None:
    step = 0
    while not stop.wait(BATCH_EVERY):
        events = []
        for _ in range(STEPS_PER_BATCH):
            if step >= RESIDENT:  # the room for the block, as an engine makes it: before the store
                events.append(wire.removed("vllm-map", [1000 + (step - RESIDENT) % CYCLE]))
            # Each request's store ends with its last block, never a capacity miss: one that stays cached.
            events.append(wire.stored("vllm-map", [1000 + step % CYCLE, LAST_BLOCK]))
            step += 1
        publisher.send(wire.batch("vllm-map", time.time(), events))


def near(value: float, expected: float, tolerance: float) -> bool:
    return abs(value - expected) <= tolerance * max(expected, 1.0)


def test_what_if_rules_and_panels_answer_with_the_streams_arithmetic(tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(generate.render(generate.build(generate.compress(DEFAULT, TIME_SCALE))))
    pub_port, started, stop = harness.free_port(), time.time(), threading.Event()
    with PageServer({"/metrics": dynamic(lambda: page(started))}) as server, Publisher(pub_port) as publisher:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "targets": [
            {"name": "llama-0", "url": server.url("/metrics"),
             "kv_events": {"endpoint": f"tcp://127.0.0.1:{pub_port}"}}]}))
        sender = threading.Thread(target=publish, args=(publisher, stop), daemon=True)
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            sender.start()
            try:
                port = exporter.url.rpartition(":")[2]
                with harness.prometheus(tmp_path / "prometheus", {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [{"job_name": "kvcache-exporter",
                                        "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
                }) as prometheus:
                    check(prometheus.url)
            finally:
                stop.set()
                sender.join()


def check(prometheus: str) -> None:
    steady = []

    def settled():
        # The first lap (851 steps, 17 s) has no misses; then the rules' window (3 s) must hold misses only,
        # three evaluations in a row.
        share = harness.prom_vector(prometheus, "kvcache:capacity_miss_share_of_queried:ratio")
        steady.append(bool(share) and near(share[0][1], MISS_TOKENS / QUERIED_PER_SECOND, 0.15))
        return all(steady[-3:]) and len(steady) >= 3

    harness.wait_until(settled, 60, interval=1.0, what="the capacity-miss share steady at 0.2")
    kept = {labels["factor"]: value
            for labels, value in harness.prom_vector(prometheus, "kvcache:capacity_miss_tokens_kept:rate")}
    assert set(kept) == set(EXPECTED_KEPT)
    for factor, expected in EXPECTED_KEPT.items():
        assert near(kept[factor], expected, 0.15), (factor, kept)
    projected = {labels["factor"]: value
                 for labels, value in harness.prom_vector(prometheus, "kvcache:prefix_cache_hit_ratio:projected")}
    for factor, expected in EXPECTED_KEPT.items():
        assert near(projected[factor], (HIT_PER_SECOND + expected) / QUERIED_PER_SECOND, 0.1), (factor, projected)
    # The fleet dashboard's projected-hit-ratio panel, its variables set to match everything.
    dashboard = json.loads(build.render(fleet.build(DEFAULT, ())))
    panel = next(p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]
                 if p.get("title") == "Projected prefix-cache hit ratio by pool size")
    answers = {}
    for target in panel["targets"]:
        # Every variable matches everything (`All`), the namespace and pod ones included.
        expr = re.sub(r'=~"\$\w+"', '=~".*"', target["expr"].replace("$__rate_interval", "3s"))
        answers[target["legendFormat"]] = harness.prom_vector(prometheus, expr)[0][1]
    assert near(answers["today's pool"], HIT_PER_SECOND / QUERIED_PER_SECOND, 0.1), answers
    for factor, expected in EXPECTED_KEPT.items():
        assert near(answers[f"x{factor}"], (HIT_PER_SECOND + expected) / QUERIED_PER_SECOND, 0.1), answers
