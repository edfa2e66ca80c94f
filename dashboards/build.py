"""Build the dashboards and write (or, with --check, compare) dashboards/generated/*.json.

With `--config exporter.yml` the panels follow a deployment's settings: its `pressure:`
overrides move the colour bands as they move the exporter's pressure state and the alerts,
and its static `labels:` (global and per target) become the dashboards' filter variables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as models

from exporter import config as exporter_config
from exporter.thresholds import Thresholds

from dashboards import fleet, lint, target

GENERATED = Path(__file__).resolve().parent / "generated"
# Static labels a deployment typically sets when no configuration says otherwise.
DEFAULT_STATIC_LABELS = ("cluster", "pool")


def build_all(thresholds: Thresholds = Thresholds(),
              static_labels: tuple[str, ...] = DEFAULT_STATIC_LABELS) -> dict[str, models.Dashboard]:
    """File name -> dashboard."""
    return {module.FILENAME: module.build(thresholds, static_labels) for module in (fleet, target)}


def render(dashboard: models.Dashboard) -> str:
    return json.dumps(dashboard, cls=JSONEncoder, indent=2) + "\n"


def settings_from(config_path: Path) -> tuple[Thresholds, tuple[str, ...]]:
    """Thresholds and static label names of an exporter configuration file (the defaults where it sets none)."""
    thresholds, names = exporter_config.thresholds_and_labels(str(config_path))
    return thresholds, names or DEFAULT_STATIC_LABELS


def drifted(rendered: dict[str, str], out: Path) -> list[str]:
    """Names of files in `out` that are missing or differ from `rendered`."""
    return [name for name, text in rendered.items()
            if not (out / name).is_file() or (out / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="exporter configuration whose pressure: and labels: to follow")
    parser.add_argument("--out", type=Path, default=GENERATED, help="directory of the generated JSON (%(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files differ")
    args = parser.parse_args(argv)

    try:
        settings = settings_from(args.config) if args.config else ()
    except exporter_config.ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    rendered = {name: render(dashboard) for name, dashboard in build_all(*settings).items()}
    broken = [f"{name}: {problem}" for name, text in rendered.items() for problem in lint.problems(json.loads(text))]
    if broken:
        print("\n".join(broken), file=sys.stderr)
        return 2
    if args.check:
        stale = drifted(rendered, args.out)
        for name in stale:
            print(f"{args.out / name} is out of date: run `make dashboards`", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (args.out / name).write_text(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
