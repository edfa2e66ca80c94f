"""The alerting end of the end-to-end tests: the shipped Alertmanager routing pointed at a recorder in the
test, and a Prometheus scraping exporters with the generated rules and sending to that Alertmanager."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from devtools import harness

SECRETS = {"relay-token": "relay-secret", "pagerduty-routing-key": "pd-routing-key", "smtp-password": "smtp-secret"}
SHIPPED_AM = harness.REPO / "alerts" / "alertmanager.yml"


class Recorder:
    """An HTTP server that records every POST: stands in for the webhook relay, Slack and PagerDuty."""

    def __init__(self):
        self.posts: list[tuple[str, dict, dict]] = []  # (path, headers, JSON body)
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with recorder._lock:
                    recorder.posts.append((self.path, dict(self.headers), body))
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def received(self, path: str) -> list[tuple[dict, dict]]:
        with self._lock:
            return [(headers, body) for p, headers, body in self.posts if p == path]

    def webhook_alerts(self, alertname: str, target: str, status: str = "firing") -> list[tuple[dict, dict]]:
        """(headers, alert) of every relay-webhook notification about that alert on that target."""
        return [
            (headers, alert)
            for headers, body in self.received("/webhook")
            for alert in body["alerts"]
            if alert["labels"].get("alertname") == alertname and alert["labels"].get("target") == target
            and alert["status"] == status
        ]

    def close(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def write_secret(directory: Path, name: str, content: str) -> str:
    path = directory / name
    path.write_text(content)
    return str(path)


def alertmanager_test_config(shipped: dict, receiver_url: str, secrets_dir: Path) -> dict:
    """The shipped Alertmanager config with only URLs, secret file paths and group timings changed."""
    config = json.loads(json.dumps(shipped))  # deep copy; the YAML anchors are already expanded
    secret = {name: write_secret(secrets_dir, name, value) for name, value in SECRETS.items()}
    glob = config["global"]
    glob["slack_api_url_file"] = write_secret(secrets_dir, "slack-webhook-url", f"{receiver_url}/slack")
    glob["smtp_auth_password_file"] = secret["smtp-password"]
    glob["smtp_smarthost"] = f"127.0.0.1:{harness.free_port()}"  # nothing listens: email fails, the rest goes on
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{receiver_url}/webhook"
            hook["http_config"]["authorization"]["credentials_file"] = secret["relay-token"]
        for pager in receiver.get("pagerduty_configs", []):
            pager["routing_key_file"] = secret["pagerduty-routing-key"]
            pager["url"] = f"{receiver_url}/pagerduty"
    config["route"].update(group_wait="1s", group_interval="2s")
    return config


def prometheus_config(rules: Path, alertmanager_url: str | None, exporter_ports: list[int],
                      interval: str = "1s") -> dict:
    """Scrape, rule evaluation and alert sending every `interval`."""
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [{
            "job_name": "kvcache-exporter",
            "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in exporter_ports]}],
        }],
    }
    if alertmanager_url:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager_url.split("//")[1]]}]}]}
    return config


def diagnostics(prom_url: str, target: str) -> str:
    """What Prometheus saw of a target, for failure messages."""
    lines = []
    for expr in (f'kvcache_pressure_state{{target="{target}"}} == 1', f'kvcache_requests_waiting{{target="{target}"}}',
                 f'kvcache_usage_ratio{{target="{target}"}}', f'kvcache_target_up{{target="{target}"}}',
                 f'kvcache_tier_store_failures_total{{target="{target}"}}', f'ALERTS{{target="{target}"}}'):
        try:
            lines.append(f"{expr}: {harness.prom_vector(prom_url, expr)}")
        except (OSError, ValueError) as err:
            lines.append(f"{expr}: {err}")
    return "\n".join(lines)
