"""Replicas of one configuration, each polling its share (`shard: INDEX/COUNT`, exporter/runtime/shard.py):
every configured target on exactly one replica's page with its own page's value, whether the share is read
by the replica itself or by its workers; Debian's Prometheus scraping them with the scrape configuration
docs/scaling.md shows (loaded from the page); and a reload that cannot move a replica to another share."""

from __future__ import annotations

import re
import signal
from contextlib import ExitStack

import yaml

from devtools import harness
from devtools.harness import PageServer, page

TARGETS = 12
REPLICAS = 3
SCALING_DOC = harness.REPO / "docs" / "scaling.md"
DOC_MARKER = "<!-- tests/e2e/test_replica_shards.py loads the next YAML block -->"
DOC_REPLICAS = ["kvcache-exporter-0:10490", "kvcache-exporter-1:10490", "kvcache-exporter-2:10490"]


def usage(i: int) -> float:
    """Target i's page says this usage: which value belongs to which target is known."""
    return round(0.04 + i / 16, 4)


def write_config(path, server, shard: str | None = None) -> None:
    settings = {"poll_interval": "1s",
                "targets": [{"name": f"t-{i}", "url": server.url(f"/t/{i}")} for i in range(TARGETS)]}
    if shard is not None:
        settings["shard"] = shard
    path.write_text(yaml.safe_dump(settings))


def usages(exporter) -> dict[str, float]:
    return {dict(labels)["target"]: value
            for (_, labels), value in harness.series(harness.scrape(exporter.url), "kvcache_usage_ratio").items()}


def test_every_target_is_on_exactly_one_replica_with_its_own_value(tmp_path):
    config = tmp_path / "exporter.yml"
    with ExitStack() as stack:
        engines = stack.enter_context(PageServer({f"/t/{i}": page(harness.vllm_page(usage(i), preemptions=i)) for i in range(TARGETS)}))
        write_config(config, engines)
        for index in range(REPLICAS):
            (tmp_path / f"r{index}").mkdir()
        # The index from a flag, from the environment, and with the share split again over two workers.
        replicas = [
            stack.enter_context(harness.exporter(tmp_path / "r0", "--config", str(config), "--shard", "0/3")),
            stack.enter_context(harness.exporter(tmp_path / "r1", "--config", str(config),
                                                 env={"KVCACHE_EXPORTER_SHARD": "1/3"})),
            stack.enter_context(harness.exporter(tmp_path / "r2", "--config", str(config), "--shard", "2/3",
                                                 "--workers", "2")),
        ]
        shown: list[dict[str, float]] = []

        def every_target_read() -> bool:
            shown[:] = [usages(replica) for replica in replicas]
            return sum(map(len, shown)) == TARGETS and len({t for share in shown for t in share}) == TARGETS
        harness.wait_until(every_target_read, 20, what="every target read by one replica")
        assert {target: value for share in shown for target, value in share.items()} == \
            {f"t-{i}": usage(i) for i in range(TARGETS)}
        assert all(share for share in shown), [sorted(share) for share in shown]  # 12 names over 3: none empty
        for replica, share in zip(replicas, shown):
            samples = harness.scrape(replica.url)
            assert set(dict(labels)["target"] for (_, labels) in harness.series(samples, "kvcache_target_up")) == \
                set(share)  # a replica says nothing of the others' targets, not even that they are down
            assert harness.http_get(replica.url + "/ready")[0] == 200


def test_a_reload_keeps_the_replica_on_its_share(tmp_path):
    config = tmp_path / "exporter.yml"
    with PageServer({f"/t/{i}": page(harness.vllm_page(usage(i), preemptions=i)) for i in range(TARGETS)}) as engines:
        write_config(config, engines, shard="0/2")
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: len(usages(exporter)) > 0, 20, what="the share read")
            before = usages(exporter)
            assert 0 < len(before) < TARGETS
            write_config(config, engines, shard="1/2")
            exporter.signal(signal.SIGHUP)
            harness.wait_until(lambda: harness.value(harness.scrape(exporter.url),
                                                     "kvcache_exporter_config_last_reload_successful") == 1.0
                               and "shard changes only at restart" in exporter.log_path.read_text(), 20,
                               what="the reload")
            assert "shard changes only at restart; still 0/2" in exporter.log_path.read_text()
            assert usages(exporter) == before


def documented_job(replicas: list[str]) -> dict:
    """The scrape job of docs/scaling.md's poll-mode replicas, with these replicas' addresses and a 1 s interval."""
    blocks = re.findall(re.escape(DOC_MARKER) + r"\s*```yaml\n(.*?)```", SCALING_DOC.read_text(), re.S)
    assert len(blocks) == 1, f"docs/scaling.md: expected 1 YAML block after {DOC_MARKER}, found {len(blocks)}"
    (job,) = yaml.safe_load(blocks[0])["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == DOC_REPLICAS, "docs/scaling.md names other replicas: change DOC_REPLICAS with it"
    static["targets"] = replicas
    job.update(scrape_interval="1s", scrape_timeout="1s")
    return job


def test_prometheus_scrapes_each_replica_and_keeps_each_target_once_without_the_replica_address(tmp_path):
    config = tmp_path / "exporter.yml"
    with ExitStack() as stack:
        engines = stack.enter_context(PageServer({f"/t/{i}": page(harness.vllm_page(usage(i), preemptions=i))
                                                  for i in range(TARGETS)}))
        write_config(config, engines)
        replicas = []
        for index in range(REPLICAS):
            (tmp_path / f"r{index}").mkdir()
            replicas.append(stack.enter_context(harness.exporter(tmp_path / f"r{index}", "--config", str(config),
                                                                 "--shard", f"{index}/{REPLICAS}")))
        addresses = [replica.url.removeprefix("http://") for replica in replicas]
        job = documented_job(addresses)
        prom = stack.enter_context(harness.prometheus(tmp_path / "prometheus", {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [job]}))
        harness.wait_until(lambda: len(harness.prom_vector(prom.url, "kvcache_usage_ratio")) == TARGETS, 30,
                           what="every target's usage in Prometheus")
        stored = harness.prom_vector(prom.url, "kvcache_usage_ratio")
        assert {labels["target"]: value for labels, value in stored} == {f"t-{i}": usage(i) for i in range(TARGETS)}
        assert all("instance" not in labels and labels["job"] == job["job_name"] for labels, _ in stored)
        assert sorted(labels["instance"] for labels, _ in harness.prom_vector(prom.url, "kvcache_exporter_build_info")) \
            == sorted(addresses)  # the exporter's own series keep the replica that sent them
        assert {labels["instance"]: value for labels, value in
                harness.prom_vector(prom.url, f'up{{job="{job["job_name"]}"}}')} == dict.fromkeys(addresses, 1.0)
        # Each replica locks its polls to its own scrapes (eight regular ones: about 8 s at 1 s; up to 60 s,
        # as tests/e2e/test_phase_lock_prometheus.py allows, for a busy machine's irregular scrapes).
        harness.wait_until(lambda: {labels["instance"]: value for labels, value in harness.prom_vector(
            prom.url, "kvcache_exporter_poll_phase_locked")} == dict.fromkeys(addresses, 1.0), 60,
            what="every replica phase-locked to its scrapes")
