"""A dead, a hanging and a garbage target leave the healthy one fresh and the process alive."""

from __future__ import annotations

import itertools
import time

import yaml

from devtools import harness
from devtools.harness import (GOOD_PAGE, PageServer, alternating, dynamic, endless, gzip_bomb, hang_after_headers,
                              hang_before_headers, page, redirect, reset_connection, scrape, trickle, value, vllm_page)

INTERVAL = 0.5
# target name -> (route, the failure reason it must show)
FAULTS = {
    "hang-after-headers": (hang_after_headers(), "timeout"),
    "hang-before-headers": (hang_before_headers(), "timeout"),
    "trickle": (trickle(GOOD_PAGE, interval=0.05), "timeout"),
    "garbage": (page("<html><body>Bad gateway</body></html>", content_type="text/html"), "parse"),
    "error": (page("oops", status=500), "http_status"),
    "not-an-engine": (page("# TYPE node_load1 gauge\nnode_load1 0.5\n"), "unknown_engine"),
    "not-found": (page("no such page", status=404), "http_status"),
    "reset": (reset_connection(), "connect"),
    "redirect-elsewhere": (redirect("http://127.0.0.2:9/metrics"), "http_status"),
    "small-cap": (page(GOOD_PAGE + "#" * 2000 + "\n"), "too_large"),
    "endless": (endless(), "too_large"),
    "gzip-bomb": (gzip_bomb(64 << 20), "too_large"),
}


def test_faulty_targets_do_not_delay_or_break_the_healthy_one(tmp_path):
    routes = {"/good": page(GOOD_PAGE), "/moved": redirect("/good"),
              **{f"/{name}": route for name, (route, _) in FAULTS.items()}}
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
            assert value(samples, "kvcache_target_up", target="moved") == 1.0  # a redirect on the same host is fine
            assert value(samples, "kvcache_target_up", target="killed") == 0.0
            assert value(samples, "kvcache_target_scrape_failures_total", target="killed", reason="connect") >= 3
            # the killed target's last values vanished after the 2 s staleness period instead of freezing
            assert harness.series(samples, "kvcache_usage_ratio", target="killed") == {}
            assert value(samples, "kvcache_target_info", target="killed") == 1.0
            assert exporter.proc.poll() is None


def test_engines_that_change_under_the_exporter(tmp_path):
    """Flapping, a restart (counters reset), a version upgrade (names change), half the families."""
    polls = {"restart": 0, "upgrade": 0}  # requests each page served

    def restarting() -> str:
        polls["restart"] += 1
        count = polls["restart"]
        return vllm_page(0.5, 1000 if count < 6 else 3)  # the engine restarts at poll 6, 3 preemptions since

    def upgrading() -> str:
        polls["upgrade"] += 1
        return vllm_page(0.25, 7, old_names=polls["upgrade"] < 6)  # new names from poll 6 on

    routes = {"/flapping": alternating(page(vllm_page(0.5, 0)), page("down", status=502)),
              "/restart": dynamic(restarting), "/upgrade": dynamic(upgrading),
              "/half": page(vllm_page(0.75, 2, with_config=False))}
    with PageServer(routes) as server:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": f"{INTERVAL}s", "staleness": "5s",
                                          "targets": [{"name": p.strip("/"), "url": server.url(p)} for p in routes]}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            seen = {"flapping_up": set(), "upgrade_usage": set(), "restart_preemptions": [], "restart_states": set()}
            # At least 16 scrapes, on until every change has happened at least three polls ago (a busy
            # machine polls later, never less often): the assertions below judge what was seen.
            deadline = time.monotonic() + 60
            for scrapes in itertools.count():
                if scrapes >= 16 and (min(polls.values()) >= 9 or time.monotonic() > deadline):
                    break
                samples = scrape(exporter.url)
                seen["flapping_up"].add(value(samples, "kvcache_target_up", target="flapping"))
                seen["upgrade_usage"].add(value(samples, "kvcache_usage_ratio", target="upgrade"))
                seen["restart_preemptions"].append(value(samples, "kvcache_preemptions_total", target="restart"))
                states = harness.series(samples, "kvcache_pressure_state", target="restart")
                seen["restart_states"] |= {dict(k[1])["state"] for k, v in states.items() if v == 1.0}
                time.sleep(INTERVAL / 2)
            assert seen["flapping_up"] == {0.0, 1.0}
            assert value(samples, "kvcache_target_scrape_failures_total", target="flapping", reason="http_status") >= 3
            # the usage series carried on across the rename, same value under either name
            assert seen["upgrade_usage"] == {0.25} and polls["upgrade"] > 6
            # the mirrored counter dropped with the engine's (an ordinary reset for rate())...
            drops = [b for a, b in zip(seen["restart_preemptions"], seen["restart_preemptions"][1:]) if b < a]
            assert drops == [3.0]
            # ...and the restart never read as a preemption burst
            assert "thrashing" not in seen["restart_states"]
            # half the families: what the page holds is there, what needs the missing ones is absent
            assert value(samples, "kvcache_usage_ratio", target="half") == 0.75
            assert value(samples, "kvcache_target_up", target="half") == 1.0
            for name in ("kvcache_capacity_blocks", "kvcache_free_blocks", "kvcache_free_tokens"):
                assert harness.series(samples, name, target="half") == {}
            assert exporter.proc.poll() is None
