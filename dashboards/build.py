"""Build the dashboards as JSON (`make dashboards` writes them to dashboards/generated/).

With `--config exporter.yml` the panels follow a deployment's settings: its `pressure:`
overrides move the colour bands as they move the exporter's pressure state and the alerts,
and its static `labels:` (global and per target) become the dashboards' filter variables.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter import config as exporter_config
from kvcache_exporter.thresholds import Thresholds

from kvcache_exporter.dashboards import fleet, target

GENERATED = Path(__file__).resolve().parent / "generated"
# Static labels a deployment typically sets when no configuration says otherwise.
DEFAULT_STATIC_LABELS = ("cluster", "pool")


def build_all(thresholds: Thresholds = Thresholds(), static_labels: tuple[str, ...] = DEFAULT_STATIC_LABELS,
              pd_group_label: str = exporter_config.DEFAULT_PD_GROUP_LABEL) -> dict[str, models.Dashboard]:
    """File name -> dashboard."""
    return {module.FILENAME: module.build(thresholds, static_labels, pd_group_label) for module in (fleet, target)}


def render(dashboard: models.Dashboard) -> str:
    return json.dumps(dashboard, cls=JSONEncoder, indent=2) + "\n"


def settings_from(config_path: Path) -> tuple[Thresholds, tuple[str, ...], str]:
    """Thresholds, static label names and P/D group label of an exporter configuration file (the defaults where
    it sets none): build_all's arguments."""
    settings = exporter_config.generator_settings(str(config_path))
    return settings.thresholds, settings.static_labels or DEFAULT_STATIC_LABELS, settings.pd_group_label
