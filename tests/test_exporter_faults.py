"""A dead, a hanging and a garbage target leave the healthy one fresh and the process alive."""

from __future__ import annotations

import time

import yaml

from tests import harness
from tests.harness import scrape, value
from tests.pageserver import PageServer, hang_after_headers, hang_before_headers, page, trickle

GOOD_PAGE = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0
"""
INTERVAL = 0.5
# target name -> (route, the failure reason it must show)
FAULTS = {
    "hang-after-headers": (hang_after_headers(), "timeout"),
    "hang-before-headers": (hang_before_headers(), "timeout"),
    "trickle": (trickle(GOOD_PAGE, interval=0.05), "timeout"),
    "garbage": (page("<html><body>Bad gateway</body></html>", content_type="text/html"), "parse"),
    "error": (page("oops", status=500), "http_status"),
    "not-an-engine": (page("# TYPE node_load1 gauge\nnode_load1 0.5\n"), "unknown_engine"),
    "small-cap": (page(GOOD_PAGE + "#" * 2000 + "\n"), "too_large"),
}


def test_faulty_targets_do_not_delay_or_break_the_healthy_one(tmp_path):
    routes = {"/good": page(GOOD_PAGE), **{f"/{name}": route for name, (route, _) in FAULTS.items()}}
    with PageServer(routes) as server, PageServer({"/metrics": page(GOOD_PAGE)}) as doomed:
        targets = [{"name": path.strip("/"), "url": server.url(path)} for path in routes]
        targets.append({"name": "killed", "url": doomed.url("/metrics")})
        config = tmp_path / "exporter.yml"
        # 2000 bytes: the good page fits, the padded one does not
        config.write_text(yaml.safe_dump({"poll_interval": f"{INTERVAL}s", "max_response_bytes": 2000,
                                          "staleness": "2s", "targets": targets}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 10, what="ready")
            assert value(scrape(exporter.url), "kvcache_target_up", target="killed") == 1.0
            doomed.stop()
            time.sleep(8 * INTERVAL)
            stamps = []
            for _ in range(4):
                samples = scrape(exporter.url)
                stamps.append(value(samples, "kvcache_target_last_success_timestamp_seconds", target="good"))
                # the healthy target's data is never older than a poll interval plus its own poll time
                assert time.time() - stamps[-1] < 2 * INTERVAL
                assert value(samples, "kvcache_target_up", target="good") == 1.0
                assert value(samples, "kvcache_usage_ratio", target="good") == 0.5
                time.sleep(INTERVAL)
            assert stamps == sorted(stamps) and len(set(stamps)) >= 3, "the healthy target stopped being polled"

            for name, (_, reason) in FAULTS.items():
                assert value(samples, "kvcache_target_up", target=name) == 0.0, name
                assert value(samples, "kvcache_target_scrape_failures_total", target=name, reason=reason) >= 1, name
            assert value(samples, "kvcache_target_up", target="killed") == 0.0
            assert value(samples, "kvcache_target_scrape_failures_total", target="killed", reason="connect") >= 3
            # the killed target's last values vanished after the 2 s staleness period instead of freezing
            assert harness.series(samples, "kvcache_usage_ratio", target="killed") == {}
            assert value(samples, "kvcache_target_info", target="killed") == 1.0
            assert exporter.proc.poll() is None
