"""An exporter with worker processes (`workers:`, exporter/runtime/workers.py): every target polled by
one of them, a worker that ends started again and counted, one that hangs left out (never shown stale),
reloads reaching them, and no worker outliving the exporter. test_exporter_fixtures.py checks the
values of every fixture page read by two workers."""

from __future__ import annotations

import os
import signal

import pytest
import yaml

from devtools import harness
from devtools.harness import PageServer, page

TARGETS = 8


def usage(i: int) -> float:
    """Target i's page says this usage: which value belongs to which target is known."""
    return round(0.05 + i / 10, 2)


@pytest.fixture
def engines():
    with PageServer({f"/t/{i}": page(harness.vllm_page(usage(i), preemptions=i)) for i in range(TARGETS + 2)}) as server:
        yield server


def write_config(path, server, indices, workers: int = 2) -> None:
    path.write_text(yaml.safe_dump({"poll_interval": "1s", "workers": workers,
                                    "targets": [{"name": f"t-{i}", "url": server.url(f"/t/{i}")} for i in indices]}))


def usages(exporter) -> dict[str, float]:
    return {dict(labels)["target"]: value
            for (_, labels), value in harness.series(harness.scrape(exporter.url), "kvcache_usage_ratio").items()}


def expected(indices) -> dict[str, float]:
    return {f"t-{i}": usage(i) for i in indices}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_that_ends_is_started_again_and_counted(tmp_path, engines):
    config = tmp_path / "exporter.yml"
    write_config(config, engines, range(TARGETS))
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target read")
        assert harness.http_get(exporter.url + "/ready")[0] == 200
        workers = harness.children(exporter.proc.pid)
        assert len(workers) == 2
        samples = harness.scrape(exporter.url)
        assert harness.value(samples, "kvcache_exporter_workers") == 2.0
        assert harness.value(samples, "kvcache_exporter_worker_restarts_total") == 0.0
        os.kill(workers[0], signal.SIGKILL)
        harness.wait_until(lambda: harness.value(harness.scrape(exporter.url),
                                                 "kvcache_exporter_worker_restarts_total") == 1.0, 20,
                           what="the restart counted")
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target back")
        replaced = harness.children(exporter.proc.pid)
        assert len(replaced) == 2 and workers[0] not in replaced and workers[1] in replaced


def test_a_hanging_worker_is_left_out_and_counted_never_shown_stale(tmp_path, engines):
    config = tmp_path / "exporter.yml"
    write_config(config, engines, range(TARGETS))  # staleness: 3 x 1 s
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target read")
        stopped, running = harness.children(exporter.proc.pid)
        os.kill(stopped, signal.SIGSTOP)
        shown = usages(exporter)  # answered after the poll timeout (0.8 s) without the stopped worker's share
        assert 0 < len(shown) < TARGETS and shown == {k: v for k, v in expected(range(TARGETS)).items() if k in shown}
        samples = harness.scrape(exporter.url)
        assert harness.value(samples, "kvcache_exporter_worker_missed_replies_total") >= 1.0
        assert harness.value(samples, "kvcache_exporter_worker_restarts_total") == 0.0
        assert harness.http_get(exporter.url + "/ready") == (503, "not ready: a worker process did not answer\n")
        # Silent for the staleness period, it is killed and started again; its targets come back.
        harness.wait_until(lambda: harness.value(harness.scrape(exporter.url),
                                                 "kvcache_exporter_worker_restarts_total") == 1.0, 20,
                           what="the hanging worker replaced")
        assert not alive(stopped)
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target back")
        assert running in harness.children(exporter.proc.pid)
        assert "answered nothing for" in exporter.log_path.read_text()


def test_a_reload_reaches_the_workers(tmp_path, engines):
    config = tmp_path / "exporter.yml"
    write_config(config, engines, range(4))
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        harness.wait_until(lambda: usages(exporter) == expected(range(4)), 20, what="four targets read")
        workers = harness.children(exporter.proc.pid)
        write_config(config, engines, range(2, TARGETS + 2), workers=3)  # the workers change only at restart
        exporter.signal(signal.SIGHUP)
        harness.wait_until(lambda: usages(exporter) == expected(range(2, TARGETS + 2)), 20,
                           what="the reloaded targets, and only them")
        samples = harness.scrape(exporter.url)
        assert harness.value(samples, "kvcache_exporter_config_last_reload_successful") == 1.0
        assert harness.value(samples, "kvcache_exporter_workers") == 2.0
        assert sorted(harness.children(exporter.proc.pid)) == sorted(workers)
        assert "workers changes only at restart; still 2" in exporter.log_path.read_text()


def test_signals_meant_for_the_exporter_leave_its_workers_alone(tmp_path, engines):
    """`pkill -HUP -f kvcache_exporter` (a reload) and a stop sent to the whole process group reach the
    workers too: only the parent acts on them."""
    config = tmp_path / "exporter.yml"
    write_config(config, engines, range(TARGETS))
    with harness.exporter(tmp_path, "--config", str(config)) as exporter:
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target read")
        workers = harness.children(exporter.proc.pid)
        for worker in workers:
            os.kill(worker, signal.SIGHUP)
            os.kill(worker, signal.SIGTERM)
            os.kill(worker, signal.SIGINT)
        exporter.signal(signal.SIGHUP)
        harness.wait_until(lambda: "configuration reloaded" in exporter.log_path.read_text(), 10, what="the reload")
        harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 10, what="every target still read")
        assert sorted(harness.children(exporter.proc.pid)) == sorted(workers)
        assert harness.value(harness.scrape(exporter.url), "kvcache_exporter_worker_restarts_total") == 0.0


def test_no_worker_outlives_the_exporter(tmp_path, engines):
    config = tmp_path / "exporter.yml"
    write_config(config, engines, range(TARGETS))
    for sig in (signal.SIGTERM, signal.SIGKILL):  # a stop, and a parent gone without a word
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            harness.wait_until(lambda: usages(exporter) == expected(range(TARGETS)), 20, what="every target read")
            workers = harness.children(exporter.proc.pid)
            assert len(workers) == 2
            exporter.signal(sig)
            exporter.proc.wait(10)
            assert exporter.proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            harness.wait_until(lambda: not any(map(alive, workers)), 10, what=f"the workers gone after {sig.name}")
