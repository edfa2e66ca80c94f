"""The DP rank of a KV event stream's series is the one its batches name: a rank-1 vLLM engine served by an
API server of its own (external data parallelism, its page says engine="1") publishes rank 1 on the
endpoint the configuration lists first, and its events join the rank-1 pool, capacity included. Where no
batch names a rank, or two streams of a target name the same one, the configured ranks stay."""

from __future__ import annotations

import yaml
import zmq

from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import PageServer, Publisher, page, scrape, series, value

ENC = "vllm-map"
CAPACITY = 10  # num_gpu_blocks 11 minus the null block


def rank_page(engine: str) -> str:
    return f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="{engine}",model_name="m"}} 2.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="{engine}",num_gpu_blocks="{CAPACITY + 1}"}} 1.0
"""


def publishers(count: int) -> tuple[str, list[Publisher]]:
    """The endpoint of `count` publishers on consecutive ports, as the engines bind one per DP rank (base
    port + rank), and the publishers."""
    while True:
        base = harness.free_port()
        bound = []
        try:
            for offset in range(count):
                bound.append(Publisher(base + offset))
            return f"tcp://127.0.0.1:{base}", bound
        except zmq.ZMQError:
            for publisher in bound:
                publisher.close()


def streamed(samples: dict, target: str) -> dict[str, dict[str, float]]:
    """A target's stream counters by dp_rank."""
    out: dict[str, dict[str, float]] = {}
    for name in ("events_messages_total", "events_rank_mismatches_total", "capacity_miss_blocks_total"):
        for key, count in series(samples, "kvcache_" + name, target=target).items():
            out.setdefault(dict(key[1])["dp_rank"], {})[name] = count
    return out


def test_the_envelopes_rank_labels_the_streams_pool(tmp_path):
    (external_at, [external]), (unnamed_at, [unnamed]), (pair_at, pair) = publishers(1), publishers(1), publishers(2)
    server = PageServer({"/rank1": page(rank_page("1")), "/pair": page(rank_page("0"))})
    targets = [
        # vLLM's external DP mode: the rank-1 engine's own server, its endpoint configured as the first (rank 0)
        {"name": "rank1", "url": server.url("/rank1"), "kv_events": {"endpoint": external_at}},
        # batches without a rank (vLLM before data_parallel_rank, SGLang's earliest layout): the configured one
        {"name": "unnamed", "url": server.url("/pair"), "kv_events": {"endpoint": unnamed_at}},
        # two streams that both claim rank 0: they keep their configured ranks 0 and 1
        {"name": "pair", "url": server.url("/pair"),
         "kv_events": {"endpoint": pair_at, "dp_ranks": 2}},
    ]
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "targets": targets}))
    sends = {"rank1": (external, lambda events: wire.batch(ENC, 1000.0, events, dp_rank=1)),
             "unnamed": (unnamed, lambda events: wire.batch("vllm-v1-early", 1000.0, events)),
             "pair0": (pair[0], lambda events: wire.batch(ENC, 1000.0, events, dp_rank=0)),
             "pair1": (pair[1], lambda events: wire.batch(ENC, 1000.0, events, dp_rank=0))}
    try:
        with server, harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 10, what="ready")

            def joined():  # ZMQ loses what a PUB sends before the SUB has joined: send until every stream counts one
                for publisher, encode in sends.values():
                    publisher.send(encode([]))
                samples = scrape(exporter.url)
                got = {target: streamed(samples, target) for target in ("rank1", "unnamed", "pair")}
                return got if all(counts["events_messages_total"] >= 1 for by_rank in got.values()
                                  for counts in by_rank.values()) and len(got["pair"]) == 2 else None

            harness.wait_until(joined, 20, interval=0.1, what="a batch on every stream")
            # Blocks 1..5 stored, evicted in that order, 1 stored again: 4 evictions after its own, of a pool
            # of CAPACITY blocks, which only the rank-1 pool's capacity (from the page) gives.
            publisher, encode = sends["rank1"]
            publisher.send(encode([wire.stored(ENC, [1, 2, 3, 4, 5])]))
            # evicted for another request's block (11): evictions a request makes come before its store
            publisher.send(encode([wire.removed(ENC, [1, 2, 3, 4, 5]), wire.stored(ENC, [11])]))
            publisher.send(encode([wire.stored(ENC, [1, 6])]))  # 6: the request's last block, never a miss

            def missed():
                got = streamed(scrape(exporter.url), "rank1")
                return got if got.get("1", {}).get("capacity_miss_blocks_total") == 1 else None

            rank1 = harness.wait_until(missed, 10, what="the capacity miss")
            samples = scrape(exporter.url)

        assert set(rank1) == {"1"}  # nothing under the configured rank 0, where no pool is
        assert rank1["1"]["events_rank_mismatches_total"] == rank1["1"]["events_messages_total"] >= 4
        labels = {"target": "rank1", "engine": "vllm", "model": "m", "dp_rank": "1"}
        assert value(samples, "kvcache_usage_ratio", **labels) == 0.5  # the polled pool the events join
        assert value(samples, "kvcache_capacity_miss_distance_ratio_bucket", le="0.25", **labels) == 0
        assert value(samples, "kvcache_capacity_miss_distance_ratio_bucket", le="0.5", **labels) == 1
        assert value(samples, "kvcache_capacity_miss_distance_ratio_sum", **labels) == 4 / CAPACITY

        unnamed_counts = streamed(samples, "unnamed")
        assert set(unnamed_counts) == {"0"} and unnamed_counts["0"]["events_rank_mismatches_total"] == 0
        pair_counts = streamed(samples, "pair")
        assert set(pair_counts) == {"0", "1"}
        assert pair_counts["0"]["events_rank_mismatches_total"] == 0
        assert pair_counts["1"]["events_rank_mismatches_total"] == pair_counts["1"]["events_messages_total"] >= 1

        log = exporter.log_path.read_text()
        assert log.count("publishes as DP rank") == 2, log  # once per disagreeing stream, not per batch
        assert log.count(f"{external_at} publishes as DP rank 1") == 1
    finally:
        for publisher in (external, unnamed, *pair):
            publisher.close()

