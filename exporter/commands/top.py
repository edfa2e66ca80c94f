"""`kvcache-exporter top`: the fleet's KV state in a terminal, one row per pool, worst first.

Reads an exporter's /metrics, or polls the engines itself with the exporter's pipeline (`--target`,
`--config`). On a terminal it runs a live screen (rich); not on a terminal, or with `--once`, it
prints one table (`--json`: the rows as JSON) and exits. The view is kvcache_exporter.top.
"""

from __future__ import annotations

import argparse
import sys

from .. import config as cfg
from ..sources import parser as page_parser
from ..thresholds import DEFAULT as THRESHOLDS
from ..top import once
from ..top.rows import SORTS
from ..top.source import DirectSource, ExporterSource, SourceError

PROG = "kvcache-exporter top"
DEFAULT_EXPORTER = "http://127.0.0.1:10490"
INSTALL_HINT = f"{PROG} needs the rich library: pip install 'kvcache-exporter[top]'"


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="The fleet's KV state in a terminal: one row per pool, worst first. Keys: q quit, "
                    "s cycle the sort column, / filter by text (Enter apply, Esc cancel), p pause.",
        epilog=f"PREEMPT /min, HIT and TTFT p90 are over the pressure state's window (pressure: window_seconds, "
               f"{THRESHOLDS.window_seconds:g}s by default; the summary's `window` says how much of it the reads "
               f"cover so far): a pool is thrashing at {THRESHOLDS.thrashing_preemptions_per_second * 60:g} "
               f"preemptions/min or more over it. HIT is the share of prompt tokens served from any cache, the GPU "
               f"pool's or beyond it (an offload tier, LMCache), on every engine.")
    where = p.add_argument_group("what to read (default: --exporter " + DEFAULT_EXPORTER + ")")
    where.add_argument("--exporter", metavar="URL", help="a running exporter (its /metrics)")
    where.add_argument("--target", metavar="URL", action="append",
                       help="an engine's /metrics URL, polled directly (repeatable)")
    where.add_argument("--config", metavar="FILE", help="the exporter's YAML configuration: poll its targets directly")
    p.add_argument("--interval", metavar="DURATION", default="2s", help="time between reads (default 2s)")
    p.add_argument("--once", action="store_true",
                   help="read twice, --interval apart (for the per-minute figures), print one table and exit; "
                        "the default when standard output is not a terminal")
    p.add_argument("--json", action="store_true", help="like --once, printing the fleet and its rows as JSON")
    p.add_argument("--sort", choices=SORTS, default="state", help="sort column, worst first (default state)")
    p.add_argument("--filter", metavar="TEXT", default="",
                   help="only pools whose target, engine, model, rank or state holds TEXT")
    return p


def _source(args: argparse.Namespace, interval: float) -> DirectSource | ExporterSource:
    """Raises ConfigError (a bad flag or configuration file)."""
    if args.exporter and (args.target or args.config):
        raise cfg.ConfigError("command line", "--exporter", "reads an exporter; --target and --config poll engines "
                                                             "directly: give one or the other")
    if args.target or args.config:
        # The exporter's own merge of --config and --target; top reads no environment variables.
        return DirectSource(cfg.resolve({"config": args.config, "target": args.target}, {}))
    url = args.exporter or DEFAULT_EXPORTER
    try:
        return ExporterSource(url, timeout=min(10.0, max(1.0, interval)))
    except ValueError as err:
        raise cfg.ConfigError("command line", "--exporter", str(err)) from None


def main(argv: list[str]) -> int:
    args = argument_parser().parse_args(argv)
    try:
        interval = cfg.parse_duration(args.interval)
    except ValueError as err:
        print(f"{PROG}: command line: --interval: {err}", file=sys.stderr)
        return 2
    interactive = not (args.once or args.json) and sys.stdout.isatty() and sys.stdin.isatty()
    if not args.json:
        try:
            import rich  # noqa: F401  (an optional dependency: the `top` extra)
        except ImportError:
            print(INSTALL_HINT, file=sys.stderr)
            return 2
    try:
        source = _source(args, interval)
    except cfg.ConfigError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    if not interactive:
        try:
            sys.stdout.write(once.output(source, interval, args.sort, args.filter, args.json))
        except (SourceError, page_parser.ParseError) as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            return 1
        return 0
    from ..top import live
    from ..top.screen import ViewState

    return live.run(source, interval, ViewState(source.description, source.thresholds.window_seconds, sort=args.sort,
                                                filter=args.filter))
