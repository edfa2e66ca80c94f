"""Phase-locked polling against a real Prometheus: the data a scrape reads is fresher when the exporter
times its polls for the scrapes, and the polls stay one per interval.

Two exporters poll five pages each every second (as one process, and with two worker processes whose
clocks count the scrapes their parent serves). Prometheus scrapes exporter `locked` every second
(a whole multiple of its poll interval: it locks) and exporter `free` every 1.3 s (no whole multiple:
own cadence, the control; 1.3 s walks the scrape over every phase of the poll interval in 13 s). The
age of the data at each scrape is the scrape's own timestamp minus the value it read of
kvcache_target_last_success_timestamp_seconds: what a query of that scrape sees.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import yaml

from devtools import harness
from devtools.harness import GOOD_PAGE, PageServer, page

TARGETS = 5
WINDOW_S = 15.0


def recording(arrivals: list[float]):
    """GOOD_PAGE, noting when each poll arrived."""
    serve = page(GOOD_PAGE)
    lock = threading.Lock()

    def route(handler) -> None:
        with lock:
            arrivals.append(time.time())
        serve(handler)

    return route


def exporter_config(tmp_path, server: PageServer, name: str, workers: int) -> str:
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump({"poll_interval": "1s", "timeout": "0.8s", "workers": workers, "targets": [
        {"name": f"{name}-{i}", "url": server.url(f"/{name}/{i}")} for i in range(TARGETS)]}))
    return str(path)


def self_metric(prometheus: str, name: str, job: str) -> float | None:
    vector = harness.prom_vector(prometheus, f'{name}{{job="{job}"}}')
    return vector[0][1] if vector else None


def ages_at_scrape(prometheus: str, job: str, seconds: float) -> list[float]:
    """Each scrape's timestamp minus the poll completion it read, of every target, over the last `seconds`."""
    data = harness.prom_query(prometheus, f'kvcache_target_last_success_timestamp_seconds{{job="{job}"}}'
                                          f'[{int(seconds * 1000)}ms]')
    return [float(at) - float(value) for series in data["result"] for at, value in series["values"]]


@pytest.mark.parametrize("workers", [1, 2])
def test_phase_locked_polls_give_scrapes_fresher_data_at_the_same_cadence(tmp_path, workers):
    arrivals = {name: {i: [] for i in range(TARGETS)} for name in ("locked", "free")}
    routes = {f"/{name}/{i}": recording(arrivals[name][i]) for name in arrivals for i in range(TARGETS)}
    for name in arrivals:
        (tmp_path / name).mkdir()
    with PageServer(routes) as server, \
            harness.exporter(tmp_path / "locked", "--config", exporter_config(tmp_path, server, "locked", workers)) as locked, \
            harness.exporter(tmp_path / "free", "--config", exporter_config(tmp_path, server, "free", workers)) as free:
        with harness.prometheus(tmp_path / "prometheus", {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "locked", "static_configs": [{"targets": [locked.url.removeprefix("http://")]}]},
                {"job_name": "free", "scrape_interval": "1300ms",
                 "static_configs": [{"targets": [free.url.removeprefix("http://")]}]},
            ],
        }) as prometheus:
            url = prometheus.url
            # Eight regular scrapes to lock, then one more interval for every target's poll to move.
            harness.wait_until(lambda: self_metric(url, "kvcache_exporter_poll_phase_locked", "locked") == 1.0,
                               60, interval=0.5, what="the exporter locked to Prometheus' scrapes")
            time.sleep(2.0)
            window_start = time.time()
            time.sleep(WINDOW_S)
            locked_ages = ages_at_scrape(url, "locked", WINDOW_S)
            free_ages = ages_at_scrape(url, "free", WINDOW_S)
            assert self_metric(url, "kvcache_exporter_poll_phase_locked", "locked") == 1.0
            assert abs(self_metric(url, "kvcache_exporter_scrape_interval_seconds", "locked") - 1.0) < 0.05
            assert self_metric(url, "kvcache_exporter_poll_phase_locked", "free") == 0.0
            assert abs(self_metric(url, "kvcache_exporter_scrape_interval_seconds", "free") - 1.3) < 0.05
    assert len(locked_ages) >= TARGETS * (WINDOW_S - 2) and len(free_ages) >= TARGETS * (WINDOW_S / 1.3 - 2)
    # Locked: the margin (0.1 s + 2 % of the interval: 0.12 s), give or take how far a poll's duration
    # falls below the p90 of its recent ones and 20 ms of batching; 0.08 s of room for a busy machine.
    # Own cadence: spread over the whole interval, half of it on average.
    assert statistics.median(locked_ages) < 0.2, sorted(locked_ages)
    assert statistics.mean(locked_ages) < 0.25, sorted(locked_ages)
    assert statistics.mean(free_ages) > 0.3, sorted(free_ages)
    assert statistics.mean(locked_ages) < statistics.mean(free_ages) / 1.5
    # The same cadence: one poll per target and interval in the window, give or take the one at its edge.
    for name in arrivals:
        for i, times in arrivals[name].items():
            polls = sum(1 for t in times if window_start <= t < window_start + WINDOW_S)
            assert WINDOW_S - 2 <= polls <= WINDOW_S + 1, (name, i, polls)
