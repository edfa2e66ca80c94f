"""Polling engines behind TLS and auth: CA bundles, verification on by default, secrets from files
that are re-read when they change and never logged."""

from __future__ import annotations

import base64
import ssl
import time

import yaml

from devtools import harness
from devtools.harness import make_certs
from devtools.harness import scrape, value
from devtools.harness import PageServer, page
from devtools.harness import GOOD_PAGE


def guarded(expected: dict[str, str]):
    """A route that serves the page only to a request with the expected Authorization header."""
    def route(handler):
        if handler.headers.get("Authorization") == expected["header"]:
            page(GOOD_PAGE)(handler)
        else:
            page("denied", status=401)(handler)
    return route


def test_tls_and_credentials(tmp_path):
    certs = make_certs(tmp_path)
    token_file, password_file, lost_file = tmp_path / "token", tmp_path / "password", tmp_path / "lost-token"
    token_file.write_text("first-token\n")
    lost_file.write_text("first-token\n")  # read at load; removed once the exporter runs
    password_file.write_text("hunter2")
    bearer = {"header": "Bearer first-token"}
    basic = {"header": "Basic " + base64.b64encode(b"scraper:hunter2").decode()}
    with PageServer({"/bearer": guarded(bearer), "/basic": guarded(basic), "/open": page(GOOD_PAGE)}) as server:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.server_cert, certs.server_key)
        server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
        https = server.url("").replace("http://", "https://")
        config = tmp_path / "exporter.yml"
        config.write_text(yaml.safe_dump({"poll_interval": "0.5s", "targets": [
            {"name": "bearer", "url": https + "/bearer", "ca_file": str(certs.ca),
             "bearer_token_file": str(token_file)},
            {"name": "basic", "url": https + "/basic", "ca_file": str(certs.ca),
             "basic_auth": {"username": "scraper", "password_file": str(password_file)}},
            {"name": "untrusted", "url": https + "/open"},  # verification on by default: unknown CA
            {"name": "skip-verify", "url": https + "/open", "tls_insecure_skip_verify": True},
            {"name": "no-token", "url": https + "/bearer", "ca_file": str(certs.ca),
             "bearer_token_file": str(lost_file)},
        ]}))
        with harness.exporter(tmp_path, "--config", str(config), "--log-level", "debug") as exporter:
            lost_file.unlink()
            harness.wait_until(lambda: value(scrape(exporter.url), "kvcache_target_up", target="basic") == 1.0, 15,
                               what="basic auth target up")
            harness.wait_until(lambda: value(scrape(exporter.url), "kvcache_target_scrape_failures_total",
                                             target="no-token", reason="credentials") >= 1, 10, what="token lost")
            samples = scrape(exporter.url)
            assert value(samples, "kvcache_target_up", target="bearer") == 1.0
            assert value(samples, "kvcache_target_up", target="untrusted") == 0.0
            assert value(samples, "kvcache_target_scrape_failures_total", target="untrusted", reason="connect") >= 1
            assert value(samples, "kvcache_target_up", target="skip-verify") == 1.0
            assert value(samples, "kvcache_target_up", target="no-token") == 0.0
            assert value(samples, "kvcache_target_scrape_failures_total", target="no-token", reason="connect") == 0

            bearer["header"] = "Bearer second-token"  # the engine rotates its token...
            harness.wait_until(lambda: value(scrape(exporter.url), "kvcache_target_up", target="bearer") == 0.0, 10,
                               what="old token refused")
            time.sleep(0.05)
            token_file.write_text("second-token\n")  # ...and the file follows: no restart needed
            harness.wait_until(lambda: value(scrape(exporter.url), "kvcache_target_up", target="bearer") == 1.0, 10,
                               what="new token read")
        log = exporter.log_path.read_text()
        for secret in ("first-token", "second-token", "hunter2", base64.b64encode(b"scraper:hunter2").decode()):
            assert secret not in log
        assert "bearer" in log  # the log did record the failures, without their secrets
        assert f"target no-token: poll failed (credentials): cannot read {lost_file}: " in log
