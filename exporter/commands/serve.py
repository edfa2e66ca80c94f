"""`kvcache-exporter [flags]`: poll the engines and serve the kvcache_* contract (or, with `--demo`,
simulated engines). The flags, their environment variables and the config file are merged by
config.resolve."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from .. import __version__, config as cfg
from ..adapters import ADAPTERS
from ..runtime import app, webconfig
from . import demo


class _Typed(argparse.Action):
    """Stores a flag's value and the spelling the command line used (cfg.TYPED), so that an error names the flag as
    the user typed it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, cfg.TYPED, {**(getattr(namespace, cfg.TYPED, None) or {}), self.dest: option_string})


def engines_in_words() -> str:
    """The registered engines' names, for the help: `Dynamo, LMCache, ... and vLLM`."""
    return demo.in_words([adapter.title for adapter in ADAPTERS.values()])


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a line never breaks inside a hyphenated word: `check-config` and `--web.config.file` stay
    whole, as a reader copies them."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache-exporter", formatter_class=_HelpFormatter,
        description=f"Polls the /metrics endpoints of LLM serving engines ({engines_in_words()}) and exposes the "
                    "engine-independent kvcache_* contract. Subcommands: `kvcache-exporter check-config FILE` to "
                    "check a configuration file and the files it names without starting, `kvcache-exporter kv-math "
                    "--help` for KV memory arithmetic, `kvcache-exporter assets --help` to write out the dashboards "
                    "and alert rules, "
                    "`kvcache-exporter top --help` for the fleet's KV state in a terminal.",
        epilog="Each flag can also be set from its environment variable: "
               + ", ".join(f"{cfg.flag_name(k)}: {v}" for k, v in cfg.ENVIRONMENT.items())
               + " (comma-separated URLs). A flag's second spelling is its earlier name, kept as an alias.",
    )
    p.set_defaults(**{cfg.TYPED: {}})

    def flag(setting: str, **kwargs) -> None:
        p.add_argument(*cfg.FLAGS[setting], dest=setting, action=_Typed, **kwargs)

    flag("config", metavar="FILE", help="YAML configuration file")
    p.add_argument(*cfg.FLAGS["target"], dest="target", metavar="URL", action="append",
                   help="an engine's /metrics URL (repeatable)")
    flag("listen", metavar="HOST:PORT", help=f"where to serve /metrics (default {cfg.DEFAULT_LISTEN})")
    flag("poll_interval", metavar="DURATION",
         help=f"how often to poll each target (default {cfg.DEFAULT_POLL_INTERVAL:g}s)")
    flag("log_level", metavar="LEVEL", help=f"{', '.join(cfg.LOG_LEVELS)} (default info)")
    flag("log_format", metavar="FORMAT",
         help=f"{' or '.join(cfg.LOG_FORMATS)}: one line per record on stderr (default {cfg.LOG_FORMATS[0]})")
    flag("workers", metavar="N", help="processes that poll the targets between them, each on a core "
         "(default 1; more for fleets whose pages take over a few tenths of the poll interval to read)")
    flag("shard", metavar="INDEX/COUNT",
         help="poll only this replica's share of the configured targets, by a hash of their names "
              "(0/4: the first of four replicas of one configuration; default 0/1, all of them)")
    flag("web_config_file", metavar="FILE",
         help="TLS and basic auth for this endpoint, in the exporter-toolkit web-config.yml format")
    p.add_argument("--demo", action="store_true",
                   help=f"start simulated {demo.engines_in_words()} engines and poll them (no GPU needed)")
    p.add_argument("--version", action="version", version=f"kvcache-exporter {__version__}")
    return p


def main(argv: list[str]) -> int:
    flags = vars(parser().parse_args(argv))
    environ = dict(os.environ)
    try:
        if flags["demo"]:
            listen = cfg.given(flags, environ, "listen")
            listen_key = listen[:2] if listen else ("--demo", cfg.flag_name("listen"))
            return demo.run(listen[2] if listen else None, listen_key, flags["poll_interval"], flags["log_level"],
                            log_format=flags["log_format"], flags=flags)
        config, web = load(flags, environ)
    except cfg.ConfigError as err:
        print(f"kvcache-exporter: {err}", file=sys.stderr)
        return 2
    reloads = cfg.given(flags, environ, "config") or cfg.given(flags, environ, "web_config_file")
    return app.serve(config, cfg.listen_origin(flags, environ), (lambda: load(flags, environ)) if reloads else None,
                     web)


def load(flags: dict, environ: dict[str, str]) -> tuple[cfg.Config, webconfig.WebConfig | None]:
    """The configuration and the web configuration, with every file they name read and checked: at start and at
    each reload alike. Raises ConfigError."""
    config = cfg.resolve(flags, environ)
    web_config = cfg.given(flags, environ, "web_config_file")
    return config, webconfig.load(str(web_config[2])) if web_config else None
