"""Probe mode: /probe?target=URL polls one engine now and keeps its history between probes."""

from __future__ import annotations

import time
import urllib.parse

import yaml

from tests import harness
from tests.pageserver import PageServer, dynamic, page
from tests.test_exporter_faults import GOOD_PAGE


def probe(exporter, url: str, engine: str | None = None) -> tuple[int, dict]:
    query = {"target": url, **({"engine": engine} if engine else {})}
    status, body = harness.http_get(f"{exporter.url}/probe?{urllib.parse.urlencode(query)}")
    if status != 200:
        return status, {}
    from prometheus_client.parser import text_string_to_metric_families

    return status, {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(body) for s in family.samples}


def test_probe_keeps_history_and_forgets_idle_targets(tmp_path):
    preemptions = iter(range(0, 10_000, 50))
    full_page = (GOOD_PAGE.replace("} 0.5", "} 0.99")
                 + '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="m"} 3\n')
    routes = {
        "/metrics": page(GOOD_PAGE),
        "/thrashing": dynamic(lambda: full_page + "# TYPE vllm:num_preemptions counter\n"
                              f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {next(preemptions)}\n'),
        "/down": page("no", status=503),
    }
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"poll_interval": "1s", "staleness": "2s"}))
    with PageServer(routes) as server, harness.exporter(tmp_path, "--config", str(config)) as exporter:
        status, samples = probe(exporter, server.url("/metrics"), engine="vllm")
        assert status == 200
        assert harness.value(samples, "kvcache_usage_ratio") == 0.5
        assert harness.value(samples, "kvcache_free_blocks") == 500
        assert harness.value(samples, "kvcache_target_up") == 1.0
        assert harness.series(samples, "kvcache_exporter_build_info") == {}  # probe output is the target's alone

        # pressure needs two polls of the preemption counter: the second probe has the first as history
        _, first = probe(exporter, server.url("/thrashing"))
        assert harness.value(first, "kvcache_pressure_state", state="saturated") == 1.0
        time.sleep(0.5)
        _, second = probe(exporter, server.url("/thrashing"))
        assert harness.value(second, "kvcache_pressure_state", state="thrashing") == 1.0

        for expected in (1.0, 2.0):
            _, down = probe(exporter, server.url("/down"))
            assert harness.value(down, "kvcache_target_up") == 0.0
            assert harness.value(down, "kvcache_target_scrape_failures_total", reason="http_status") == expected
        assert harness.value(harness.scrape(exporter.url), "kvcache_exporter_probed_targets") == 3.0
        time.sleep(2.5)  # longer than the staleness period: the targets are forgotten, counts start over
        _, good = probe(exporter, server.url("/metrics"), engine="vllm")
        assert harness.value(good, "kvcache_target_up") == 1.0
        _, down = probe(exporter, server.url("/down"))  # its own target, new, not the one just probed
        assert harness.value(down, "kvcache_target_up") == 0.0
        assert harness.value(down, "kvcache_target_scrape_failures_total", reason="http_status") == 1.0
        assert harness.value(harness.scrape(exporter.url), "kvcache_exporter_probed_targets") == 2.0


def test_probe_rejects_bad_parameters(tmp_path):
    with harness.exporter(tmp_path) as exporter:
        assert probe(exporter, "not-a-url")[0] == 400
        assert probe(exporter, "http://127.0.0.1:1/metrics", engine="tgi")[0] == 400
        assert harness.http_get(exporter.url + "/probe")[0] == 400
