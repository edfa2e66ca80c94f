"""The simulator's command line, `python -m kvcache_exporter.simulator.cli`, as a process: it serves until
SIGTERM or SIGINT, and a bad argument or a port in use is one line on stderr and exit code 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from devtools import harness
from kvcache_exporter.simulator import start_engine

TIMEOUT_S = 30  # generous: the machine is shared; nothing here asserts speed


def run_cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvcache_exporter.simulator.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_cli_serves_until_sigterm():
    with run_cli("--flavor", "sglang", "--scenario", "concurrency-cap", "--listen", "127.0.0.1:0",
                 "--speed", "20", "--seed", "3", "--model", "my-model", "--tp", "2") as process:
        try:
            line = process.stdout.readline()
            match = re.fullmatch(r"kvcache-sim sglang serving (http://127\.0\.0\.1:\d+/metrics)\n", line)
            assert match, line
            status, body = harness.http_get(match.group(1))
            assert status == 200
            running = harness.series(harness.samples_of(body), "sglang:num_running_reqs")
            assert [dict(labels)["model_name"] for _, labels in running] == ["my-model"] * 2  # one per TP rank
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=TIMEOUT_S) == 0
            assert process.stderr.read() == ""
        finally:
            process.kill()


def test_cli_stops_on_sigint_too():
    with run_cli("--flavor", "vllm-v0", "--listen", "127.0.0.1:0") as process:
        try:
            assert process.stdout.readline().startswith("kvcache-sim vllm-v0 serving http://127.0.0.1:")
            os.kill(process.pid, signal.SIGINT)
            assert process.wait(timeout=TIMEOUT_S) == 0
        finally:
            process.kill()


@pytest.mark.parametrize("args,expected", [
    (["--flavor", "vllm-v1", "--scenario", "{file}"], r"{file}: phases\[0\]\.arrival_rate: must be >= 0, got -2"),
    (["--flavor", "vllm-v1", "--scenario", "nope.yml"], r"nope\.yml: neither a built-in scenario"),
    (["--flavor", "triton"], r"argument --flavor: invalid choice: 'triton'"),
    (["--flavor", "sglang", "--listen", "localhost"], r"argument --listen: expected HOST:PORT"),
    (["--flavor", "sglang", "--speed", "-1"], r"argument --speed: expected a number > 0"),
    (["--flavor", "sglang", "--tp", "0"], r"argument --tp: expected an integer >= 1"),
    (["--flavor", "vllm-v0", "--dp", "2"], r"flavor vllm-v0 supports dp <= 1"),
    (["--pd", "--flavor", "trtllm"], r"--pd serves vllm-v1 or sglang, got trtllm"),
    (["--pd", "--flavor", "sglang", "--tp", "2"], r"--pd takes no --tp"),
    (["--pd", "--flavor", "vllm-v1", "--scenario", "kv-saturation"], r"kv-saturation: not a P/D scenario"),
])
def test_cli_reports_a_bad_argument_in_one_line_with_exit_code_2(tmp_path, args, expected):
    scenario = tmp_path / "bad.yml"
    scenario.write_text("phases:\n  - duration_s: 10\n    arrival_rate: -2\n")
    args = [arg.replace("{file}", str(scenario)) for arg in args]
    with run_cli(*args) as process:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 2
    assert stdout == ""
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert re.fullmatch(rf"kvcache-sim: error: {expected.replace('{file}', re.escape(str(scenario)))}.*\n", stderr)


@pytest.mark.parametrize("flavor", ["vllm-v1", "sglang"])
def test_cli_serves_a_pd_pair_whose_queues_are_the_engines(flavor):
    """--pd: the prefill engine on the given port, the decode engine on the next; the decode side short of KV
    (pd-decode-short) shows its stages as the engine counts them, and the exporter reads its queue as their sum
    on both engines, the transfers waiting for KV to be allocated as waiting for KV."""
    from kvcache_exporter import adapters, derive
    from kvcache_exporter.sources import parser
    from kvcache_exporter.thresholds import DEFAULT
    port = harness.free_port()
    while not harness.port_free(port + 1):
        port = harness.free_port()
    with run_cli("--pd", "--flavor", flavor, "--scenario", "pd-decode-short", "--listen", f"127.0.0.1:{port}",
                 "--speed", "40", "--seed", "7") as process:
        try:
            urls = {}
            for role, line in (("prefill", process.stdout.readline()), ("decode", process.stdout.readline())):
                match = re.fullmatch(rf"kvcache-sim {flavor} {role} serving (http://127\.0\.0\.1:(\d+)/metrics)\n",
                                     line)
                assert match, line
                urls[role] = match.group(1)
            assert urls == {"prefill": f"http://127.0.0.1:{port}/metrics", "decode": f"http://127.0.0.1:{port + 1}/metrics"}

            def decode_short():
                text = harness.http_get(urls["decode"])[1]
                adapter = adapters.detect(text)
                ranks, _ = derive.derive(adapter.adapt(parser.parse(text, adapter.wanted)), {}, 0.0, DEFAULT,
                                         role="decode")
                rank = ranks["0"]
                stages = rank.labelled.get("kv_transfer_requests", {})
                return rank if stages.get(("waiting_to_start",), 0) >= 5 and rank.gauges["usage_ratio"] >= 0.75 \
                    else None

            rank = harness.wait_until(decode_short, timeout=TIMEOUT_S, interval=0.3, what="a decode pool short of KV")
            stages = rank.labelled["kv_transfer_requests"]
            assert set(stages) == {("waiting_to_start",), ("in_progress",), ("completed_waiting",)}
            assert rank.gauges["requests_waiting"] == sum(stages.values())
            assert rank.gauges["requests_waiting_for_kv"] == stages[("waiting_to_start",)]
            assert rank.gauges["requests_waiting_with_kv_room"] == 0 and rank.pressure == "saturated"
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=TIMEOUT_S) == 0
        finally:
            process.kill()


def test_cli_reports_a_port_in_use_in_one_line():
    with start_engine("vllm-v1") as engine, run_cli("--flavor", "vllm-v1", "--listen",
                                                     f"127.0.0.1:{engine.port}") as process:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 2
    assert re.fullmatch(rf"kvcache-sim: error: cannot listen on 127\.0\.0\.1:{engine.port}: .+\n", stderr)
