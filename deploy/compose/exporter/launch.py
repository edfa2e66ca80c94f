"""Entrypoint of the compose stack's exporter container: choose the engines, then run kvcache-exporter.

The engines are the targets of the mounted file (deploy/compose/exporter.yml, or the file that
KVCACHE_EXPORTER_CONFIG_FILE names) plus KVCACHE_EXPORTER_TARGETS, which the exporter merges
itself. Two things only compose knows are decided here:
- the demo profile's simulated engines are added when their services run (their host names
  resolve; the exporter starts after them), so `docker compose --profile demo up` needs no setup;
- with no engine at all, the message says what to configure in this stack, not in general.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable
from urllib.parse import urlsplit

import yaml

USER_CONFIG = "/etc/kvcache-exporter/exporter.yml"
DEMO_CONFIG = "/etc/kvcache-exporter/demo.yml"
MERGED_CONFIG = "/tmp/kvcache-exporter.yml"
TARGETS_ENV = "KVCACHE_EXPORTER_TARGETS"

NOTHING_TO_WATCH = f"""\
kvcache-exporter: no engines to watch yet. Tell it where your vLLM / SGLang engines are, either:
  1. list their /metrics URLs under `targets:` in deploy/compose/exporter.yml
     (or in your own file, named by KVCACHE_EXPORTER_CONFIG_FILE in .env), or
  2. set {TARGETS_ENV}=http://host.docker.internal:8000/metrics,http://10.0.0.12:30000/metrics
     in .env (host.docker.internal is the Docker host; other machines by address or name),
then run `docker compose up -d` again. To see the stack with simulated engines and no GPU:
  docker compose --profile demo up
Step by step: docs/compose.md"""


def read_config(path: str) -> dict | None:
    """A config file as a mapping with a `targets` list; None when it cannot be read as one
    (the exporter, run on it, then reports precisely what is wrong)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError):
        return None
    data = {} if data is None else data
    if not isinstance(data, dict) or not isinstance(data.get("targets") or [], list):
        return None
    return {**data, "targets": list(data.get("targets") or [])}


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def running_demo_targets(demo_path: str, resolve: Callable[[str], bool] = resolves) -> list:
    """The demo targets, if every one of their hosts resolves (the demo profile is up), else []."""
    demo = read_config(demo_path)
    targets = demo["targets"] if demo else []
    hosts = [urlsplit(target["url"]).hostname for target in targets]
    return targets if hosts and all(resolve(host) for host in hosts) else []


def plan(user_path: str, demo_path: str, merged_path: str, environ: dict[str, str],
         resolve: Callable[[str], bool] = resolves) -> str | None:
    """The config file to run the exporter with (writing the merged one if the demo runs),
    or None when there is nothing to watch."""
    config = read_config(user_path)
    if config is None:
        return user_path
    demo_targets = running_demo_targets(demo_path, resolve)
    if not config["targets"] and not demo_targets and not environ.get(TARGETS_ENV, "").strip():
        return None
    if not demo_targets:
        return user_path
    with open(merged_path, "w", encoding="utf-8") as handle:
        yaml.safe_dump({**config, "targets": config["targets"] + demo_targets}, handle, sort_keys=False)
    return merged_path


def main(argv: list[str]) -> int:
    config_path = plan(USER_CONFIG, DEMO_CONFIG, MERGED_CONFIG, dict(os.environ))
    if config_path is None:
        print(NOTHING_TO_WATCH, file=sys.stderr)
        return 2
    os.execvp("kvcache-exporter", ["kvcache-exporter", "--config.file", config_path, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
