"""`kvcache-exporter [flags]`: poll the engines and serve the kvcache_* contract (or, with `--demo`,
simulated engines). The flags, their environment variables and the config file are merged by
config.resolve."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__, config as cfg
from ..runtime import app, webconfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache-exporter",
        description="Polls vLLM and SGLang /metrics endpoints and exposes the engine-independent kvcache_* "
                    "contract. Subcommands: `kvcache-exporter check-config FILE` to check a configuration file "
                    "and the files it names without starting, `kvcache-exporter kv-math --help` for KV memory "
                    "arithmetic, `kvcache-exporter assets --help` to write out the dashboards and alert rules, "
                    "`kvcache-exporter top --help` for the fleet's KV state in a terminal.",
        epilog="Each flag can also be set from its environment variable: "
               + ", ".join(f"{cfg.flag_name(k)}: {v}" for k, v in cfg.ENVIRONMENT.items())
               + " (comma-separated URLs).",
    )
    p.add_argument("--config", metavar="FILE", help="YAML configuration file")
    p.add_argument("--target", metavar="URL", action="append", help="an engine's /metrics URL (repeatable)")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"where to serve /metrics (default {cfg.DEFAULT_LISTEN})")
    p.add_argument("--poll-interval", metavar="DURATION", help="how often to poll each target (default 5s)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error (default info)")
    p.add_argument("--workers", metavar="N", help="processes that poll the targets between them, each on a core "
                   "(default 1; more for fleets whose pages take over a few tenths of the poll interval to read)")
    p.add_argument("--shard", metavar="INDEX/COUNT",
                   help="poll only this replica's share of the configured targets, by a hash of their names "
                        "(0/4: the first of four replicas of one configuration; default 0/1, all of them)")
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth for this endpoint, in the exporter-toolkit web-config.yml format")
    p.add_argument("--demo", action="store_true",
                   help="start a simulated vLLM and a simulated SGLang engine and poll them (no GPU needed)")
    p.add_argument("--version", action="version", version=f"kvcache-exporter {__version__}")
    return p


def main(argv: list[str]) -> int:
    flags = vars(parser().parse_args(argv))
    environ = dict(os.environ)
    try:
        if flags["demo"]:
            from . import demo  # the simulator is loaded for the demo only

            listen = cfg.given(flags, environ, "listen")
            return demo.run(listen[2] if listen else None, listen[:2] if listen else ("--demo", "--listen"),
                            flags["poll_interval"], flags["log_level"])
        config = cfg.resolve(flags, environ)
        web_config = flags["web_config_file"] or environ.get(cfg.ENVIRONMENT["web_config_file"])
        web = webconfig.load(web_config) if web_config else None
    except cfg.ConfigError as err:
        print(f"kvcache-exporter: {err}", file=sys.stderr)
        return 2
    reload_config = (lambda: cfg.resolve(flags, environ)) if cfg.given(flags, environ, "config") else None
    return app.serve(config, cfg.listen_origin(flags, environ), reload_config, web)
