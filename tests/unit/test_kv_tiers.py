"""Offload tiers from the KV event stream (exporter/tiers.py), on the golden streams of
tests/fixtures/offload-golden: a GPU pool with vLLM's own CPU offload manager behind it (how they were made:
devtools/offload_golden.py), held to what vLLM's manager itself did in each run (truth.json)."""

from __future__ import annotations

import gzip
import json

import msgpack
import pytest

from kvcache_exporter.blocks import PoolState
from kvcache_exporter.sources.kvevents import decode_payload
from kvcache_exporter.tiers import Tiers
from devtools import kvevents_wire as wire
from devtools.harness import FIXTURES

GOLDEN = FIXTURES / "offload-golden"
TRUTH = json.loads((GOLDEN / "truth.json").read_text())
RUNS = sorted(int(chunks) for chunks in TRUTH["runs"])


def replay(chunks: int) -> tuple[PoolState, Tiers]:
    """The run's stream folded as the exporter's subscriber folds it: the tier's capacity is its polled tokens
    over the block size, chunks x 16 / 16 here."""
    gpu, tiers = PoolState(capacity=TRUTH["gpu_blocks"]), Tiers()
    for seq, payload in msgpack.unpackb(gzip.decompress((GOLDEN / f"vllm-cpu-{chunks}.msgpack.gz").read_bytes())):
        batch = decode_payload(seq, payload, 1 << 24)
        for tier in tiers.pools:
            tiers.set_capacity(tier, chunks)
        tiers.apply(gpu, batch.ts, batch.events)
    return gpu, tiers


@pytest.mark.parametrize("chunks", RUNS)
def test_the_host_tier_counts_what_vllms_offload_manager_did(chunks):
    truth = TRUTH["runs"][str(chunks)]
    gpu, tiers = replay(chunks)
    cpu = tiers.pools["cpu"]
    assert (cpu.stored, cpu.evicted) == (truth["host_stored"], truth["host_evicted"])
    # Every key vLLM stored again after evicting it is a capacity miss of the tier (80 keys: the list of
    # evictions, 4 x capacity, holds them all).
    assert cpu.capacity_misses == truth["host_restored_after_eviction"]
    assert cpu.distance.count == cpu.capacity_misses
    # The tier is full from early on: it holds as many blocks as it has chunks, stored less evicted.
    assert len(cpu.resident) == cpu.stored - cpu.evicted == chunks
    # Offload hits, attributed to the tier that served them: the blocks vLLM loaded.
    assert tiers.served == {"cpu": truth["served"]}
    # The GPU pool is the same as without the tier's events, none of which it counts as ignored any more.
    assert (gpu.stored, gpu.evicted) == (truth["gpu_stored"], truth["gpu_evicted"])
    assert gpu.ignored["other_medium"] == 0
    assert tiers.block_size == TRUTH["block_size"]


@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_a_larger_host_tier_serves_what_the_distance_histogram_said(factor):
    """The same requests against a tier `factor` times as large: vLLM's manager loaded more blocks from it,
    and the capacity misses of the smaller tier's stream with a distance ratio at or below factor - 1 say how
    many."""
    small = RUNS[0]
    _, tiers = replay(small)
    kept = dict(tiers.pools["cpu"].distance.cumulative())[factor - 1]
    gained = TRUTH["runs"][str(int(small * factor))]["served"] - TRUTH["runs"][str(small)]["served"]
    print(f"\nx{factor:g} host tier: vLLM served {gained} more blocks, the histogram kept {kept}")
    assert gained > 100  # the run says something: the larger tier serves many more
    assert abs(kept - gained) <= 0.02 * gained


def test_sglang_hicache_host_copies_and_load_backs():
    """SGLang names its host tier CPU_PINNED: a node written through to host, evicted from the GPU (a
    demotion: the host copy stays) and loaded back is served by the host tier; a block the GPU pool already
    holds (a second copy) is not."""
    gpu, tiers = PoolState(capacity=4), Tiers()
    batches = [
        [wire.stored("sglang-map", [1, 2]), wire.stored("sglang-map", [1, 2], medium="CPU_PINNED")],
        [wire.removed("sglang-map", [1, 2])],  # demoted: host only
        [wire.stored("sglang-map", [1, 2, 3])],  # 1 and 2 loaded back, 3 computed
        [wire.stored("sglang-map", [3], medium="CPU_PINNED"), wire.stored("sglang-map", [3])],  # a copy: not served
        [wire.removed("sglang-map", [1], medium="CPU_PINNED")],
        [wire.stored("sglang-map", [1], medium="CPU_PINNED")],  # computed again and backed up: the tier's miss
    ]
    for seq, events in enumerate(batches):
        payload = wire.batch("sglang-map", 100.0 + seq, events)
        tiers.apply(gpu, 100.0 + seq, decode_payload(seq, payload, 1 << 20).events)
    cpu = tiers.pools["cpu"]
    assert tiers.served == {"cpu": 2}
    assert (cpu.stored, cpu.evicted, cpu.capacity_misses, len(cpu.resident)) == (4, 1, 1, 3)
    assert gpu.stored == 6 and gpu.evicted == 2


def test_a_medium_of_no_tier_stays_ignored_and_serves_nothing():
    """A store of a medium no tier has (here "NVME") is the GPU pool's `other_medium`, even of a block the CPU
    tier holds; a store of a block the GPU pool's group 1 (a sliding-window group) needs is no offload hit."""
    gpu, tiers = PoolState(capacity=4), Tiers()
    events = [wire.stored("vllm-map", [7], medium="CPU"), wire.stored("vllm-map", [7], medium="NVME"),
              wire.stored("vllm-map", [7], group_idx=1)]
    tiers.apply(gpu, 1.0, decode_payload(0, wire.batch("vllm-map", 1.0, events), 1 << 20).events)
    assert tiers.served == {"cpu": 0}
    assert gpu.ignored == {"other_medium": 1, "other_group": 1} and gpu.stored == 0


def test_a_stream_renders_its_tier_with_the_tiers_polled_capacity_in_blocks():
    """The subscriber's stream: the tier's capacity is the poll's tier_capacity_tokens over the pool's block size
    (64 tokens / 16 = 4 blocks), so a miss 2 evictions deep has ratio 0.5; the tier's series carry `tier`."""
    from types import SimpleNamespace

    from kvcache_exporter.config import KVEventsConfig
    from kvcache_exporter.runtime.subscriber import EventStream
    from kvcache_exporter.snapshot import RankValues

    rank = RankValues(gauges={"capacity_blocks": 8.0, "block_size_tokens": 16.0},
                      labelled={"tier_capacity_tokens": {("cpu",): 64.0}})
    target = SimpleNamespace(name="t", labels={}, outcome=SimpleNamespace(ranks={"0": rank}, engine="vllm",
                                                                           model="m", role="unified"))
    stream = EventStream(target, 0, "tcp://127.0.0.1:5557", None, KVEventsConfig(endpoint="tcp://127.0.0.1:5557"))
    batches = [[wire.stored("vllm-map", [1, 2, 3], medium="CPU")],
               [wire.removed("vllm-map", [1], medium="CPU"), wire.removed("vllm-map", [2], medium="CPU"),
                wire.removed("vllm-map", [3], medium="CPU")],
               [wire.stored("vllm-map", [1], medium="CPU"), wire.stored("vllm-map", [3])]]
    for seq, events in enumerate(batches):
        stream._process(seq, wire.batch("vllm-map", 10.0 + seq, events))
    assert stream.tiers.pools["cpu"].capacity == 4
    text = b"".join(stream.render(0).status.values()).decode()
    tier = 'target="t",engine="vllm",model="m",dp_rank="0",role="unified",tier="cpu"'
    # 1 came back with 2 and 3 evicted after it and still out: 2 / 4 blocks = 0.5
    assert f'kvcache_tier_capacity_miss_distance_ratio_bucket{{{tier},le="0.5"}} 1.0' in text
    assert f'kvcache_tier_capacity_miss_distance_ratio_bucket{{{tier},le="0.25"}} 0.0' in text
    assert f"kvcache_tier_blocks_resident{{{tier}}} 1.0" in text
    assert f"kvcache_tier_events_blocks_stored_total{{{tier}}} 4.0" in text
    assert f"kvcache_tier_served_blocks_total{{{tier}}} 0.0" in text  # 3 had left the tier: computed
    assert 'kvcache_events_block_size_tokens{target="t",engine="vllm",model="m",dp_rank="0",role="unified"} 16.0' \
        in text
