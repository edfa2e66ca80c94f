"""Write (or, with --check, compare) dashboards/generated/*.json, refusing dashboards that break the
house rules (devtools.lint_dashboards): `make dashboards`.

With `--config exporter.yml` the panels follow a deployment's settings, as `kvcache-exporter assets
--config` builds them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache_exporter import config as exporter_config
from kvcache_exporter.dashboards.build import GENERATED, build_all, render, settings_from

from devtools import lint_dashboards as lint


def drifted(rendered: dict[str, str], out: Path) -> list[str]:
    """Names of files in `out` that are missing or differ from `rendered`."""
    return [name for name, text in rendered.items()
            if not (out / name).is_file() or (out / name).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.build_dashboards", description=__doc__.splitlines()[0])
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
