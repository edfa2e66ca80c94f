"""`kvcache-exporter assets --out DIR [--config exporter.yml]`: the dashboards, alert rules,
Alertmanager example and runbook, written out for a deployment.

The package carries the files the repository commits (dashboards/generated/*.json,
alerts/kvcache-rules.yml, alerts/alertmanager.yml, alerts/runbook.md), the same files the compose
stack mounts and the Kubernetes manifests embed. Without --config they are copied byte for byte.
With --config the rules and dashboards are rebuilt for that configuration's `pressure:` thresholds
and static `labels:`, as `python -m kvcache_exporter.alerts.generate --config` and `python -m devtools.build_dashboards
--config` build them; the dashboards need the grafana-foundation-sdk extra for that.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from .. import config as cfg

DASHBOARDS_EXTRA = "pip install 'kvcache-exporter[dashboards]'"
# Output path -> (package, resource) of the files that never depend on a configuration.
FIXED = {
    "alerts/alertmanager.yml": ("kvcache_exporter.alerts", "alertmanager.yml"),
    "alerts/runbook.md": ("kvcache_exporter.alerts", "runbook.md"),
}
RULES = "alerts/kvcache-rules.yml"


class AssetsError(Exception):
    """A problem stated in one line, with its fix."""


def _unconfigured() -> dict[str, bytes]:
    return {path: (resources.files(package) / name).read_bytes() for path, (package, name) in FIXED.items()}


def committed() -> dict[str, bytes]:
    """Output path -> the file as the package carries it."""
    dashboards = resources.files("kvcache_exporter.dashboards") / "generated"
    files = {f"dashboards/{item.name}": item.read_bytes()
             for item in sorted(dashboards.iterdir(), key=lambda item: item.name) if item.name.endswith(".json")}
    files[RULES] = (resources.files("kvcache_exporter.alerts") / "kvcache-rules.yml").read_bytes()
    return files | _unconfigured()


def for_config(path: str) -> dict[str, bytes]:
    """Output path -> the file rebuilt for an exporter configuration. Raises ConfigError or AssetsError."""
    cfg.load_file(path, read_files=False)  # a broken file is reported first, as the exporter reports it
    from kvcache_exporter.alerts import generate as alerts

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
    files[RULES] = alerts.render(alerts.build(thresholds, pd_group_label=pd_group_label)).encode()
    return files | _unconfigured()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvcache-exporter assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", required=True, help="directory to write dashboards/ and alerts/ into")
    parser.add_argument("--config", metavar="FILE",
                        help="exporter configuration whose pressure: thresholds and labels: to follow")
    args = parser.parse_args(argv)
    try:
        files = for_config(args.config) if args.config else committed()
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
    return 0
