"""Signals and reloads: a clean stop within 2 s, SIGHUP and /-/reload, a bad reload keeps the old config."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import yaml

from devtools import harness
from devtools.harness import scrape, value
from devtools.harness import PageServer, hang_before_headers, page
from devtools.harness import GOOD_PAGE


def test_sigterm_and_sigint_stop_within_two_seconds_even_with_a_poll_hanging(tmp_path):
    with PageServer({"/hang": hang_before_headers()}) as server:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with harness.exporter(tmp_path, "--target", server.url("/hang"), "--poll-interval", "10s") as exporter:
                time.sleep(0.5)  # the first poll is now waiting on the hanging target (timeout 8 s)
                started = time.monotonic()
                exporter.signal(sig)
                exporter.proc.wait(5)
                assert time.monotonic() - started < 2.0
                assert exporter.proc.returncode == 0


def test_reload_keeps_unchanged_targets_and_rejects_a_bad_file(tmp_path):
    with PageServer({"/a": page(GOOD_PAGE), "/b": page(GOOD_PAGE), "/c": page(GOOD_PAGE),
                     "/down": page("oops", status=503)}) as server:
        config = tmp_path / "exporter.yml"

        def write(names: list[str], **extra):
            config.write_text(yaml.safe_dump({"poll_interval": "0.3s", **extra,
                                              "targets": [{"name": n, "url": server.url(f"/{n}")} for n in names]}))

        write(["a", "b", "down"])
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: value(scrape(exporter.url), "kvcache_target_scrape_failures_total",
                                             target="down", reason="http_status") >= 3, 10, what="failures")
            failures_before = value(scrape(exporter.url), "kvcache_target_scrape_failures_total",
                                    target="down", reason="http_status")

            write(["a", "down", "c"], labels={"cluster": "x"})  # b goes, c comes, a and down stay
            exporter.signal(signal.SIGHUP)
            harness.wait_until(lambda: harness.series(scrape(exporter.url), "kvcache_target_up", target="c"), 10,
                               what="reload by SIGHUP")
            samples = scrape(exporter.url)
            assert harness.series(samples, "kvcache_target_up", target="b") == {}
            # the kept target's counter went on from where it was: its state survived the reload
            assert value(samples, "kvcache_target_scrape_failures_total", target="down",
                         reason="http_status") >= failures_before
            assert value(samples, "kvcache_usage_ratio", target="a", cluster="x") == 0.5
            assert value(samples, "kvcache_exporter_config_last_reload_successful") == 1.0

            config.write_text("targets: [{url: 'not a url'}]\n")
            assert harness.http_post(exporter.url + "/-/reload")[0] == 500
            samples = scrape(exporter.url)
            assert value(samples, "kvcache_exporter_config_last_reload_successful") == 0.0
            assert {dict(k[1])["target"] for k in harness.series(samples, "kvcache_target_up")} == {"a", "down", "c"}
            assert "reload failed" in exporter.log_path.read_text()

            write(["a"])
            assert harness.http_post(exporter.url + "/-/reload")[0] == 200
            samples = scrape(exporter.url)
            assert value(samples, "kvcache_exporter_config_last_reload_successful") == 1.0
            assert {dict(k[1])["target"] for k in harness.series(samples, "kvcache_target_up")} == {"a"}
            assert exporter.proc.poll() is None


def test_ready_means_polled_once_and_one_target_up(tmp_path):
    with PageServer({"/a": page(GOOD_PAGE), "/down": page("oops", status=503)}) as server:
        with harness.exporter(tmp_path, "--target", server.url("/down"), "--poll-interval", "0.3s") as exporter:
            # kvcache_target_up shows from the start (0 until a poll succeeds); the duration once a poll ended.
            harness.wait_until(lambda: harness.series(scrape(exporter.url), "kvcache_target_scrape_duration_seconds"),
                               10, what="a poll")
            assert harness.http_get(exporter.url + "/ready") == (
                503, "not ready: the last poll of every target (1) failed\n")
            server.set_route("/down", page(GOOD_PAGE))
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 10, what="ready")
        # one target up, one where nothing listens: ready
        with harness.exporter(tmp_path, "--target", server.url("/a"), "--target", "http://127.0.0.2:1/m") as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready") == (200, "ready\n"), 10, what="ready")


def test_head_answers_like_get_without_a_body(tmp_path):
    with harness.exporter(tmp_path) as exporter:
        for path in ("/metrics", "/healthz", "/ready", "/"):
            with urllib.request.urlopen(exporter.url + path, timeout=5) as response:
                length = len(response.read())
            request = urllib.request.Request(exporter.url + path, method="HEAD")
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 200 and response.read() == b""
                assert abs(int(response.headers["Content-Length"]) - length) <= 4  # timestamps differ in length
                assert "Python" not in response.headers["Server"]


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line_and_exit_2(tmp_path):
    with harness.exporter(tmp_path) as running:
        listen = running.url.removeprefix("http://")
        for argv, key, problem in (
                (["--listen", listen], "command line: --listen", "Address already in use"),
                (["--demo", "--listen", listen], "command line: --listen", "Address already in use"),
                (["--listen", "no-such-host.invalid:10490"], "command line: --listen", "")):
            result = subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True,
                                    timeout=30)
            assert result.returncode == 2, result.stderr
            assert result.stdout == ""  # --demo: no banner before the error
            assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
            address = argv[argv.index("--listen") + 1]
            assert result.stderr.startswith(f"kvcache-exporter: {key}: cannot listen on {address}: {problem}")
