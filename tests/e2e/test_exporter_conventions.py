"""What a Prometheus exporter is expected to have, on a real exporter process: the standard process series
(prometheus_client's collectors, each worker process's labelled), logs that a machine reads line by line
(`--log.format json`), and the Prometheus exporters' flag names beside the old ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest
import yaml

from devtools import harness
from devtools.harness import PageServer, page


def rss_bytes(pid: int) -> int:
    """The kernel's word on a process's resident memory."""
    with open(f"/proc/{pid}/status") as handle:
        (line,) = [line for line in handle if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


def worker_index(pid: int) -> str:
    """A worker process's index, from its command line (`-m kvcache_exporter.runtime.worker INDEX COUNT`)."""
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().split(b"\0")[-3].decode()


def process_samples(samples: dict, worker: str | None) -> dict[str, float]:
    """The process_* samples of the serving process (worker None) or of one worker process."""
    return {name: value for (name, labels), value in samples.items()
            if name.startswith("process_") and dict(labels).get("worker") == worker}


def check_process(found: dict[str, float], pid: int, started_after: float, ready_by: float) -> None:
    # The kernel's boot time is whole seconds, the process's start in clock ticks after it.
    assert started_after - 1.0 <= found["process_start_time_seconds"] <= ready_by + 1.0
    assert 0.5 <= found["process_resident_memory_bytes"] / rss_bytes(pid) <= 2.0
    assert found["process_virtual_memory_bytes"] >= found["process_resident_memory_bytes"]
    assert 0 < found["process_cpu_seconds_total"] <= (time.time() - started_after) * os.cpu_count()
    assert 0 < found["process_open_fds"] < found["process_max_fds"]


def test_the_process_series_describe_the_serving_process_and_each_worker(tmp_path):
    with PageServer({f"/t/{i}": page(harness.vllm_page(0.5, preemptions=0)) for i in range(4)}) as server:
        for workers in (1, 2):
            config = tmp_path / f"exporter-{workers}.yml"
            config.write_text(yaml.safe_dump({"poll_interval": "1s", "workers": workers, "targets": [
                {"name": f"t-{i}", "url": server.url(f"/t/{i}")} for i in range(4)]}))
            started_after = time.time()
            with harness.exporter(tmp_path, "--config", str(config)) as exporter:
                harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 20, what="ready")
                ready_by = time.time()
                samples = harness.scrape(exporter.url)
                check_process(process_samples(samples, None), exporter.proc.pid, started_after, ready_by)
                (python,) = harness.series(samples, "python_info")
                assert dict(python[1])["implementation"] == "CPython" and samples[python] == 1.0
                pids = harness.children(exporter.proc.pid)
                assert len(pids) == (workers if workers > 1 else 0)
                labelled = {dict(labels)["worker"] for (name, labels) in samples
                            if name.startswith("process_") and "worker" in dict(labels)}
                assert labelled == {str(i) for i in range(len(pids))}
                for pid in pids:
                    check_process(process_samples(samples, worker_index(pid)), pid, started_after, ready_by)


LOG_KEYS = {"time", "level", "logger", "message"}


def records(text: str, parse) -> list[dict]:
    """Every line of the exporter's output as a record with the four keys and a UTC time in RFC 3339."""
    found = []
    for line in text.splitlines():
        record = parse(line)
        assert LOG_KEYS <= set(record), line
        assert datetime.strptime(record["time"], "%Y-%m-%dT%H:%M:%S.%fZ"), line
        found.append(record)
    return found


def test_logs_in_either_format_parse_line_by_line_including_a_failing_targets_warning(tmp_path):
    with PageServer({"/good": page(harness.vllm_page(0.5, preemptions=0)), "/bad": page("oops", status=500)}) as server:
        cases = (  # (flags, environment, parser, workers)
            (["--log.format", "json"], {}, json.loads, 1),
            ([], {"KVCACHE_EXPORTER_LOG_FORMAT": "json"}, json.loads, 2),
            ([], {}, harness.logfmt, 1),  # the default
        )
        bad = server.url("/bad").removeprefix("http://")
        for index, (argv, env, parse, workers) in enumerate(cases):
            run_dir = tmp_path / str(index)
            run_dir.mkdir()
            with harness.exporter(run_dir, *argv, "--target", server.url("/good"), "--target", server.url("/bad"),
                                  "--poll.interval", "0.5s", "--workers", str(workers), env=env) as exporter:
                harness.wait_until(lambda: harness.value(harness.scrape(exporter.url),
                                                         "kvcache_target_scrape_failures_total",
                                                         target=bad,
                                                         reason="http_status") >= 2, 20, what="two failed polls")
                exporter.stop()
            logged = records(exporter.log_path.read_text(), parse)
            assert {record["level"] for record in logged} <= {"info", "warning"}
            failed = [record for record in logged if record["level"] == "warning"
                      and record["message"].startswith(f"target {bad}: poll failed (http_status)")]
            assert failed and {record["logger"] for record in failed} == {"kvcache_exporter.runtime.target"}
            # With workers the failing target is a worker's, and its records say which.
            assert {record.get("worker") for record in failed} <= ({None} if workers == 1 else {"0", "1"})
            assert any(record["message"].startswith("kvcache-exporter listening on") for record in logged)


def test_the_prometheus_flag_names_and_the_earlier_ones_run_the_same_exporter(tmp_path):
    with PageServer({"/good": page(harness.vllm_page(0.25, preemptions=0))}) as server:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"targets": [{"name": "good", "url": server.url("/good")}]}))
        for spelling in (("--config.file", "--poll.interval", "--log.level"),
                         ("--config", "--poll-interval", "--log-level")):
            with harness.exporter(tmp_path, *(value for pair in zip(spelling, (str(config), "0.5s", "debug"))
                                              for value in pair)) as exporter:
                harness.wait_until(lambda: harness.series(harness.scrape(exporter.url), "kvcache_usage_ratio"), 20,
                                   what="the target read")
                assert harness.value(harness.scrape(exporter.url), "kvcache_usage_ratio", target="good") == 0.25
                exporter.stop()
            assert "every 0.5s" in exporter.log_path.read_text() and "level=debug" in exporter.log_path.read_text()
    # --web.listen-address, as harness.exporter's --listen gives it
    port = harness.free_port()
    argv = [sys.executable, "-m", "kvcache_exporter", "--web.listen-address", f"127.0.0.1:{port}"]
    with harness.Process("exporter", argv, tmp_path, f"http://127.0.0.1:{port}/healthz").wait_ready():
        assert harness.http_get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")


@pytest.mark.parametrize("argv, env, named", [
    (["--poll.interval", "5ms"], {}, "command line: --poll.interval: must be at least 100ms"),
    (["--poll-interval", "5ms"], {}, "command line: --poll-interval: must be at least 100ms"),
    (["--demo", "--poll.interval", "5ms"], {}, "command line: --poll.interval: must be at least 100ms"),
    (["--web.listen-address", "10490"], {}, "command line: --web.listen-address: expected HOST:PORT"),
    (["--listen", "10490"], {}, "command line: --listen: expected HOST:PORT"),
    (["--log.level", "loud"], {}, "command line: --log.level: must be debug, info, warning or error, got 'loud'"),
    (["--log-level", "loud"], {}, "command line: --log-level: must be debug, info, warning or error, got 'loud'"),
    (["--demo", "--log-level", "loud"], {}, "command line: --log-level: must be debug, info, warning or error"),
    (["--log.format", "xml"], {}, "command line: --log.format: must be logfmt or json, got 'xml'"),
    ([], {"KVCACHE_EXPORTER_LOG_FORMAT": "xml"}, "environment: KVCACHE_EXPORTER_LOG_FORMAT: must be logfmt or json"),
    (["--config.file", "{tmp}/none.yml"], {}, "{tmp}/none.yml: (file): No such file or directory"),
])
def test_an_error_names_the_flag_as_it_was_typed(tmp_path, argv, env, named):
    argv = [a.format(tmp=tmp_path) for a in argv]
    result = subprocess.run([sys.executable, "-m", "kvcache_exporter", "--target", "http://127.0.0.1:1/m", *argv],
                            capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", **env})
    assert (result.returncode, result.stdout, result.stderr.count("\n")) == (2, "", 1), result.stderr
    assert result.stderr.startswith("kvcache-exporter: " + named.format(tmp=tmp_path)), result.stderr


def test_the_page_publishes_the_thresholds_its_states_are_derived_with_and_top_quotes_them(tmp_path):
    def published(samples: dict) -> dict[str, float]:
        return {dict(labels)["name"]: value
                for (name, labels), value in samples.items() if name == "kvcache_exporter_pressure_threshold"}

    with PageServer({"/t": page(harness.vllm_page(0.5, preemptions=0))}) as server:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "1s", "targets": [{"name": "t", "url": server.url("/t")}],
                                          "pressure": {"window_seconds": 120, "low_water_ratio": 0.6}}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: harness.http_get(exporter.url + "/ready")[0] == 200, 20, what="ready")
            # The configured two, and the defaults of the others (exporter/thresholds.py: 0.90 and 0.02/s).
            assert published(harness.scrape(exporter.url)) == {
                "window_seconds": 120.0, "low_water_ratio": 0.6, "high_water_ratio": 0.9,
                "thrashing_preemptions_per_second": 0.02}
            top = subprocess.run([sys.executable, "-m", "kvcache_exporter", "top", "--exporter", exporter.url,
                                  "--interval", "0.2s", "--once"], capture_output=True, text=True, timeout=60)
            assert top.returncode == 0 and "of 2m" in top.stdout and "/min 2m" in top.stdout, top.stdout + top.stderr
            # A reload publishes the new ones.
            config.write_text(yaml.safe_dump({"poll_interval": "1s", "pressure": {"window_seconds": 30},
                                              "targets": [{"name": "t", "url": server.url("/t")}]}))
            assert harness.http_post(exporter.url + "/-/reload")[0] == 200
            assert published(harness.scrape(exporter.url))["window_seconds"] == 30.0
