"""`kvcache-exporter check-config FILE [--web.config.file FILE]`: the configuration validated as the exporter
validates it at start, the files it names read and checked, without polling or listening (promtool's habit).
One line and exit 0 if it would start, one line naming the file, the key and the problem and exit 2 if not.
Flags and environment variables are the exporter's to merge at start: only the files are checked."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from .. import config as cfg
from ..runtime import webconfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache-exporter check-config",
        description="Check a configuration file as the exporter checks it at start, with the TLS, credential and "
                    "model architecture files it names, without polling any target. Exit 0 with a one-line "
                    "summary, or 2 with one line naming the file, the key and the problem.")
    p.add_argument("config", metavar="FILE", help="the YAML configuration file (the exporter's --config)")
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="also check this web configuration (the exporter's --web.config.file)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        config = cfg.resolve({"config": args.config}, {})
        web = webconfig.load(args.web_config_file) if args.web_config_file else None
    except cfg.ConfigError as err:
        print(f"kvcache-exporter: {err}", file=sys.stderr)
        return 2
    line = f"{args.config}: OK: {_targets(config)}, polled every {config.poll_interval:g}s, " \
           f"probe {'on' if config.probe.enabled else 'off'}"
    if web is not None:
        line += f"; {args.web_config_file}: OK: TLS {'on' if web.tls else 'off'}, {len(web.users)} basic auth user(s)"
    print(line)
    return 0


def _targets(config: cfg.Config) -> str:
    """`3 target(s) (vllm 2, auto 1; TLS 1, credentials 1, KV events 1)`: what the exporter will poll."""
    targets = config.targets
    engines = ", ".join(f"{engine} {count}" for engine, count in Counter(t.engine for t in targets).most_common())
    files = {"TLS": sum(t.url.startswith("https:") for t in targets),
             "credentials": sum(bool(t.bearer_token_file or t.basic_auth_password_file) for t in targets),
             "architecture": sum(t.kv_layout is not None for t in targets),
             "KV events": sum(t.kv_events is not None for t in targets)}
    details = ", ".join(f"{name} {count}" for name, count in files.items() if count)
    inside = "; ".join(part for part in (engines, details) if part)
    return f"{len(targets)} target(s)" + (f" ({inside})" if inside else "")
