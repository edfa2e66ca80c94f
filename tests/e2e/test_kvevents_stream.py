"""The exporter process subscribed to real ZMQ PUB sockets: pool series with the target's labels, gaps
(replayed or counted), restarts, clears, malformed and oversized messages, and a flooding engine that
neither crashes the exporter nor delays the polling of another target."""

from __future__ import annotations

import signal
import time

import msgpack
import yaml

from devtools import harness
from devtools import kvevents_wire as wire
from devtools.harness import scrape, series, value
from devtools.harness import Publisher
from devtools.harness import PageServer, page

CAPACITY = 1000  # num_gpu_blocks 1001 minus vLLM's null block
PAGE = f"""# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{CAPACITY + 1}"}} 1.0
"""
INTERVAL = 0.5
MAX_MESSAGE = 64 * 1024
ENC = "vllm-map"


def batch(*events, ts: float = 1000.0) -> bytes:
    return wire.batch(ENC, ts, list(events))


def counters(exporter, target: str = "engine") -> dict[str, float]:
    samples = scrape(exporter.url)
    out = {}
    for name in ("events_blocks_stored_total", "events_blocks_evicted_total", "capacity_miss_blocks_total",
                 "events_messages_total", "events_publisher_restarts_total"):
        out[name] = value(samples, "kvcache_" + name, target=target)
    for reason in ("gap", "decode", "overflow"):
        out[reason] = value(samples, "kvcache_events_dropped_total", target=target, reason=reason)
    return out


def settle(exporter, what: str, predicate, timeout: float = 10.0) -> dict[str, float]:
    return harness.wait_until(lambda: (lambda c: c if predicate(c) else None)(counters(exporter)), timeout,
                              interval=0.1, what=what)


def join(publisher: Publisher, exporter) -> dict[str, float]:
    """Send empty batches until the exporter's SUB socket has joined (ZMQ loses what a PUB sends before)."""
    for _ in range(200):
        publisher.send(batch())
        time.sleep(0.05)
        if counters(exporter)["events_messages_total"] >= 1:
            time.sleep(0.3)  # let the last ones in flight arrive
            return counters(exporter)
    raise TimeoutError("the exporter never received a message")


def start(tmp_path, pub_port, replay_port=None, extra_targets=(), **kv_events):
    events = {"endpoint": f"tcp://127.0.0.1:{pub_port}", "max_message_bytes": MAX_MESSAGE, **kv_events}
    if replay_port:
        events["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    server = PageServer({"/metrics": page(PAGE)})
    targets = [{"name": "engine", "url": server.url("/metrics"), "labels": {"zone": "a"}, "kv_events": events},
               *extra_targets]
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"poll_interval": f"{INTERVAL}s", "staleness": "3s", "targets": targets}))
    return server, harness.exporter(tmp_path, "--config", str(config))


def test_pool_series_gaps_replay_restart_and_clear(tmp_path):
    pub_port, replay_port = harness.free_port(), harness.free_port()
    server, exporter_context = start(tmp_path, pub_port, replay_port)
    with server, Publisher(pub_port, replay_port) as publisher, exporter_context as exporter:
        harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 10, what="ready")
        base = join(publisher, exporter)
        assert base["gap"] == base["decode"] == base["overflow"] == 0

        publisher.send(batch(wire.stored(ENC, list(range(1, 11))), ts=1000.0))
        publisher.send(batch(wire.removed(ENC, [1]), ts=1030.0))
        # evicted for another request's block (11): the evictions a request makes come before its store
        publisher.send(batch(wire.removed(ENC, [2, 3, 4, 5]), wire.stored(ENC, [11]), ts=1100.0))
        # 1 again, 4 evictions after its own: distance 4/1000 (6 after it, cached, computed again: the lookup
        # stopped at 1; a store's last block is never a capacity miss)
        publisher.send(batch(wire.stored(ENC, [1, 6]), ts=1101.0))
        got = settle(exporter, "the first batches", lambda c: c["capacity_miss_blocks_total"] == 1)
        assert (got["events_blocks_stored_total"], got["events_blocks_evicted_total"]) == (13, 5)
        samples = scrape(exporter.url)
        labels = dict(target="engine", engine="vllm", model="m", dp_rank="0", zone="a")
        assert value(samples, "kvcache_capacity_miss_distance_ratio_bucket", le="0.1", **labels) == 1
        assert value(samples, "kvcache_capacity_miss_distance_ratio_sum", **labels) == 4 / CAPACITY
        # residency: block 1 lived 30 s, blocks 2..5 100 s
        assert value(samples, "kvcache_block_residency_seconds_bucket", le="30.0", **labels) == 1
        assert value(samples, "kvcache_block_residency_seconds_bucket", le="120.0", **labels) == 5
        assert value(samples, "kvcache_block_residency_seconds_sum", **labels) == 30 + 4 * 100
        assert time.time() - value(samples, "kvcache_events_last_message_timestamp_seconds", **labels) < 10

        # A batch the subscriber never got but the replay buffer holds: asked back, applied, no gap.
        publisher.send(batch(wire.stored(ENC, [500, 501])), publish=False)
        publisher.send(batch(wire.removed(ENC, [500])))
        got = settle(exporter, "the replayed batch", lambda c: c["events_blocks_evicted_total"] == 6)
        assert got["events_blocks_stored_total"] == 15 and got["gap"] == 0 and publisher.replays == 1
        # Two batches beyond the replay buffer (sent nowhere at all): a gap of 2.
        publisher.seq += 2
        publisher.send(batch(wire.removed(ENC, [501])))
        got = settle(exporter, "the gap", lambda c: c["events_blocks_evicted_total"] == 7)
        assert got["gap"] == 2

        # The engine restarts: sequence 0 again. Its hashes are a new key space: 6..10 were resident,
        # and re-storing 2 (in the ghost list before) is no capacity miss in the new epoch.
        publisher.send(batch(wire.stored(ENC, [2])), seq=0)
        got = settle(exporter, "the restart", lambda c: c["events_publisher_restarts_total"] == 1)
        assert got["capacity_miss_blocks_total"] == 1 and got["gap"] == 2
        # A clear forgets too: 2 evicted, cleared, stored again: no capacity miss.
        publisher.send(batch(wire.removed(ENC, [2]), wire.cleared(ENC), wire.stored(ENC, [2])))
        got = settle(exporter, "the clear", lambda c: c["events_blocks_stored_total"] == 17)
        assert got["capacity_miss_blocks_total"] == 1


def test_a_gap_is_replayed_from_a_two_frame_replay_endpoint(tmp_path):
    # SGLang (and vLLM before 0.26) answer a replay with [seq, payload], without the topic frame.
    pub_port, replay_port = harness.free_port(), harness.free_port()
    server, exporter_context = start(tmp_path, pub_port, replay_port)
    with server, Publisher(pub_port, replay_port, replay_topic=False) as publisher, exporter_context as exporter:
        join(publisher, exporter)
        publisher.send(batch(wire.stored(ENC, [1, 2, 3])), publish=False)
        publisher.send(batch(wire.stored(ENC, [4])), publish=False)
        publisher.send(batch(wire.removed(ENC, [1])))
        got = settle(exporter, "the replayed batches", lambda c: c["events_blocks_evicted_total"] == 1)
        assert got["events_blocks_stored_total"] == 4 and got["gap"] == 0 and publisher.replays == 1


def test_a_reload_keeps_an_unchanged_stream_and_drops_a_removed_one(tmp_path):
    pub_port = harness.free_port()
    server, exporter_context = start(tmp_path, pub_port)
    config = tmp_path / "exporter.yml"
    with server, Publisher(pub_port) as publisher, exporter_context as exporter:
        join(publisher, exporter)
        publisher.send(batch(wire.stored(ENC, [1, 2])))
        settle(exporter, "the stores", lambda c: c["events_blocks_stored_total"] == 2)
        settings = yaml.safe_load(config.read_text())
        settings["targets"][0]["labels"] = {"zone": "b"}  # the same stream, new labels: its state stays
        config.write_text(yaml.safe_dump(settings))
        exporter.signal(signal.SIGHUP)
        harness.wait_until(lambda: series(scrape(exporter.url), "kvcache_events_blocks_stored_total", zone="b"),
                           10, what="the relabelled stream")
        assert value(scrape(exporter.url), "kvcache_events_blocks_stored_total", target="engine") == 2
        del settings["targets"][0]["kv_events"]
        config.write_text(yaml.safe_dump(settings))
        exporter.signal(signal.SIGHUP)
        harness.wait_until(lambda: not series(scrape(exporter.url), "kvcache_events_blocks_stored_total"), 10,
                           what="the stream's series gone")
        assert value(scrape(exporter.url), "kvcache_target_up", target="engine") == 1


def test_malformed_and_oversized_messages_are_counted(tmp_path):
    pub_port = harness.free_port()
    server, exporter_context = start(tmp_path, pub_port)
    with server, Publisher(pub_port) as publisher, exporter_context as exporter:
        base = join(publisher, exporter)
        bad = [b"\xc1", msgpack.packb({"no": "events"}), msgpack.packb([1.0, [["BlockStored", "x"]]]),
               b"\x00" * (MAX_MESSAGE + 1)]
        for payload in bad:
            publisher.send(payload)
        publisher.send_frames([b"", b"short"])  # neither counted as a sequence nor a gap
        publisher.send(batch(wire.stored(ENC, [1])))
        got = settle(exporter, "the bad messages", lambda c: c["events_blocks_stored_total"] == 1)
        assert got["decode"] == base["decode"] + len(bad) + 1 and got["gap"] == 0
        assert got["events_messages_total"] == base["events_messages_total"] + 1
        # Far above the limit libzmq itself refuses the frame and drops the connection: the exporter
        # lives on, reconnects, and the lost sequence numbers show as a gap.
        publisher.send(b"\x00" * (4 * MAX_MESSAGE))
        harness.wait_until(lambda: (publisher.send(batch(wire.stored(ENC, [2]))),
                                    counters(exporter)["events_blocks_stored_total"] >= 2)[1], 15,
                           interval=0.2, what="the stream after the oversized frame")
        assert counters(exporter)["gap"] >= 1


def test_a_flooding_stream_is_counted_and_leaves_other_targets_fresh(tmp_path):
    pub_port = harness.free_port()
    polled: list[float] = []  # when the exporter fetched the healthy target's page, as its server saw it

    def healthy_page(handler) -> None:
        polled.append(time.monotonic())
        page(PAGE)(handler)

    healthy = PageServer({"/metrics": healthy_page})
    server, exporter_context = start(tmp_path, pub_port,
                                     extra_targets=[{"name": "healthy", "url": healthy.url("/metrics")}])
    with healthy, server, Publisher(pub_port) as publisher, exporter_context as exporter:
        harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 10, what="ready")
        base = join(publisher, exporter)
        first_seq = publisher.seq - int(sum(base[k] for k in ("events_messages_total", "gap", "decode", "overflow")))
        payload = batch(wire.stored(ENC, list(range(64))), wire.removed(ENC, list(range(64))))
        # A 4 s flood, scraped every half second of it. Whether the healthy target stays fresh is judged by
        # when its server was asked for the page: how fast this process sends, or how long a scrape takes to
        # come back on a busy machine (two scrapes in the 4 s once), is not what this tests.
        started = time.monotonic()
        deadline, next_scrape = started + 4.0, started + 0.5
        sent = 0
        while time.monotonic() < deadline:
            for _ in range(500):
                publisher.send(payload)
            sent += 500
            if time.monotonic() >= next_scrape:
                next_scrape += 0.5
                assert value(scrape(exporter.url), "kvcache_target_up", target="healthy") == 1
        ended = time.monotonic()

        def accounted():
            # Every sequence number up to the last one sent is tracked, refused or counted lost. One more
            # batch each time: while the flood drains, the publisher's own queue drops what it sends.
            publisher.send(batch())
            time.sleep(0.2)
            c = counters(exporter)
            seen = sum(c[k] for k in ("events_messages_total", "gap", "decode", "overflow"))
            return c if seen == publisher.seq - first_seq else None

        got = harness.wait_until(accounted, 30, interval=0.1, what="every published batch accounted for")
        # The polls from the last before the flood to the first after it: none missed or late by a poll.
        during = [t for t in polled if t < started][-1:] + [t for t in polled if started <= t <= ended] \
            + [t for t in polled if t > ended][:1]
        gaps = [b - a for a, b in zip(during, during[1:])]
        print(f"flood: {sent} batches sent in {ended - started:.1f} s, "
              f"{got['events_messages_total'] - base['events_messages_total']:.0f} tracked, overflow "
              f"{got['overflow']:.0f}, gap {got['gap']:.0f}; the healthy target polled {len(during)} times, "
              f"{max(gaps):.2f} s apart at most")
        assert got["decode"] == 0 and got["overflow"] + got["gap"] > 0
        assert during[0] < started and during[-1] > ended and max(gaps) < 2 * INTERVAL
        samples = scrape(exporter.url)
        assert value(samples, "kvcache_target_up", target="healthy") == 1
        assert series(samples, "kvcache_usage_ratio", target="healthy")


def holder_counts(exporter, holder: str) -> dict[str, tuple[float, ...]]:
    samples = scrape(exporter.url)
    out: dict[str, list[float]] = {}
    for name in ("blocks_resident", "blocks_stored_total", "blocks_evicted_total", "capacity_miss_blocks_total"):
        for key, found in series(samples, f"kvcache_{holder}_{name}", target="engine").items():
            out.setdefault(dict(key[1])[holder], []).append(found)
    out["folded"] = [value(samples, "kvcache_events_holders_folded", target="engine", holder=holder)]
    return {label: tuple(counts) for label, counts in out.items()}


def test_adapters_and_tenants_top_two_and_other_through_the_socket(tmp_path):
    pub_port = harness.free_port()
    server, exporter_context = start(tmp_path, pub_port, top_holders=2)
    with server, Publisher(pub_port) as publisher, exporter_context as exporter:
        base = join(publisher, exporter)
        publisher.send(batch(wire.stored(ENC, [1, 2], lora_name="sql", salt="acme"),
                             wire.stored(ENC, [3], parent=2, lora_name="sql"),  # vLLM salts the first block only
                             wire.stored(ENC, [4], salt="beta"), wire.stored(ENC, [5], salt="gamma"),
                             wire.stored(ENC, [6, 7], lora_name="chat", salt="delta")))
        # 1 and 3 evicted for another request's block (a second copy of 5, computed again); then 1 back (a
        # capacity miss), 2 computed again after it
        publisher.send(batch(wire.removed(ENC, [1, 3]), wire.stored(ENC, [5], salt="gamma"),
                             wire.stored(ENC, [1, 2], lora_name="sql", salt="acme")))
        stored = base["events_blocks_stored_total"] + 10
        settle(exporter, "both batches", lambda c: c["events_blocks_stored_total"] == stored)
        # (resident, stored, evicted, capacity misses): sql/acme hold {1, 2} after 1 and 3 left and 1 came back
        adapters = holder_counts(exporter, "adapter")
        # ties at 2 resident go to the most stored (sql, then base)
        assert adapters == {"sql": (2, 5, 2, 1), "base": (2, 3, 0, 0), "other": (2, 2, 0, 0), "folded": (1,)}
        tenants = holder_counts(exporter, "tenant")
        assert tenants.pop("folded") == (2,) and tenants.pop("other") == (2, 3, 0, 0)  # beta and gamma
        assert sorted(tenants.values()) == [(2, 2, 0, 0), (2, 5, 2, 1)]  # delta and acme, as keyed hashes
        assert not {"acme", "delta"} & set(tenants)
