"""Bad configuration, end to end: `python -m kvcache_exporter` prints one line naming file, key and problem, and exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, expected", [
    (["--config", "{tmp}/exporter.yml"], "kvcache-exporter: {tmp}/exporter.yml: targets[0].url: is required\n"),
    (["--target", "localhost:8000"], "kvcache-exporter: command line: --target: must be an http:// or https:// URL, "
                                     "got 'localhost:8000'\n"),
    (["--target", "http://a:1/m", "--listen", "10490"],
     "kvcache-exporter: command line: --listen: expected HOST:PORT, got '10490'\n"),
    (["--web.config.file", "{tmp}/exporter.yml"],
     "kvcache-exporter: {tmp}/exporter.yml: targets: unknown key "
     "(known: tls_server_config, basic_auth_users, http_server_config)\n"),
    (["--target", "http://a:1", "--target", "http://a:1/metrics"],
     "kvcache-exporter: command line: --target: http://a:1/metrics would be named 'a:1' like http://a:1: "
     "to poll both, list them in a configuration file (--config.file), each with its own `name`\n"),
    (["--target", "http://a:1/x", "--target", "http://a:1/x"],
     "kvcache-exporter: command line: --target: http://a:1/x is given twice\n"),
    (["--target", "http://a:1/x", "--poll-interval", "5ms"],
     "kvcache-exporter: command line: --poll-interval: must be at least 100ms (the default is 5s), got '5ms'\n"),
    (["--demo", "--poll-interval", "5ms"],
     "kvcache-exporter: command line: --poll-interval: must be at least 100ms (the default is 5s), got '5ms'\n"),
])
def test_the_process_prints_one_line_and_exits_2(tmp_path, argv, expected):
    (tmp_path / "exporter.yml").write_text("targets: [{name: x}]\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    result = subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr == expected.format(tmp=tmp_path)
    assert result.stdout == ""
