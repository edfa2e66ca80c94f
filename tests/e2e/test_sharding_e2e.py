"""Sharding and multi-cluster setups of docs/scaling.md, end to end with Debian's Prometheus.

Both scrape configurations are loaded from docs/scaling.md itself; the test changes only
addresses, the discovery file and the intervals, so the page cannot drift from what runs here.
Sharding: file_sd discovers 20 simulated engines, `hashmod` relabeling sends each one to one of
two exporter replicas in probe mode. Multi-cluster: two Prometheus servers with a `cluster`
external label remote-write into a third, which answers the fleet dashboard's variable queries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import time
import urllib.parse
from pathlib import Path

import yaml

from kvcache_exporter.simulator.scenarios import load_scenario
from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.harness import probe

SCALING_DOC = harness.REPO / "docs" / "scaling.md"
FLEET_DASHBOARD = harness.REPO / "dashboards" / "generated" / "kvcache-fleet.json"
DOC_MARKER = "<!-- tests/e2e/test_sharding_e2e.py loads the next YAML block -->"
# Values of the documented blocks that name things which only exist in a real deployment.
DOC_REPLICAS = ("kvcache-exporter-0:10490", "kvcache-exporter-1:10490")
DOC_CLUSTER = "eu-west-1"
DOC_REMOTE_WRITE_URL = "http://thanos-receive.monitoring.svc:19291/api/v1/receive"

INTERVAL = 1  # seconds between scrapes (and the scrape timeout)
STALENESS = 4.0  # seconds without a probe after which a replica forgets an engine
STEADY_SPEED = 1.0  # twenty-odd engines share two cores with Prometheus and the exporters
SATURATION_SPEED = 20.0
FLAVORS = ("vllm-v1", "sglang")
ENGINE_LABEL = {"vllm-v1": "vllm", "sglang": "sglang"}  # simulator flavor -> discovery `engine` label
POOL_LABEL = {"vllm": "chat", "sglang": "batch"}  # a discovery label that must reach the series
PROBE_JOB = "kvcache"


# -- the documented configuration --------------------------------------------------------------

def documented_blocks() -> list[dict]:
    """The YAML blocks of docs/scaling.md that follow the test's marker: sharding, then cluster."""
    text = SCALING_DOC.read_text()
    blocks = re.findall(re.escape(DOC_MARKER) + r"\s*```yaml\n(.*?)```", text, re.S)
    assert len(blocks) == 2, f"docs/scaling.md: expected 2 marked YAML blocks, found {len(blocks)}"
    return [yaml.safe_load(block) for block in blocks]


def swap(value, replacements: dict[str, str], used: set[str]):
    """`value` with every string equal to a key of `replacements` replaced; records the keys used."""
    if isinstance(value, dict):
        return {key: swap(item, replacements, used) for key, item in value.items()}
    if isinstance(value, list):
        return [swap(item, replacements, used) for item in value]
    if isinstance(value, str) and value in replacements:
        used.add(value)
        return replacements[value]
    return value


def localized(block: dict, replacements: dict[str, str]) -> dict:
    used: set[str] = set()
    result = swap(block, replacements, used)
    assert used == set(replacements), f"docs/scaling.md no longer contains {set(replacements) - used}"
    return result


def sharding_jobs(discovery_dir: Path, replicas: list[str]) -> list[dict]:
    """The documented scrape jobs with this test's replicas, discovery directory and intervals."""
    jobs = localized(documented_blocks()[0], dict(zip(DOC_REPLICAS, replicas)))["scrape_configs"]
    for job in jobs:
        job.update(scrape_interval=f"{INTERVAL}s", scrape_timeout=f"{INTERVAL}s")
        for discovery in job.get("file_sd_configs", []):
            discovery.update(files=[str(discovery_dir / "*.json")], refresh_interval=f"{INTERVAL}s")
        for static in job.get("static_configs", []):
            static["targets"] = list(dict.fromkeys(static["targets"]))  # one replica may stand for both
    return jobs


def shard_of(address: str, modulus: int = 2) -> int:
    """Prometheus' `hashmod` (model/relabel): md5 of the value, its last 8 bytes big-endian, modulo."""
    return int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % modulus


# -- engines and discovery ---------------------------------------------------------------------

def address(engine) -> str:
    return f"{engine.host}:{engine.port}"


def start_steady(stack: contextlib.ExitStack, count: int, first_seed: int) -> dict[str, tuple]:
    """`count` steady engines, vLLM and SGLang in turn: {address: (engine, flavor)}."""
    engines = {}
    for i in range(count):
        flavor = FLAVORS[i % 2]
        started = stack.enter_context(start_engine(flavor, "steady", speed=STEADY_SPEED, seed=first_seed + i))
        engines[address(started)] = (started, flavor)
    return engines


def held_saturation():
    """kv-saturation without its recovery phase, held in overload: it keeps preempting all test long."""
    builtin = load_scenario("kv-saturation")
    return dataclasses.replace(builtin, name="kv-saturation-held", phases=builtin.phases[:-1], then="hold")


def port_per_shard() -> list[int]:
    """A free loopback port for each of the two shards, so that each replica gets a saturating engine."""
    found: dict[int, int] = {}
    while len(found) < 2:
        port = harness.free_port()
        found.setdefault(shard_of(f"127.0.0.1:{port}"), port)
    return [found[0], found[1]]


def write_discovery(path: Path, engines: dict[str, str]) -> None:
    """file_sd target groups for {address: engine label}, renamed into place as the docs ask."""
    groups = [{"targets": sorted(a for a, label in engines.items() if label == engine_label),
               "labels": {"engine": engine_label, "pool": POOL_LABEL[engine_label]}}
              for engine_label in sorted(set(engines.values()))]
    scratch = path.with_name(path.name + ".tmp")  # outside the *.json glob
    scratch.write_text(json.dumps(groups))
    os.replace(scratch, path)


def replica_config(directory: Path) -> Path:
    path = directory / "replica.yml"
    path.write_text(yaml.safe_dump({"poll_interval": f"{INTERVAL}s", "timeout": f"{0.8 * INTERVAL}s",
                                    "staleness": f"{STALENESS}s",
                                    "probe": {"enabled": True, "allow": ["127.0.0.0/8"]}}))
    return path


# -- what Prometheus says ----------------------------------------------------------------------

def routes(prom) -> dict[str, str]:
    """Active probe targets: engine address (`instance`) -> the replica (host:port) Prometheus scrapes."""
    _, body = harness.http_get(prom.url + "/api/v1/targets?state=active")
    return {target["labels"]["instance"]: urllib.parse.urlsplit(target["scrapeUrl"]).netloc
            for target in json.loads(body)["data"]["activeTargets"] if target["labels"]["job"] == PROBE_JOB}


def by_instance(prom, expr: str, **params) -> dict[str, float]:
    """An instant query whose result has one series per instance, as {instance: value}."""
    result = harness.prom_query(prom.url, expr, **params)["result"]
    values = {item["metric"]["instance"]: float(item["value"][1]) for item in result}
    assert len(values) == len(result), f"{expr}: more than one series for an instance: {result}"
    return values


def state_timeline(prom, instance: str, at: float, seconds: float) -> list[str]:
    """The pressure state at every scrape of one engine over `seconds` up to `at`, oldest first."""
    result = harness.prom_query(prom.url, f'kvcache_pressure_state{{instance="{instance}"}}[{int(seconds * 1000)}ms]',
                                time=at)["result"]
    current = {stamp: item["metric"]["state"] for item in result for stamp, value in item["values"] if value == "1"}
    return [current[stamp] for stamp in sorted(current)]


def probed_state(replica, engine, flavor: str, attempts: int = 3) -> str:
    """Probe one engine at one replica directly; the pressure state that poll derived.

    A poll that fails (a timeout on a busy machine) leaves the history as it was, so probing
    again until one succeeds keeps what is being tested: a first good poll still has no rate."""
    for _ in range(attempts):
        status, samples = probe(replica, engine.url, ENGINE_LABEL[flavor])
        assert status == 200, f"probe of {engine.url} at {replica.url} answered {status}"
        if harness.value(samples, "kvcache_target_up") == 1.0:
            break
    states = [dict(key[1])["state"] for key, value in harness.series(samples, "kvcache_pressure_state").items()
              if value == 1.0]
    assert len(states) == 1, states
    return states[0]


# -- sharding ----------------------------------------------------------------------------------

def assert_routed_by_hash(prom, fleet: dict[str, tuple], replica_addresses: list[str]) -> None:
    """Each engine is scraped at the replica its hash names, as one set of series with its labels."""
    assert routes(prom) == {a: replica_addresses[shard_of(a)] for a in fleet}
    per_replica = [[a for a in fleet if replica_addresses[shard_of(a)] == replica] for replica in replica_addresses]
    assert all(per_replica) and sum(map(len, per_replica)) == len(fleet) == 20, per_replica
    # last_over_time: one scrape that timed out on a busy machine must not hide an engine here.
    labels = {item["metric"]["instance"]: item["metric"]
              for item in harness.prom_query(prom.url, "last_over_time(kvcache_target_up[10s])")["result"]}
    for a, (_, flavor) in fleet.items():
        engine_label = ENGINE_LABEL[flavor]  # the exporter's own label, not renamed to exported_engine
        assert (labels[a]["job"], labels[a]["target"], labels[a]["engine"], labels[a]["pool"]) == \
            (PROBE_JOB, a, engine_label, POOL_LABEL[engine_label])
        assert "exported_engine" not in labels[a]
    assert by_instance(prom, "last_over_time(kvcache_exporter_build_info[10s])") == \
        dict.fromkeys(replica_addresses, 1.0)


def assert_pressure_follows(prom, saturation_addresses: list[str], steady_addresses: list[str]) -> None:
    """Saturating engines go from ok to thrashing and stay there; steady ones never leave ok or tight."""
    for a in saturation_addresses:
        # The onset itself may flip between ok and saturated while the pool fills.
        states = state_timeline(prom, a, time.time(), 120)
        assert states[0] == "ok" and set(states[states.index("thrashing"):]) == {"thrashing"}, (a, states)
    worst = by_instance(prom, 'max by (instance) '
                              '(max_over_time(kvcache_pressure_state{state=~"saturated|thrashing"}[5m]))')
    assert {a: worst[a] for a in steady_addresses} == dict.fromkeys(steady_addresses, 0.0)
    preempted = by_instance(prom, "sum by (instance) (last_over_time(kvcache_preemptions_total[10s]))")
    assert all(preempted[a] > 0 for a in saturation_addresses), preempted
    # SGLang creates its retraction counter at the first retraction: absent counts as none.
    assert all(preempted.get(a, 0.0) == 0.0 for a in steady_addresses), preempted


def test_hashmod_sends_every_engine_to_one_replica_and_discovery_changes_follow(tmp_path):
    """20 engines (2 saturating, one per shard) over two replicas; then 3 leave and 2 join the
    discovery file, the leaving ones are forgotten, and finally one replica goes down."""
    discovery_dir = tmp_path / "discovery"
    discovery_dir.mkdir()
    discovery_file = discovery_dir / "engines.json"
    with contextlib.ExitStack() as stack:
        steady = start_steady(stack, 18, first_seed=0)
        newcomers = start_steady(stack, 2, first_seed=100)
        saturation_ports = port_per_shard()
        saturation_addresses = [f"127.0.0.1:{port}" for port in saturation_ports]
        fleet = {**steady, **{a: (None, flavor) for a, flavor in zip(saturation_addresses, FLAVORS)}}
        write_discovery(discovery_file, {a: ENGINE_LABEL[flavor] for a, (_, flavor) in fleet.items()})

        replicas = []
        for shard in (0, 1):
            log_dir = tmp_path / f"replica-{shard}"
            log_dir.mkdir()
            replicas.append(stack.enter_context(harness.exporter(log_dir, "--config", str(replica_config(log_dir)))))
        replica_addresses = [urllib.parse.urlsplit(r.url).netloc for r in replicas]
        prom = stack.enter_context(harness.prometheus(tmp_path / "prometheus", {
            "global": {"scrape_interval": f"{INTERVAL}s", "evaluation_interval": f"{INTERVAL}s"},
            "scrape_configs": sharding_jobs(discovery_dir, replica_addresses),
        }))

        # The saturating engines start once Prometheus probes their addresses, so that their
        # first good polls see the warm-up (pressure ok) before the pool fills.
        harness.wait_until(lambda: routes(prom).keys() == fleet.keys(), 40, what="the 20 discovered engines")
        for port, flavor in zip(saturation_ports, FLAVORS):
            started = stack.enter_context(start_engine(flavor, held_saturation(), speed=SATURATION_SPEED,
                                                       port=port, seed=7))
            fleet[address(started)] = (started, flavor)
        harness.wait_until(lambda: by_instance(prom, "kvcache_target_up") == dict.fromkeys(fleet, 1.0), 20,
                           what="every engine up")

        assert_routed_by_hash(prom, fleet, replica_addresses)
        # Derived series, per replica: each saturating engine turns thrashing through its own replica.
        def thrashing(a):
            return by_instance(prom, f'kvcache_pressure_state{{instance="{a}", state="thrashing"}}').get(a) == 1.0

        harness.wait_until(lambda: all(thrashing(a) for a in saturation_addresses), 60,
                           what="both saturating engines thrashing")
        thrashing_since = time.time()
        steady_addresses = [a for a in fleet if a not in saturation_addresses]
        assert_pressure_follows(prom, saturation_addresses, steady_addresses)
        # The replica that does not own an engine has no history of it: its first poll cannot see a
        # preemption rate, so it says saturated while the owner, with history, says thrashing.
        for shard, a in enumerate(saturation_addresses):
            sat_engine, flavor = fleet[a]
            assert probed_state(replicas[1 - shard], sat_engine, flavor) == "saturated"
            assert probed_state(replicas[shard], sat_engine, flavor) == "thrashing"

        # Discovery changes: 3 engines leave (one saturating, two steady), 2 join.
        removed = [saturation_addresses[1], *steady_addresses[:2]]
        current = {a: v for a, v in fleet.items() if a not in removed} | newcomers
        write_discovery(discovery_file, {a: ENGINE_LABEL[flavor] for a, (_, flavor) in current.items()})
        harness.wait_until(lambda: routes(prom).keys() == current.keys(), 30, what="the rewritten target set")
        applied = time.time()
        gone_engine, gone_flavor = fleet[removed[0]]
        # Within the staleness period its replica still holds its history.
        assert probed_state(replicas[1], gone_engine, gone_flavor) == "thrashing"
        remembered_at = time.monotonic()

        assert routes(prom) == {a: replica_addresses[shard_of(a)] for a in current}
        deadline = applied + 2 * INTERVAL
        time.sleep(max(0.0, deadline + INTERVAL - time.time()))  # scrapes begun by then have ended
        # At that moment: no series at all of a removed engine (Prometheus wrote staleness markers
        # for every one), and series of every current one (`up` exists even for a failed scrape).
        harness.wait_until(
            lambda: by_instance(prom, f'count by (instance) ({{job="{PROBE_JOB}"}})', time=deadline).keys()
            == current.keys(), 15, what="the new target set two scrape intervals after Prometheus applied it")
        # ... and every engine, the added ones included, had a good probe within those two intervals.
        assert by_instance(prom, f"max_over_time(kvcache_target_up[{2 * INTERVAL}s])", time=deadline) == \
            dict.fromkeys(current, 1.0)
        # The saturating engine that stayed kept its replica, and that replica its history: thrashing
        # at every scrape from before the rewrite to after it (a new history would start saturated).
        around = state_timeline(prom, saturation_addresses[0], deadline, deadline - thrashing_since)
        assert len(around) >= 2 and set(around) == {"thrashing"}, around

        # The removed engine's replica forgets it `staleness` after its last probe: a probe after
        # that starts a new history, whose first poll has no preemption rate.
        time.sleep(max(0.0, remembered_at + STALENESS + 1.0 - time.monotonic()))
        assert probed_state(replicas[1], gone_engine, gone_flavor) == "saturated"

        # A replica that goes down blinds only its own shard: Prometheus' probe scrapes of it fail.
        replicas[1].stop()
        shard_up = {a: float(shard_of(a) == 0) for a in current}
        harness.wait_until(lambda: by_instance(prom, f'up{{job="{PROBE_JOB}"}}') == shard_up
                           and by_instance(prom, "kvcache_target_up").keys() == {a for a in current if shard_up[a]},
                           10, what="up 0 and no kvcache_* series exactly for the stopped replica's engines")


# -- several clusters --------------------------------------------------------------------------

def fleet_variable_values(prom_url: str, name: str, chosen: dict[str, str]) -> set[str]:
    """Values of a fleet dashboard variable as Grafana lists them; unset variables are All (`.*`)."""
    dashboard = json.loads(FLEET_DASHBOARD.read_text())
    query = next(v["query"] for v in dashboard["templating"]["list"] if v["name"] == name)
    selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", query).groups()
    selector = re.sub(r"\$(\w+)", lambda m: chosen.get(m.group(1), ".*"), selector)
    status, body = harness.http_get(f"{prom_url}/api/v1/label/{label}/values?"
                                    + urllib.parse.urlencode({"match[]": selector}))
    assert status == 200, body
    return set(json.loads(body)["data"])


def test_clusters_remote_write_to_one_store_where_the_cluster_variable_lists_them(tmp_path):
    flavors = {"east": "vllm-v1", "west": "sglang"}
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(harness.prometheus(
            tmp_path / "store", {"global": {"scrape_interval": f"{INTERVAL}s"}},
            extra_args=("--web.enable-remote-write-receiver",)))
        clusters, engines = {}, {}
        for index, (cluster, flavor) in enumerate(flavors.items()):
            work = tmp_path / cluster
            discovery_dir = work / "discovery"
            discovery_dir.mkdir(parents=True)
            pair = [stack.enter_context(start_engine(flavor, "steady", speed=STEADY_SPEED, seed=10 * index + i))
                    for i in range(2)]
            engines[cluster] = {address(e) for e in pair}
            write_discovery(discovery_dir / "engines.json", dict.fromkeys(engines[cluster], ENGINE_LABEL[flavor]))
            replica = stack.enter_context(harness.exporter(work, "--config", str(replica_config(work))))
            replica_address = urllib.parse.urlsplit(replica.url).netloc
            config = localized(documented_blocks()[1], {DOC_CLUSTER: cluster,
                                                        DOC_REMOTE_WRITE_URL: f"{store.url}/api/v1/write"})
            config["scrape_configs"] = sharding_jobs(discovery_dir, [replica_address, replica_address])
            clusters[cluster] = stack.enter_context(harness.prometheus(work / "prometheus", config))

        harness.wait_until(lambda: fleet_variable_values(store.url, "target", {}) == engines["east"] | engines["west"],
                           60, what="both clusters' engines in the store")
        assert fleet_variable_values(store.url, "cluster", {}) == set(flavors)
        for cluster, flavor in flavors.items():
            assert fleet_variable_values(store.url, "target", {"cluster": cluster}) == engines[cluster]
            assert fleet_variable_values(store.url, "engine", {"cluster": cluster}) == {ENGINE_LABEL[flavor]}
            # A cluster's own Prometheus answers without its external labels: no cluster to list,
            # and the All value still finds that cluster's engines.
            assert fleet_variable_values(clusters[cluster].url, "cluster", {}) == set()
            assert fleet_variable_values(clusters[cluster].url, "target", {}) == engines[cluster]
