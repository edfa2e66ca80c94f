"""TLS and basic auth on the exporter's own endpoint, with real certificates made in the test."""

from __future__ import annotations

import sys

import bcrypt
import pytest
import requests
import yaml

from devtools import harness
from devtools.harness import make_certs

PASSWORD = "correct horse"


def users() -> dict:
    return {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()}


def test_basic_auth(tmp_path):
    proc, port = harness.exporter_with_web_config(tmp_path, {"basic_auth_users": users()})
    with proc:
        url = f"http://127.0.0.1:{port}/metrics"
        assert requests.get(url, timeout=5).status_code == 401
        assert requests.get(url, auth=("prometheus", "wrong"), timeout=5).status_code == 401
        assert requests.get(url, auth=("nobody", PASSWORD), timeout=5).status_code == 401
        good = requests.get(url, auth=("prometheus", PASSWORD), timeout=5)
        assert good.status_code == 200 and "kvcache_exporter_build_info" in good.text
        assert requests.get(url, auth=("prometheus", PASSWORD), timeout=5).status_code == 200  # cached check


def test_tls_refuses_plain_http_and_checks_client_certificates(tmp_path):
    certs = make_certs(tmp_path)
    proc, port = harness.exporter_with_web_config(tmp_path, {"tls_server_config": {
        "cert_file": str(certs.server_cert), "key_file": str(certs.server_key),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(certs.ca)}})
    with proc:
        base = f"127.0.0.1:{port}/metrics"
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://{base}", timeout=5)
        # No client certificate: refused in the handshake. asyncio closes the connection without sending
        # TLS 1.3's alert first, so the client sees either the alert (SSLError) or the connection end.
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"https://{base}", verify=str(certs.ca), timeout=5)
        with pytest.raises(requests.exceptions.SSLError):  # the server's certificate is not trusted
            requests.get(f"https://{base}", cert=(str(certs.client_cert), str(certs.client_key)), timeout=5)
        answer = requests.get(f"https://{base}", verify=str(certs.ca),
                              cert=(str(certs.client_cert), str(certs.client_key)), timeout=5)
        assert answer.status_code == 200 and "kvcache_exporter_build_info" in answer.text


def test_tls_with_basic_auth_and_no_client_certificate(tmp_path):
    certs = make_certs(tmp_path)
    proc, port = harness.exporter_with_web_config(tmp_path, {"tls_server_config": {"cert_file": str(certs.server_cert),
                                                        "key_file": str(certs.server_key)},
                                  "basic_auth_users": users()})
    with proc:
        url = f"https://127.0.0.1:{port}/metrics"
        assert requests.get(url, verify=str(certs.ca), timeout=5).status_code == 401
        assert requests.get(url, verify=str(certs.ca), auth=("prometheus", PASSWORD), timeout=5).status_code == 200


@pytest.mark.parametrize("web, key", [
    ({"tls_server_config": {"cert_file": "/nonexistent.crt", "key_file": "/nonexistent.key"}},
     "tls_server_config.cert_file"),
    ({"tls_server_config": {"key_file": "x"}}, "tls_server_config.cert_file"),
    ({"basic_auth_users": {"alice": "plaintext"}}, "basic_auth_users.alice"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "Sometimes"}},
     "tls_server_config.client_auth_type"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS1.2"}},
     "tls_server_config.min_version"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "max_versoin": "TLS13"}}, "tls_server_config.max_versoin"),
    ({"http_server_config": {"http2": True}}, "http_server_config.http2"),
    ({"http_server_config": {"headers": {"Server": "x"}}}, "http_server_config.headers.Server"),
    ({"http_server_config": {"heders": {}}}, "http_server_config.heders"),
    ({"basic_auth_user": {}}, "basic_auth_user"),
])
def test_bad_web_config_is_one_line_and_exit_2(tmp_path, web, key):
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(web))
    result = harness.subprocess.run(
        [sys.executable, "-m", "kvcache_exporter", "--web.config.file", str(path)],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"kvcache-exporter: {path}: {key}: ")
    assert result.stderr.count("\n") == 1


def test_http_server_config_headers_are_sent(tmp_path):
    proc, port = harness.exporter_with_web_config(tmp_path, {"http_server_config": {"http2": False,
                                                         "headers": {"X-Content-Type-Options": "nosniff"}}})
    with proc:
        answer = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert answer.status_code == 200 and answer.headers["X-Content-Type-Options"] == "nosniff"
