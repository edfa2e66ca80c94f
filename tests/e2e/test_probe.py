"""Probe mode: /probe?target=URL polls one engine now and keeps its history between probes."""

from __future__ import annotations

import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import yaml

from devtools import harness
from devtools.harness import GOOD_PAGE, LOOPBACK_PROBES, PageServer, dynamic, page, probe


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
    config.write_text(yaml.safe_dump({"poll_interval": "1s", "staleness": "2s", "probe": LOOPBACK_PROBES}))
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


def probe_answer(exporter, url: str, **params: str) -> tuple[int, str]:
    return harness.http_get(f"{exporter.url}/probe?{urllib.parse.urlencode({'target': url, **params})}")


def exporter_with(tmp_path, **settings):
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump(settings))
    return harness.exporter(tmp_path, "--config", str(config))


def test_probe_mode_is_off_unless_enabled(tmp_path):
    with PageServer({"/metrics": page(GOOD_PAGE)}) as server, harness.exporter(tmp_path) as exporter:
        status, body = probe_answer(exporter, server.url("/metrics"))
        assert (status, body) == (403, "probe mode is off: set probe.enabled and probe.allow in the configuration\n")
        assert server.requests == {}


def test_probe_rejects_bad_parameters(tmp_path):
    with exporter_with(tmp_path, probe=LOOPBACK_PROBES) as exporter:
        assert probe(exporter, "not-a-url")[0] == 400
        assert probe(exporter, "http://127.0.0.1:1/metrics", engine="tgi")[0] == 400
        assert harness.http_get(exporter.url + "/probe")[0] == 400
        assert probe_answer(exporter, "http://127.0.0.1:99999/metrics") == (
            400, "target is not a valid URL (bad host or port): 'http://127.0.0.1:99999/metrics'\n")
        status, body = probe_answer(exporter, "http://scraper:s3cret-pw@127.0.0.1:1/metrics")
        assert status == 400 and "basic_auth.password_file" in body and "s3cret-pw" not in body
        assert "s3cret-pw" not in exporter.log_path.read_text()


def test_probe_takes_every_registered_engine_and_lists_them_when_refusing_another(tmp_path):
    from kvcache_exporter.adapters import ADAPTERS

    with PageServer({"/metrics": page(GOOD_PAGE)}) as server, \
            exporter_with(tmp_path, probe=LOOPBACK_PROBES) as exporter:
        assert probe_answer(exporter, server.url("/metrics"), engine="tgi") == (
            400, f"engine must be one of {', '.join(['auto', *ADAPTERS])}\n")
        assert len(ADAPTERS) == 7 and "lmcache" in ADAPTERS
        for engine in ADAPTERS:  # polled as that engine: an answer, whatever the adapter makes of the page
            assert probe(exporter, server.url("/metrics"), engine=engine)[0] == 200, engine
        assert server.requests["/metrics"] == len(ADAPTERS)


def test_probe_allow_list_and_the_exporters_own_address(tmp_path):
    with PageServer({"/metrics": page(GOOD_PAGE)}) as server:
        allow = ["10.0.0.0/8", "*.engines.example", "127.0.0.1"]
        with exporter_with(tmp_path, probe={"enabled": True, "allow": allow}) as exporter:
            port = exporter.url.rpartition(":")[2]
            assert probe(exporter, server.url("/metrics"))[0] == 200  # 127.0.0.1 is listed
            for refused in (server.url("/metrics").replace("127.0.0.1", "localhost"),  # a name, not listed
                            "http://192.168.1.10:8000/metrics", "http://vllm.engines.example.org:8000/metrics"):
                status, body = probe_answer(exporter, refused)
                assert status == 403 and "probe.allow" in body, refused
            assert probe_answer(exporter, "http://vllm-0.engines.example:1/metrics")[0] == 200  # pattern: polled
            assert probe_answer(exporter, f"http://127.0.0.1:{port}/metrics") == (
                403, "target is this exporter itself\n")
        with exporter_with(tmp_path, probe={"enabled": True, "allow": ["*"]}) as exporter:
            port = exporter.url.rpartition(":")[2]
            for own in (f"http://localhost:{port}/metrics", f"http://127.0.0.2:{port}/probe?target=x",
                        f"http://[::1]:{port}/metrics", f"http://0.0.0.0:{port}/metrics"):
                assert probe_answer(exporter, own)[0] == 403, own


def test_probe_state_is_capped_least_recently_probed_first(tmp_path):
    routes = {f"/e{i}": page("no", status=503) for i in range(8)}
    with PageServer(routes) as server, exporter_with(
            tmp_path, staleness="1h", probe={**LOOPBACK_PROBES, "max_targets": 5}) as exporter:
        for i in range(5):
            probe(exporter, server.url(f"/e{i}"))
        probe(exporter, server.url("/e0"))  # e0 is now the most recently probed: e1 goes first
        for i in range(5, 8):
            probe(exporter, server.url(f"/e{i}"))
        samples = harness.scrape(exporter.url)
        assert harness.value(samples, "kvcache_exporter_probed_targets") == 5.0
        assert harness.value(samples, "kvcache_exporter_probe_evictions_total") == 3.0
        # e0 kept its state (second failure counted on top of the first two), e1 starts over
        _, e0 = probe(exporter, server.url("/e0"))
        assert harness.value(e0, "kvcache_target_scrape_failures_total", reason="http_status") == 3.0
        _, e1 = probe(exporter, server.url("/e1"))
        assert harness.value(e1, "kvcache_target_scrape_failures_total", reason="http_status") == 1.0


def test_concurrent_probes_of_one_engine_share_one_poll(tmp_path):
    def slow(handler):
        time.sleep(1.0)
        page(GOOD_PAGE)(handler)

    with PageServer({"/slow": slow}) as server, exporter_with(tmp_path, probe=LOOPBACK_PROBES) as exporter:
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda _: probe(exporter, server.url("/slow"), engine="vllm"), range(20)))
        assert [status for status, _ in answers] == [200] * 20
        assert all(harness.value(samples, "kvcache_usage_ratio") == 0.5 for _, samples in answers)
        assert server.requests == {"/slow": 1}


def test_probe_honours_the_scrape_timeout_header(tmp_path):
    def slow(handler):
        time.sleep(1.5)
        page(GOOD_PAGE)(handler)

    # the configured timeout (4 s) would wait for the page; Prometheus' 1 s scrape timeout must not
    with PageServer({"/slow": slow}) as server, exporter_with(
            tmp_path, poll_interval="5s", probe=LOOPBACK_PROBES) as exporter:
        request = urllib.request.Request(f"{exporter.url}/probe?target={urllib.parse.quote(server.url('/slow'))}",
                                         headers={"X-Prometheus-Scrape-Timeout-Seconds": "1"})
        with urllib.request.urlopen(request, timeout=5) as response:
            samples = harness.samples_of(response.read().decode())
        assert harness.value(samples, "kvcache_target_up") == 0.0
        assert harness.value(samples, "kvcache_target_scrape_failures_total", reason="timeout") == 1.0
        assert 0.85 <= harness.value(samples, "kvcache_target_scrape_duration_seconds") < 1.0


def test_a_reload_that_narrows_probe_allow_refuses_and_forgets_engines_probed_before(tmp_path):
    config = tmp_path / "exporter.yml"
    config.write_text(yaml.safe_dump({"probe": LOOPBACK_PROBES}))
    with PageServer({"/metrics": page(GOOD_PAGE)}) as server, \
            harness.exporter(tmp_path, "--config", str(config)) as exporter:
        for _ in range(2):  # the second probe finds the engine checked under this configuration
            assert probe(exporter, server.url("/metrics"), engine="vllm")[0] == 200
        assert harness.value(harness.scrape(exporter.url), "kvcache_exporter_probed_targets") == 1.0
        config.write_text(yaml.safe_dump({"probe": {"enabled": True, "allow": ["10.0.0.0/8"]}}))
        request = urllib.request.Request(exporter.url + "/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        status, body = probe_answer(exporter, server.url("/metrics"), engine="vllm")
        assert (status, body) == (403, "target host '127.0.0.1' is not in probe.allow\n")
        assert harness.value(harness.scrape(exporter.url), "kvcache_exporter_probed_targets") == 0.0
        assert server.requests["/metrics"] == 2


def test_a_probe_page_goes_uncompressed_even_when_gzip_is_asked_for(tmp_path):
    from kvcache_exporter.runtime.server import GZIP_MIN_BYTES

    with PageServer({"/metrics": page(GOOD_PAGE)}) as server, exporter_with(tmp_path, probe=LOOPBACK_PROBES) as exporter:
        query = urllib.parse.urlencode({"target": server.url("/metrics"), "engine": "vllm"})
        request = urllib.request.Request(f"{exporter.url}/probe?{query}", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers.get("Content-Encoding") is None
            body = response.read()
        assert len(body) < GZIP_MIN_BYTES
        assert harness.value(harness.samples_of(body.decode()), "kvcache_usage_ratio") == 0.5
