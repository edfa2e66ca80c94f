"""Bad configuration, end to end: `python -m kvcache_exporter` (and `check-config`) prints one line naming file, key
and problem, and exits 2; a good one starts (and `check-config` says OK, polling nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import harness
from devtools.harness import GOOD_PAGE, PageServer, page


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
    (["--demo", "--listen", "127.0.0.1:99999"],  # was a traceback and exit 1
     "kvcache-exporter: command line: --listen: expected HOST:PORT, got '127.0.0.1:99999'\n"),
])
def test_the_process_prints_one_line_and_exits_2(tmp_path, argv, expected):
    (tmp_path / "exporter.yml").write_text("targets: [{name: x}]\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    result = subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr == expected.format(tmp=tmp_path)
    assert result.stdout == ""


def named_files(tmp_path: Path) -> Path:
    """The files a configuration may name, good and bad, in `tmp_path`: a CA, a server certificate and key, a token,
    a config.json, and files of the wrong kind."""
    harness.make_certs(tmp_path)
    (tmp_path / "token").write_text("t0ken\n")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 32, "num_attention_heads": 32, '
                                          '"num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}')
    (tmp_path / "two-lines").write_text("line one\nline two\n")
    (tmp_path / "empty").write_text("")
    (tmp_path / "not-utf8").write_bytes(b"\xff\xfe\x00t0ken")
    (tmp_path / "not-pem").write_text("not a certificate\n")
    (tmp_path / "not-json").write_text("{layers: 32")
    (tmp_path / "directory").mkdir()
    return tmp_path


GOOD_CONFIG = """targets:
  - {{name: plain, url: '{url}', bearer_token_file: '{tmp}/token'}}
  - {{name: tls, url: 'https://127.0.0.1:9/metrics', ca_file: '{tmp}/ca.crt',
      basic_auth: {{username: u, password_file: '{tmp}/token'}}, model_architecture: {{config_json: '{tmp}/config.json'}}}}
"""
GOOD_WEB = "tls_server_config: {{cert_file: '{tmp}/server.crt', key_file: '{tmp}/server.key'}}\n"
# One target naming a bad file (key: value in a flow mapping), and the line the exporter prints; OpenSSL's words for a
# file that holds no certificate are its own, so that case is matched up to them.
BAD_FILES = [
    ("ca_file: '{tmp}/missing.pem'", "targets[0].ca_file: cannot read {tmp}/missing.pem: No such file or directory\n"),
    ("ca_file: '{tmp}/not-pem'", "targets[0].ca_file: {tmp}/not-pem holds no PEM certificate: "),
    ("ca_file: '{tmp}/server.key'", "targets[0].ca_file: {tmp}/server.key holds no PEM certificate: "),
    ("ca_file: '{tmp}/directory'", "targets[0].ca_file: {tmp}/directory is not a regular file\n"),
    ("bearer_token_file: '{tmp}/two-lines'", "targets[0].bearer_token_file: {tmp}/two-lines holds a line break\n"),
    ("bearer_token_file: '{tmp}/empty'", "targets[0].bearer_token_file: {tmp}/empty is empty\n"),
    ("basic_auth: {{username: u, password_file: '{tmp}/not-utf8'}}",
     "targets[0].basic_auth.password_file: {tmp}/not-utf8 is not UTF-8 text\n"),
    ("model_architecture: {{config_json: '{tmp}/not-json'}}",
     "targets[0].model_architecture.config_json: {tmp}/not-json is not valid JSON: "),
]
BAD_WEB = [
    ("{{cert_file: '{tmp}/missing.crt', key_file: '{tmp}/server.key'}}",
     "tls_server_config.cert_file: cannot read {tmp}/missing.crt: No such file or directory\n"),
    ("{{cert_file: '{tmp}/server.crt', key_file: '{tmp}/client.key'}}",
     "tls_server_config.key_file: {tmp}/client.key is not the PEM private key of {tmp}/server.crt: "),
    ("{{cert_file: '{tmp}/server.crt', key_file: '{tmp}/server.key', client_auth_type: RequireAndVerifyClientCert,"
     " client_ca_file: '{tmp}/not-pem'}}", "tls_server_config.client_ca_file: {tmp}/not-pem holds no PEM certificate: "),
    ("{{cert_file: [a], key_file: '{tmp}/server.key'}}",
     "tls_server_config.cert_file: is required: a file path, got ['a']\n"),
]


def one_line_exit_2(result: subprocess.CompletedProcess, expected: str) -> None:
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), \
        result.stderr
    assert "Traceback" not in result.stderr


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_exporter", *argv], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("entry, expected", BAD_FILES)
def test_a_bad_file_the_configuration_names_is_one_line_and_exit_2_at_start_and_in_check_config(tmp_path, entry,
                                                                                                  expected):
    tmp = named_files(tmp_path)
    config = tmp / "exporter.yml"
    config.write_text(f"targets: [{{url: 'https://127.0.0.1:9/metrics', {entry.format(tmp=tmp)}}}]\n")
    line = f"kvcache-exporter: {config}: {expected.format(tmp=tmp)}"
    started = run("--config", str(config), "--listen", f"127.0.0.1:{harness.free_port()}")
    one_line_exit_2(started, line)
    checked = run("check-config", str(config))
    assert checked.stderr == started.stderr  # the same check, the same line
    one_line_exit_2(checked, line)


@pytest.mark.parametrize("tls, expected", BAD_WEB)
def test_a_bad_file_the_web_configuration_names_is_one_line_and_exit_2(tmp_path, tls, expected):
    tmp = named_files(tmp_path)
    web = tmp / "web.yml"
    web.write_text(f"tls_server_config: {tls.format(tmp=tmp)}\n")
    (tmp / "exporter.yml").write_text("targets: []\n")
    line = f"kvcache-exporter: {web}: {expected.format(tmp=tmp)}"
    one_line_exit_2(run("--web.config.file", str(web), "--listen", f"127.0.0.1:{harness.free_port()}"), line)
    one_line_exit_2(run("check-config", str(tmp / "exporter.yml"), "--web.config.file", str(web)), line)


def test_a_good_configuration_starts_and_check_config_says_ok_without_polling(tmp_path):
    tmp = named_files(tmp_path)
    with PageServer({"/metrics": page(GOOD_PAGE)}) as server:
        config, web = tmp / "exporter.yml", tmp / "web.yml"
        config.write_text(GOOD_CONFIG.format(tmp=tmp, url=server.url("/metrics")))
        web.write_text(GOOD_WEB.format(tmp=tmp))
        checked = run("check-config", str(config), "--web.config.file", str(web))
        assert (checked.returncode, checked.stderr) == (0, "")
        assert checked.stdout == (f"{config}: OK: 2 target(s) (auto 2; TLS 1, credentials 2, architecture 1), "
                                  f"polled every 5s, probe off; {web}: OK: TLS on, 0 basic auth user(s)\n")
        assert server.requests == {}  # no network: nothing polled
        with harness.exporter(tmp, "--config", str(config), "--poll-interval", "0.3s") as exporter:
            harness.wait_until(lambda: harness.value(harness.scrape(exporter.url), "kvcache_target_up",
                                                     target="plain") == 1.0, 15, what="the good target polled")


def test_check_config_usage(tmp_path):
    assert run("check-config").returncode == 2  # argparse: FILE is required
    result = run("check-config", str(tmp_path / "nope.yml"))
    one_line_exit_2(result, f"kvcache-exporter: {tmp_path}/nope.yml: (file): No such file or directory\n")
    assert "check-config FILE" in run("--help").stdout


def test_a_reload_naming_a_bad_file_keeps_the_process_and_the_running_configuration(tmp_path):
    """Each bad file a new target names, by SIGHUP and by POST /-/reload: the process lives on, the gauge reads 0,
    the endpoint answers 500 with the reason, the running target is still polled and the new one never is."""
    tmp = named_files(tmp_path)
    with PageServer({"/a": page(GOOD_PAGE), "/b": page(GOOD_PAGE)}) as server:
        config = tmp / "exporter.yml"
        good = f"poll_interval: 0.3s\ntargets:\n  - {{name: a, url: '{server.url('/a')}'}}\n"
        config.write_text(good)
        with harness.exporter(tmp, "--config", str(config)) as exporter:
            def reload_gauge() -> float:
                return harness.value(harness.scrape(exporter.url), "kvcache_exporter_config_last_reload_successful")

            def failures_logged() -> int:
                return exporter.log_path.read_text().count("reload failed, keeping the running configuration")

            for entry, expected in BAD_FILES:
                reason = f"{config}: {expected.format(tmp=tmp).replace('targets[0]', 'targets[1]')}".rstrip("\n")
                assert reload_gauge() == 1.0
                config.write_text(good + f"  - {{name: b, url: '{server.url('/b')}', {entry.format(tmp=tmp)}}}\n")

                logged = failures_logged()
                exporter.signal(signal.SIGHUP)
                harness.wait_until(lambda: failures_logged() == logged + 1, 10, what="the SIGHUP reload refused")
                assert exporter.proc.poll() is None
                assert reload_gauge() == 0.0
                assert f"reload failed, keeping the running configuration: {reason}" in exporter.log_path.read_text()

                status, body = harness.http_post(exporter.url + "/-/reload")
                assert status == 500 and body.startswith(f"reload failed: {reason}") and body.count("\n") == 1, body
                assert exporter.proc.poll() is None and reload_gauge() == 0.0

                polls = server.requests.get("/a", 0)
                harness.wait_until(lambda: server.requests.get("/a", 0) >= polls + 2, 10, what="a still polled")
                samples = harness.scrape(exporter.url)
                assert {dict(key[1])["target"] for key in harness.series(samples, "kvcache_target_up")} == {"a"}
                assert harness.value(samples, "kvcache_target_up", target="a") == 1.0
                assert "/b" not in server.requests

                config.write_text(good)  # the same file without the bad target: reloads
                assert harness.http_post(exporter.url + "/-/reload") == (200, "reloaded\n")
            assert "Traceback" not in exporter.log_path.read_text()


# A web configuration a reload reads, and the line it fails with (after `reload failed: WEB: `); the TLS key kinds
# a key cannot be read as: a directory, a FIFO (opened, it would block the reload) and another certificate's key.
BAD_WEB_RELOADS = [
    ("tls_server_config: {{cert_file: '{tmp}/server.crt', key_file: '{tmp}/directory'}}\n",
     "tls_server_config.key_file: {tmp}/directory is not a regular file"),
    ("tls_server_config: {{cert_file: '{tmp}/server.crt', key_file: '{tmp}/fifo'}}\n",
     "tls_server_config.key_file: {tmp}/fifo is not a regular file"),
    ("tls_server_config: {{cert_file: '{tmp}/server.crt', key_file: '{tmp}/client.key'}}\n",
     "tls_server_config.key_file: {tmp}/client.key is not the PEM private key of {tmp}/server.crt: "),
    ("tls_server_config: {{cert_file: '{tmp}/missing.crt', key_file: '{tmp}/server.key'}}\n",
     "tls_server_config.cert_file: cannot read {tmp}/missing.crt: No such file or directory"),
    ("tls_server_config: {{cert_file: '{tmp}/server.crt', key_file: '{tmp}/server.key'}}\nbasic_auth_users: [x]\n",
     "basic_auth_users: must be a mapping of user names to bcrypt hashes"),
    ("tls_server_config: [\n", "line 2: invalid YAML: "),
]


def test_a_reload_reads_the_web_configuration_and_a_bad_one_keeps_the_running_endpoint(tmp_path):
    """SIGHUP and POST /-/reload read --web.config.file again: a good one serves the next connection (basic auth
    added: 401 without it), a bad one (each of BAD_WEB_RELOADS) fails the reload with the gauge at 0 and the
    reason in the answer, the process and its TLS endpoint live on and the running target is still polled."""
    import bcrypt
    import requests

    tmp = named_files(tmp_path)
    os.mkfifo(tmp / "fifo")
    web = tmp / "web.yml"
    good_web = GOOD_WEB.format(tmp=tmp)
    web.write_text(good_web)
    with PageServer({"/a": page(GOOD_PAGE)}) as server:
        config = tmp / "exporter.yml"
        config.write_text(f"poll_interval: 0.3s\ntargets:\n  - {{name: a, url: '{server.url('/a')}'}}\n")
        port = harness.free_port()
        argv = [sys.executable, "-m", "kvcache_exporter", "--config.file", str(config), "--web.config.file", str(web),
                "--web.listen-address", f"127.0.0.1:{port}"]
        base, ca = f"https://127.0.0.1:{port}", str(tmp / "ca.crt")
        with harness.Process("exporter", argv, tmp, ready_url=None) as exporter:
            harness.wait_until(lambda: requests.get(base + "/healthz", verify=ca, timeout=1).status_code == 200, 15,
                               what="exporter listening")

            def scrape(auth=None) -> dict:
                answer = requests.get(base + "/metrics", verify=ca, auth=auth, timeout=10)
                assert answer.status_code == 200, answer.status_code
                return harness.samples_of(answer.text)

            def reload() -> tuple[int, str]:
                answer = requests.post(base + "/-/reload", verify=ca, timeout=10)
                return answer.status_code, answer.text

            def failures_logged() -> int:
                return exporter.log_path.read_text().count("reload failed, keeping the running configuration")

            users = {"prometheus": bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()}
            web.write_text(good_web + f"basic_auth_users: {{prometheus: '{users['prometheus']}'}}\n")
            assert reload() == (200, "reloaded\n")  # checked by the running configuration: no users yet
            assert requests.get(base + "/metrics", verify=ca, timeout=10).status_code == 401
            assert harness.value(scrape(("prometheus", "pw")), "kvcache_exporter_config_last_reload_successful") == 1
            web.write_text(good_web)
            exporter.signal(signal.SIGHUP)
            harness.wait_until(lambda: requests.get(base + "/healthz", verify=ca, timeout=10).status_code == 200, 10,
                               what="basic auth gone after SIGHUP")

            for text, expected in BAD_WEB_RELOADS:
                reason = f"{web}: {expected.format(tmp=tmp)}"
                web.write_text(text.format(tmp=tmp))
                logged = failures_logged()
                exporter.signal(signal.SIGHUP)
                harness.wait_until(lambda: failures_logged() == logged + 1, 10, what="the SIGHUP reload refused")
                assert exporter.proc.poll() is None
                assert f"reload failed, keeping the running configuration: {reason}" in exporter.log_path.read_text()
                assert harness.value(scrape(), "kvcache_exporter_config_last_reload_successful") == 0.0

                status, body = reload()
                assert status == 500 and body.startswith(f"reload failed: {reason}") and body.count("\n") == 1, body
                assert exporter.proc.poll() is None

                polls = server.requests.get("/a", 0)
                harness.wait_until(lambda: server.requests.get("/a", 0) >= polls + 2, 10, what="a still polled")
                samples = scrape()  # over the running TLS endpoint, its certificate unchanged
                assert harness.value(samples, "kvcache_target_up", target="a") == 1.0
                assert harness.value(samples, "kvcache_exporter_config_last_reload_successful") == 0.0

                web.write_text(good_web)
                assert reload() == (200, "reloaded\n")

            web.write_text("http_server_config: {headers: {X-Frame-Options: deny}}\n")  # TLS off: only at restart
            assert reload() == (200, "reloaded\n")
            answer = requests.get(base + "/metrics", verify=ca, timeout=10)
            assert answer.status_code == 200 and answer.headers["X-Frame-Options"] == "deny"
            assert "TLS on or off changes only at restart; still on" in exporter.log_path.read_text()
            assert "Traceback" not in exporter.log_path.read_text()


def test_a_configuration_file_that_is_a_fifo_is_one_line_at_start_in_check_config_and_at_a_reload(tmp_path):
    """Opened, a FIFO blocks until a writer comes: the start, check-config or a reload (and every reload after it,
    behind its lock) would wait for good."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    line = f"kvcache-exporter: {fifo}: (file): not a regular file\n"
    one_line_exit_2(run("--config.file", str(fifo), "--web.listen-address", f"127.0.0.1:{harness.free_port()}"), line)
    one_line_exit_2(run("check-config", str(fifo)), line)
    one_line_exit_2(run("--web.config.file", str(fifo), "--web.listen-address", f"127.0.0.1:{harness.free_port()}"),
                    line)
    config = tmp_path / "exporter.yml"
    config.write_text("targets: []\n")
    with harness.exporter(tmp_path, "--config.file", str(config)) as exporter:
        config.unlink()
        os.mkfifo(config)
        assert harness.http_post(exporter.url + "/-/reload") == (
            500, f"reload failed: {config}: (file): not a regular file\n")
        config.unlink()
        config.write_text("targets: []\n")
        assert harness.http_post(exporter.url + "/-/reload") == (200, "reloaded\n")
