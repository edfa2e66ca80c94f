"""What a Prometheus exporter is expected to have, on a real exporter process: the standard process series
(prometheus_client's collectors, each worker process's labelled), logs that a machine reads line by line
(`--log.format json`), and the Prometheus exporters' flag names beside the old ones."""

from __future__ import annotations

import os
import time

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
