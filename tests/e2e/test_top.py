"""`kvcache-exporter top` without a terminal: `--once` and `--json` against a recorded exporter page
read twice (tests/fixtures/top/README.md works out every figure by hand), a direct poll of engine
fixture pages and bad input. tests/unit/test_top.py checks the arithmetic behind the per-minute figures
and the layout."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from devtools import harness
from devtools.harness import PageServer, alternating, page

FIXTURES = harness.FIXTURES
PAGES = [(FIXTURES / "top" / f"exporter-{n}.txt").read_text() for n in (1, 2)]


def top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_exporter", "top", *args], capture_output=True, text=True,
                          cwd=harness.REPO, timeout=60)


def top_on_recorded_pages(*args: str) -> subprocess.CompletedProcess:
    with PageServer({"/metrics": alternating(page(PAGES[0]), page(PAGES[1]))}) as server:
        result = top("--exporter", server.url(""), "--interval", "0.1s", *args)
        assert server.requests["/metrics"] == 2
    return result


def test_once_prints_the_worst_pool_first_with_the_per_minute_figures():
    result = top_on_recorded_pages("--once")
    assert result.returncode == 0, result.stderr
    assert result.stdout == """\
pools 3  targets up 3/4  KV 36% used, 41.8k of 65.5k tokens free
running 38  waiting for KV 40, with KV room 100  preemptions/min 12.0
thrashing 0  saturated 1  capped 1  tight 0  ok 1  window 30s of 1m

                                                 FREE HEAD     WAIT WAIT PREEMPT  HIT   TTFT  MISSES
TARGET    DP ENGINE MODEL    STATE     KV USED TOKENS ROOM RUN   KV ROOM /min 1m   1m p90 1m /min 1m WHY
sat       0  vllm   llama-8b saturated     95%    816    0  30   40    0    12.0 0.80  4.67s    60.0 40 waiting at 95% used (low-water 75%)
cap       0  sglang qwen-7b  capped        20%  26.2k   40 8/8    0  100     0.0    -   9.1s       - capped: 100 waiting with 40 requests of room: a concurrency or batch cap, not KV
restarted 1  vllm   llama-8b ok            10%  14.7k    -   0    0    0     0.0    -      -       -
"""
    # KV: (65536 - 41776) / 65536 = 36%; 816 + 26214 + 14746 = 41776 free; preemptions 12 + 0 + 0.


def test_json_gives_the_same_rows_as_numbers():
    result = top_on_recorded_pages("--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["fleet"] == {
        "pools": 3, "targets": 4, "targets_up": 3, "capacity_tokens": 65536.0, "free_tokens": 41776.0,
        "usage_ratio": (65536 - 41776) / 65536, "requests_running": 38.0, "requests_waiting_for_kv": 40.0,
        "requests_waiting_with_kv_room": 100.0, "preemptions_per_min": 12.0,
        "states": {"ok": 1, "tight": 0, "capped": 1, "saturated": 1, "thrashing": 0},
        "window_seconds": 60.0, "rates_seconds": 30.0,
    }
    common = {"requests_running_max": None, "polled_at": 1030.0, "role": "", "rates_seconds": 30.0}  # recorded before the role label
    sat, cap, restarted = out["pools"]
    assert math.isclose(sat.pop("ttft_p90_seconds"), 2.5 + 2.5 * (54 - 15) / (60 - 15), rel_tol=1e-12)
    assert sat == {**common, "target": "sat", "engine": "vllm", "model": "llama-8b", "dp_rank": "0",
                   "state": "saturated", "usage_ratio": 0.95, "capacity_tokens": 16384.0, "free_tokens": 816.0,
                   "headroom_requests": 0.0, "requests_running": 30.0, "requests_waiting": 40.0,
                   "requests_waiting_for_kv": 40.0, "requests_waiting_with_kv_room": 0.0,
                   "preemptions_per_min": (16 - 10) / 0.5, "prefix_hit_ratio": ((1600 - 1000) + (300 - 100)) / (3000 - 2000),
                   "capacity_misses_per_min": (130 - 100) / 0.5, "live_tokens_per_request": None,
                   "reason": "low_water", "why": "40 waiting at 95% used (low-water 75%)"}
    assert cap == {**common, "target": "cap", "engine": "sglang", "model": "qwen-7b", "dp_rank": "0",
                   "state": "capped", "usage_ratio": 0.2, "capacity_tokens": 32768.0, "free_tokens": 26214.0,
                   "headroom_requests": 40.0, "requests_running": 8.0, "requests_running_max": 8.0,
                   "requests_waiting": 100.0, "requests_waiting_for_kv": 0.0, "requests_waiting_with_kv_room": 100.0,
                   "preemptions_per_min": 0.0, "prefix_hit_ratio": None, "ttft_p90_seconds": 1 + 9 * 18 / 20,
                   "live_tokens_per_request": None, "reason": "cap",
                   "why": "capped: 100 waiting with 40 requests of room: a concurrency or batch cap, not KV"}
    assert restarted == {**common, "target": "restarted", "engine": "vllm", "model": "llama-8b", "dp_rank": "1",
                         "state": "ok", "usage_ratio": 0.1, "capacity_tokens": 16384.0, "free_tokens": 14746.0,
                         "headroom_requests": None, "requests_running": 0.0, "requests_waiting": 0.0,
                         "requests_waiting_for_kv": 0.0, "requests_waiting_with_kv_room": 0.0,
                         "preemptions_per_min": 0.0, "prefix_hit_ratio": None, "ttft_p90_seconds": None,
                         "live_tokens_per_request": None, "reason": "room", "why": None}


def test_the_exporters_published_thresholds_set_the_window_and_the_marks_top_quotes():
    """An exporter configured with `pressure: {window_seconds: 120, low_water_ratio: 0.6}` says so on its page:
    the per-minute figures' window and the reason's low-water mark are the exporter's, not top's defaults."""
    published = ('# TYPE kvcache_exporter_pressure_threshold gauge\n'
                 'kvcache_exporter_pressure_threshold{name="window_seconds"} 120\n'
                 'kvcache_exporter_pressure_threshold{name="low_water_ratio"} 0.6\n')
    with PageServer({"/metrics": alternating(page(PAGES[0] + published), page(PAGES[1] + published))}) as server:
        result = top("--exporter", server.url(""), "--interval", "0.1s", "--once")
    assert result.returncode == 0, result.stderr
    assert "window 30s of 2m" in result.stdout and "/min 2m" in result.stdout, result.stdout
    assert "40 waiting at 95% used (low-water 60%)" in result.stdout, result.stdout


def test_filter_and_sort_narrow_the_table_not_the_fleet():
    result = top_on_recorded_pages("--json", "--filter", "LLAMA", "--sort", "free")
    out = json.loads(result.stdout)
    assert [row["target"] for row in out["pools"]] == ["sat", "restarted"]  # 816 free tokens before 14746
    assert out["fleet"]["pools"] == 3


def test_direct_poll_reads_the_engines_with_the_exporters_pipeline(tmp_path):
    names = ("vllm-v1.txt", "sglang-0.5.txt")
    expected = {name: yaml.safe_load((FIXTURES / f"{name}.expected.yml").read_text()) for name in names}
    with PageServer({f"/{name}": page((FIXTURES / name).read_text()) for name in names}) as server:
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"targets": [{"name": "from-config", "url": server.url("/sglang-0.5.txt")}]}))
        result = top("--config", str(config), "--target", server.url("/vllm-v1.txt"), "--json", "--interval", "0.1s")
    assert result.returncode == 0, result.stderr
    pools = {(row["target"], row["dp_rank"]): row for row in json.loads(result.stdout)["pools"]}
    # A target without a name is called by its host:port and its path (not /metrics here).
    targets = {"vllm-v1.txt": server.url("/vllm-v1.txt").split("/", 2)[2], "sglang-0.5.txt": "from-config"}
    assert set(pools) == {(targets[name], rank) for name in names for rank in expected[name]["ranks"]}
    for name in names:
        for rank, want in expected[name]["ranks"].items():
            row = pools[targets[name], rank]
            assert (row["engine"], row["model"]) == (expected[name]["engine"], expected[name]["model"])
            for key in ("usage_ratio", "capacity_tokens", "free_tokens", "requests_running", "requests_waiting"):
                assert math.isclose(row[key], want[key], rel_tol=1e-9, abs_tol=1e-6), (name, rank, key)
            # a queue at or above the low-water mark (0.75) waits for KV: no headroom, by the contract
            short = want["requests_waiting"] > 0 and want["usage_ratio"] >= 0.75
            assert math.isclose(row["headroom_requests"],
                                0.0 if short else want["free_tokens"] / want["live_tokens_per_request"], rel_tol=1e-9)
            # the page is the same at both reads: nothing was preempted in between, no TTFT was observed
            assert (row["preemptions_per_min"], row["ttft_p90_seconds"]) == (0.0, None)


@pytest.mark.parametrize("args, message", [
    (["--interval", "soon"], "kvcache-exporter top: command line: --interval: not a positive duration"),
    (["--exporter", "http://127.0.0.1:1", "--target", "http://127.0.0.1:2/metrics"],
     "kvcache-exporter top: command line: --exporter: reads an exporter; --target and --config poll engines"),
    (["--exporter", "ftp://host"], "kvcache-exporter top: command line: --exporter: must be an http:// or https://"),
    (["--config", "/nonexistent/exporter.yml"], "kvcache-exporter top: /nonexistent/exporter.yml: (file): No such file"),
    (["--target", "not-a-url"], "kvcache-exporter top: command line: --target: must be an http:// or https:// URL"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = top(*args, "--once")
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def test_an_exporter_that_does_not_answer_is_one_line_and_exit_code_1():
    url = f"http://127.0.0.1:{harness.free_port()}"
    result = top("--exporter", url, "--once")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"kvcache-exporter top: {url}/metrics: ") and result.stderr.count("\n") == 1


def test_without_rich_the_table_names_the_install_command_and_json_still_works():
    blocked = ("import sys; sys.modules['rich'] = None; from kvcache_exporter.commands import main; "
               "sys.exit(main(sys.argv[1:]))")
    with PageServer({"/metrics": alternating(page(PAGES[0]), page(PAGES[1]))}) as server:
        common = ["top", "--exporter", server.url(""), "--interval", "0.1s"]
        table = subprocess.run([sys.executable, "-c", blocked, *common, "--once"], capture_output=True, text=True,
                               cwd=harness.REPO, timeout=60)
        as_json = subprocess.run([sys.executable, "-c", blocked, *common, "--json"], capture_output=True, text=True,
                                 cwd=harness.REPO, timeout=60)
    assert (table.returncode, table.stderr) == (
        2, "kvcache-exporter top needs the rich library: pip install 'kvcache-exporter[top]'\n")
    assert as_json.returncode == 0 and len(json.loads(as_json.stdout)["pools"]) == 3
