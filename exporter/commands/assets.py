"""`kvcache-exporter assets --out DIR [--config exporter.yml] [--runbook-url-base URL]`: the dashboards, alert rules,
Alertmanager example and runbook, written out for a deployment.

The package carries the files the repository commits (dashboards/generated/*.json,
alerts/kvcache-rules.yml, alerts/alertmanager.yml, alerts/runbook.md), the same files the compose
stack mounts and the Kubernetes manifests embed. Without options they are copied byte for byte.
With --config the rules, the runbook and the dashboards are rebuilt for that configuration's `pressure:` thresholds
and static `labels:`, as `python -m kvcache_exporter.alerts.generate --config`, `python -m kvcache_exporter.alerts.runbook
--config` and `python -m devtools.build_dashboards --config` build them; the dashboards need the grafana-foundation-sdk
extra for that. --runbook-url-base is where you serve the runbook written to DIR/alerts/runbook.md: every alert's
runbook_url is that address and `#<alert name>`. The shipped default is the project's own runbook, whose numbers are the
default thresholds; with --config, point it at your copy.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from .. import config as cfg

DASHBOARDS_EXTRA = "pip install 'kvcache-exporter[dashboards]'"
ALERTMANAGER = "alerts/alertmanager.yml"  # never depends on a configuration
RULES = "alerts/kvcache-rules.yml"
RUNBOOK = "alerts/runbook.md"


class AssetsError(Exception):
    """A problem stated in one line, with its fix."""


def _alerts_file(name: str) -> bytes:
    return (resources.files("kvcache_exporter.alerts") / name).read_bytes()


def committed(runbook_url_base: str | None = None) -> dict[str, bytes]:
    """Output path -> the file as the package carries it; the rules rebuilt for `runbook_url_base` if given."""
    dashboards = resources.files("kvcache_exporter.dashboards") / "generated"
    files = {f"dashboards/{item.name}": item.read_bytes()
             for item in sorted(dashboards.iterdir(), key=lambda item: item.name) if item.name.endswith(".json")}
    if runbook_url_base is None:
        files[RULES] = _alerts_file("kvcache-rules.yml")
    else:
        from kvcache_exporter.alerts import generate as alerts

        files[RULES] = alerts.render(alerts.build(runbook_base=runbook_url_base)).encode()
    return files | {RUNBOOK: _alerts_file("runbook.md"), ALERTMANAGER: _alerts_file("alertmanager.yml")}


def for_config(path: str, runbook_url_base: str | None = None) -> dict[str, bytes]:
    """Output path -> the file rebuilt for an exporter configuration. Raises ConfigError or AssetsError."""
    cfg.load_file(path, read_files=False)  # a broken file is reported first, as the exporter reports it
    from kvcache_exporter.alerts import generate as alerts
    from kvcache_exporter.alerts import runbook

    try:
        from kvcache_exporter.dashboards import build as dashboards
    except ImportError as err:
        if not (err.name or "").startswith("grafana_foundation_sdk"):
            raise
        raise AssetsError(f"--config: rebuilding the dashboards needs grafana-foundation-sdk: {DASHBOARDS_EXTRA}") \
            from None
    thresholds, static_labels, pd_group_label = dashboards.settings_from(Path(path))
    files = {f"dashboards/{name}": dashboards.render(board).encode()
             for name, board in dashboards.build_all(thresholds, static_labels, pd_group_label).items()}
    files[RULES] = alerts.render(alerts.build(thresholds, runbook_url_base or alerts.RUNBOOK_URL_BASE,
                                              pd_group_label=pd_group_label)).encode()
    files[RUNBOOK] = runbook.render(thresholds).encode()
    return files | {ALERTMANAGER: _alerts_file("alertmanager.yml")}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvcache-exporter assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", required=True, help="directory to write dashboards/ and alerts/ into")
    parser.add_argument("--config", metavar="FILE",
                        help="exporter configuration whose pressure: thresholds and labels: to follow")
    parser.add_argument("--runbook-url-base", metavar="URL",
                        help="where you serve DIR/alerts/runbook.md; each alert's runbook_url is URL#<alert name> "
                             "(default: the project's runbook, which states the default thresholds)")
    args = parser.parse_args(argv)
    try:
        files = (for_config(args.config, args.runbook_url_base) if args.config
                 else committed(args.runbook_url_base))
        out = Path(args.out)
        for relative, content in files.items():
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            (out / relative).write_bytes(content)
    except (cfg.ConfigError, AssetsError) as err:
        print(f"kvcache-exporter assets: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"kvcache-exporter assets: --out: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    for relative in files:
        print(out / relative)
    if args.config and args.runbook_url_base is None and files[RUNBOOK] != _alerts_file("runbook.md"):
        print(f"kvcache-exporter assets: note: the alerts' runbook_url links to the project's runbook, which states the "
              f"default thresholds: serve {out / RUNBOOK} and pass --runbook-url-base", file=sys.stderr)
    return 0
