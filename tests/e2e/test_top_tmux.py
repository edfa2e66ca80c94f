"""`kvcache-exporter top` used as a person would: in a real terminal (tmux), against an exporter
polling simulated engines in the kv-saturation and concurrency-cap scenarios; keys sent with
send-keys, the screen read back with capture-pane. Then polling engine pages directly whose counters
grow at rates set here, to read on the screen the preemption rate that makes a pool thrashing and one
hit ratio for vLLM and SGLang.

Timeline at SPEED 10 with seed 3 (simulator/scenarios.py): the cap binds from ~65 simulated seconds
(6.5 s here); the saturation engine's pool fills and requests queue for KV from ~110 s, and its
preemptions make it thrashing from ~165 s. The screen is read every 0.1 s until it shows the
saturated pool on top while the capped pool is marked capped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvcache_exporter.simulator.server import start_engine
from devtools import harness
from devtools.harness import PageServer, dynamic

SPEED = 10.0
TARGETS = {"sat-pool": ("vllm-v1", "kv-saturation"), "cap-pool": ("vllm-v1", "concurrency-cap")}
SEEN_WITHIN = 40.0  # wall seconds: saturated from ~11 s, thrashing from ~16 s at this speed
CLOCK = re.compile(r"\d\d:\d\d:\d\d")


class Terminal:
    """A tmux server of its own (-L) running one command in an 80x24 window."""

    def __init__(self, command: str, log_dir):
        self.tmux = harness.require_binary("tmux")
        self.socket = f"kvcache-top-test-{os.getpid()}"
        self.errors = log_dir / "top.stderr"
        self._run("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", f"{command} 2>{self.errors}")
        self.socket_path = self._run("display-message", "-p", "#{socket_path}").strip()

    def _run(self, *args: str) -> str:
        return subprocess.run([self.tmux, "-L", self.socket, *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "top", *keys)

    def screen(self) -> list[str]:
        return self._run("capture-pane", "-p", "-t", "top").splitlines()

    def resize(self, width: int, height: int) -> None:
        self._run("resize-window", "-t", "top", "-x", str(width), "-y", str(height))

    def alive(self) -> bool:
        return subprocess.run([self.tmux, "-L", self.socket, "has-session", "-t", "top"],
                              capture_output=True, timeout=10).returncode == 0

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=10)
        Path(self.socket_path).unlink(missing_ok=True)  # tmux leaves its socket file behind


def table(screen: list[str]) -> tuple[str, list[list[str]]]:
    """The table's second header line and its rows (split on blanks), from a screen capture."""
    start = next(i for i, line in enumerate(screen) if line.startswith("TARGET"))
    rows = []
    for line in screen[start + 1:]:
        if line.startswith("q quit") or line.startswith("filter:") or not line.strip():
            break
        rows.append(line.split())
    return screen[start], rows


def wait_for_screen(terminal: Terminal, predicate, timeout: float, what: str) -> list[str]:
    deadline, screen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        screen = terminal.screen()
        try:
            if predicate(screen):
                return screen
        except StopIteration:  # no table on the screen yet
            pass
        assert terminal.alive(), terminal.errors.read_text()
        time.sleep(0.1)
    raise AssertionError(f"the screen never showed {what}; last screen:\n" + "\n".join(screen)
                         + f"\nstderr: {terminal.errors.read_text()}")


@pytest.fixture
def terminal(tmp_path):
    engines = {name: start_engine(flavor, scenario, speed=SPEED, seed=3)
               for name, (flavor, scenario) in TARGETS.items()}
    try:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "0.25s", "targets": [
            {"name": name, "url": engine.url} for name, engine in engines.items()]}))
        with harness.exporter(tmp_path, "--config", str(config)) as exporter:
            command = (f"cd {harness.REPO} && PYTHONPATH={harness.REPO} {sys.executable} -m kvcache_exporter top "
                       f"--exporter {exporter.url} --interval 0.25s")
            terminal = Terminal(command, tmp_path)
            try:
                yield terminal
            finally:
                terminal.close()
    finally:
        for engine in engines.values():
            engine.stop()


def saturated_on_top_and_capped_marked(screen: list[str]) -> bool:
    _, rows = table(screen)
    states = {row[0]: row[1] for row in rows}
    return bool(rows) and rows[0][:2] == ["sat-pool", "saturated"] and states.get("cap-pool") == "capped"


def test_the_screen_shows_the_saturated_pool_on_top_and_answers_keys(terminal):
    screen = wait_for_screen(terminal, saturated_on_top_and_capped_marked, SEEN_WITHIN,
                             "the saturated pool on top and the capped pool marked capped")
    # 80 columns: the columns that do not fit are dropped, not wrapped (one line per pool, two pools).
    header, rows = table(screen)
    assert len(rows) == 2 and all(len(line) <= 80 for line in screen), screen
    assert header.split() == ["TARGET", "STATE", "KV", "USED", "TOKENS", "ROOM", "RUN", "KV", "ROOM", "/min", "1m",
                              "1m", "p90", "1m"], header
    assert "MODEL" not in header and "MISSES" not in "\n".join(screen)  # no capacity-miss series on this exporter
    assert screen[3].split()[:8] == ["thrashing", "0", "saturated", "1", "capped", "1", "tight", "0"], screen[3]
    # Within the first minute the figures cover part of the state's window (60 s), and the summary says so.
    assert re.search(r"  window \d+s of 1m$", screen[3]), screen[3]

    terminal.keys("s")  # state -> usage: the full pool still first, the capped one (usage < 0.3) second
    screen = wait_for_screen(terminal, lambda s: any("sort: usage" in line for line in s), 5,
                             "the sort column usage")
    assert [row[0] for row in table(screen)[1]] == ["sat-pool", "cap-pool"]

    terminal.keys("/", "c", "a", "p", "-", "Enter")
    screen = wait_for_screen(terminal, lambda s: [r[0] for r in table(s)[1]] == ["cap-pool"], 5,
                             "only the capped pool after /cap-")
    assert any("filter: cap-" in line for line in screen)

    terminal.keys("Escape")  # clears the filter
    wait_for_screen(terminal, lambda s: len(table(s)[1]) == 2, 5, "both pools after Esc")

    terminal.keys("p")
    paused = wait_for_screen(terminal, lambda s: "PAUSED" in s[0], 5, "PAUSED")
    time.sleep(1.5)  # four reads at --interval 0.25s: none of them reaches a paused screen
    assert CLOCK.search(terminal.screen()[0]).group() == CLOCK.search(paused[0]).group()
    terminal.keys("p")
    wait_for_screen(terminal, lambda s: "PAUSED" not in s[0], 5, "the screen running again")

    terminal.resize(140, 30)  # wide: the model column comes back, and nothing is cut
    screen = wait_for_screen(terminal, lambda s: "MODEL" in table(s)[0], 5, "the MODEL column at 140 columns")
    assert {row[0] for row in table(screen)[1]} == {"sat-pool", "cap-pool"}
    terminal.resize(50, 12)  # narrow: still a table with a state per pool
    screen = wait_for_screen(terminal, lambda s: "KV" in table(s)[0] and "TOKENS" not in table(s)[0], 5,
                             "the 50-column layout")
    assert all(len(line) <= 50 for line in screen)
    assert {row[1] for row in table(screen)[1]} <= {"saturated", "thrashing", "capped", "tight", "ok"}

    terminal.keys("q")
    harness.wait_until(lambda: not terminal.alive(), 5, what="top to quit on q")
    assert terminal.errors.read_text() == ""


# Pages whose counters grow linearly with time since the server started: per second, the churning vLLM pool
# preempts 2 requests (120/min), the calm one 0.01 (0.6/min, under the thrashing threshold of 0.02/s), and of
# 1000 prompt tokens looked up 300 come from the GPU pool and, on the churning vLLM pool, 200 more from its KV
# connector (counted by vLLM as external hits); the SGLang pool's 300 + 200 come from its device and host
# cache sources. Over any window: 120.0 and 0.6 preemptions/min, hit ratios 0.50, 0.30 and 0.50.
WINDOW = 4.0  # pressure: window_seconds, the state's window and so top's
CHURNING, CALM = 2.0, 0.01


def vllm_page(elapsed: float, preemptions_per_second: float, external: bool) -> str:
    labels = '{engine="0",model_name="m"}'
    lines = [f"vllm:kv_cache_usage_perc{labels} 0.5", f"vllm:num_requests_running{labels} 4",
             f"vllm:num_requests_waiting{labels} 0",
             f"vllm:num_preemptions_total{labels} {preemptions_per_second * elapsed}",
             f"vllm:prefix_cache_queries_total{labels} {1000 * elapsed}",
             f"vllm:prefix_cache_hits_total{labels} {300 * elapsed}",
             'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1']
    if external:
        lines += [f"vllm:external_prefix_cache_queries_total{labels} {700 * elapsed}",
                  f"vllm:external_prefix_cache_hits_total{labels} {200 * elapsed}"]
    return "\n".join(lines) + "\n"


def sglang_page(elapsed: float) -> str:
    labels = 'engine_type="unified",model_name="m"'
    return "\n".join([
        f"sglang:token_usage{{{labels}}} 0.5", f"sglang:max_total_num_tokens{{{labels}}} 16384",
        f"sglang:num_running_reqs{{{labels}}} 4", f"sglang:num_queue_reqs{{{labels}}} 0",
        f"sglang:prompt_tokens_total{{{labels}}} {1000 * elapsed}",
        f'sglang:cached_tokens_total{{cache_source="device",{labels}}} {300 * elapsed}',
        f'sglang:cached_tokens_total{{cache_source="host",{labels}}} {200 * elapsed}']) + "\n"


@pytest.fixture
def direct_terminal(tmp_path):
    start = time.time()
    routes = {"/churning": dynamic(lambda: vllm_page(time.time() - start, CHURNING, external=True)),
              "/calm": dynamic(lambda: vllm_page(time.time() - start, CALM, external=False)),
              "/sglang": dynamic(lambda: sglang_page(time.time() - start))}
    with PageServer(routes) as server:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"pressure": {"window_seconds": WINDOW}, "targets": [
            {"name": name, "url": server.url(path), "engine": "sglang" if name == "sglang" else "vllm"}
            for name, path in (("churning", "/churning"), ("calm", "/calm"), ("sglang", "/sglang"))]}))
        command = (f"cd {harness.REPO} && PYTHONPATH={harness.REPO} {sys.executable} -m kvcache_exporter top "
                   f"--config {config} --interval 0.25s")
        terminal = Terminal(command, tmp_path)
        try:
            yield terminal
        finally:
            terminal.close()


def test_a_thrashing_row_shows_the_rate_over_the_states_window_and_hit_means_one_thing(direct_terminal):
    # The first reads cover less than the window, and the summary says how much.
    wait_for_screen(direct_terminal, lambda s: re.search(r"window \d+s of 4s$", s[3]), 10,
                    "the part of the window the reads cover so far")
    screen = wait_for_screen(direct_terminal, lambda s: s[3].endswith("window 4s") and len(table(s)[1]) == 3, 20,
                             "the whole window covered")
    header, rows = table(screen)
    assert header.split()[-5:] == ["/min", "4s", "4s", "p90", "4s"], header  # the columns name the window
    by_target = {row[0]: row for row in rows}
    # PREEMPT, HIT and TTFT are the last three columns (no TTFT histogram on these pages: "-").
    churning, calm, sglang = by_target["churning"], by_target["calm"], by_target["sglang"]
    assert churning[1] == "thrashing" and calm[1] == "ok" and sglang[1] == "ok", screen
    # 120/min; the page's clock and the poll's timestamp differ by the time a poll takes, a few ms of 4 s.
    assert abs(float(churning[-3]) - CHURNING * 60) <= 2, screen
    assert calm[-3] == f"{CALM * 60:.1f}", screen
    assert (churning[-2], calm[-2], sglang[-2]) == ("0.50", "0.30", "0.50"), screen
    assert screen[3].split()[:2] == ["thrashing", "1"], screen[3]
    direct_terminal.keys("q")
    harness.wait_until(lambda: not direct_terminal.alive(), 5, what="top to quit on q")
    assert direct_terminal.errors.read_text() == ""
