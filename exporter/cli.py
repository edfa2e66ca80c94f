"""Command line: flags, their environment variables and the config file, merged; then run."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__, config as cfg, demo
from .runtime import app, webconfig

# Flag -> environment variable that sets it when the flag is not given.
ENV = {
    "config": "KVCACHE_EXPORTER_CONFIG",
    "target": "KVCACHE_EXPORTER_TARGETS",
    "listen": "KVCACHE_EXPORTER_LISTEN",
    "poll_interval": "KVCACHE_EXPORTER_POLL_INTERVAL",
    "log_level": "KVCACHE_EXPORTER_LOG_LEVEL",
    "web_config_file": "KVCACHE_EXPORTER_WEB_CONFIG",
}


def flag_name(dest: str) -> str:
    return "--web.config.file" if dest == "web_config_file" else "--" + dest.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache-exporter",
        description="Polls vLLM and SGLang /metrics endpoints and exposes the engine-independent kvcache_* "
                    "contract. Subcommands: `kvcache-exporter kv-math --help` for KV memory arithmetic, "
                    "`kvcache-exporter assets --help` to write out the dashboards and alert rules, "
                    "`kvcache-exporter top --help` for the fleet's KV state in a terminal.",
        epilog="Each flag can also be set from its environment variable: "
               + ", ".join(f"{flag_name(k)}: {v}" for k, v in ENV.items())
               + " (comma-separated URLs).",
    )
    p.add_argument("--config", metavar="FILE", help="YAML configuration file")
    p.add_argument("--target", metavar="URL", action="append", help="an engine's /metrics URL (repeatable)")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"where to serve /metrics (default {cfg.DEFAULT_LISTEN})")
    p.add_argument("--poll-interval", metavar="DURATION", help="how often to poll each target (default 5s)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error (default info)")
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth for this endpoint, in the exporter-toolkit web-config.yml format")
    p.add_argument("--demo", action="store_true",
                   help="start a simulated vLLM and a simulated SGLang engine and poll them (no GPU needed)")
    p.add_argument("--version", action="version", version=f"kvcache-exporter {__version__}")
    return p


def given(args: argparse.Namespace, environ: dict[str, str], name: str) -> tuple[str, str, object] | None:
    """(where, flag or variable, value) of a setting given on the command line or in the environment."""
    value = getattr(args, name)
    if value is not None:
        return "command line", flag_name(name), value
    if environ.get(ENV[name]):
        return "environment", ENV[name], environ[ENV[name]]
    return None


def listen_origin(args: argparse.Namespace, environ: dict[str, str]) -> tuple[str, str]:
    """(where, key) of the listen address, for an error that names it."""
    found = given(args, environ, "listen")
    if found:
        return found[0], found[1]
    config_path = given(args, environ, "config")
    if config_path and "listen" in cfg.load_file(str(config_path[2])):
        return str(config_path[2]), "listen"
    return "default", "--listen"


def load(args: argparse.Namespace, environ: dict[str, str]) -> cfg.Config:
    """Defaults < config file < environment < flags. Raises ConfigError."""

    def given_here(name: str):
        return given(args, environ, name)

    settings: dict = {}
    source = "command line"
    config_path = given_here("config")
    if config_path:
        source = config_path[2]
        settings = cfg.load_file(config_path[2])
    targets = given_here("target")
    if targets:
        origin, key, value = targets
        urls = value if isinstance(value, list) else [u.strip() for u in value.split(",") if u.strip()]
        named = {t.name: f"target {t.name!r} of {source}" for t in settings.get("targets", [])}
        extra = []
        for url in urls:
            try:
                target = cfg.target_from_url(url)
            except ValueError as err:
                raise cfg.ConfigError(origin, key, str(err)) from None
            if named.get(target.name) == url:
                raise cfg.ConfigError(origin, key, f"{url} is given twice")
            if target.name in named:  # the command line has no way to name a target
                raise cfg.ConfigError(origin, key, f"{url} would be named {target.name!r} like "
                                      f"{named[target.name]}: to poll both, list them in a --config file, each "
                                      "with its own `name`")
            named[target.name] = url
            extra.append(target)
        settings["targets"] = list(settings.get("targets", [])) + extra
    for name, convert in (("listen", cfg.parse_listen), ("poll_interval", cfg.parse_poll_interval),
                          ("log_level", cfg._log_level)):
        found = given_here(name)
        if found:
            try:
                settings[name] = convert(found[2])
            except ValueError as err:
                raise cfg.ConfigError(found[0], found[1], str(err)) from None
    return cfg.build(source, settings)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "kv-math":
        from .kvmath import cli as kvmath_cli

        return kvmath_cli.main(argv[1:])
    if argv and argv[0] == "assets":
        from . import assets

        return assets.main(argv[1:])
    if argv and argv[0] == "top":
        from . import top

        return top.main(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.demo:
            listen = given(args, os.environ, "listen")
            return demo.run(listen[2] if listen else None, listen[:2] if listen else ("--demo", "--listen"),
                            args.poll_interval, args.log_level)
        environ = dict(os.environ)
        config = load(args, environ)
        web = webconfig.load(given_web_config) if (given_web_config := _web_config_path(args, environ)) else None
    except cfg.ConfigError as err:
        print(f"kvcache-exporter: {err}", file=sys.stderr)
        return 2
    reload_config = (lambda: load(args, environ)) if (args.config or environ.get(ENV["config"])) else None
    return app.serve(config, listen_origin(args, environ), reload_config, web)


def _web_config_path(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    return args.web_config_file or environ.get(ENV["web_config_file"]) or None
