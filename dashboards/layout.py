"""The frame both dashboards share: variables, firing-alert annotations, links, rows on a grid."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.builders import prometheus
from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.dashboards import variables
from kvcache_exporter.dashboards.panels import DATASOURCE

GRID_WIDTH = 24
TAG = "kvcache"
FIRING_ALERTS = 'ALERTS{alertstate="firing", alertname=~"KVCache.*"}'
FIRING_ALERTS_MATCHERS = FIRING_ALERTS.removeprefix("ALERTS{").removesuffix("}")


def firing_alerts_of(labels: tuple[str, ...]) -> str:
    """Firing alerts whose `labels` match the dashboard's variables, and those about no target at all
    (the exporter itself), which concern every target."""
    if not labels:
        return FIRING_ALERTS
    matchers = ", ".join(f'{label}=~"${label}"' for label in labels)
    return (f"ALERTS{{{FIRING_ALERTS_MATCHERS}, {matchers}}} "
            f'or ALERTS{{{FIRING_ALERTS_MATCHERS}, target=""}}')


@dataclass(frozen=True)
class Row:
    """A titled row; each line of panels shares the grid's width equally."""

    title: str
    lines: tuple[tuple[object, ...], ...]


def widths(count: int) -> list[int]:
    """Split the grid's width into `count` near-equal integer widths, wider ones first."""
    base, extra = divmod(GRID_WIDTH, count)
    return [base + 1 if index < extra else base for index in range(count)]


def firing_alerts(labels: tuple[str, ...]):
    return (
        builders.AnnotationQuery()
        .name("Firing KV-cache alerts")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .target(prometheus.Dataquery().datasource(DATASOURCE).ref_id("Anno").expr(firing_alerts_of(labels)))
        .title_format("{{alertname}}")
        .text_format("{{target}} {{severity}}")
        .tag_keys("alertname,severity,target")
        .use_value_for_time(False)
    )


def assemble(uid: str, title: str, description: str, filters: list, rows: list[Row],
             alerts_of: tuple[str, ...] = ()) -> models.Dashboard:
    """The dashboard; `alerts_of` names the variables that narrow its alert annotations."""
    dashboard = (
        builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .with_variable(variables.datasource())
        .annotation(firing_alerts(alerts_of))
        # Both dashboards carry the tag, so this shows the other one and keeps time range and variables.
        .link(builders.DashboardLink("KV cache dashboards").type(models.DashboardLinkType.DASHBOARDS)
              .tags([TAG]).include_vars(True).keep_time(True))
    )
    for variable in filters:
        dashboard.with_variable(variable)
    ids = itertools.count(1)
    for row in rows:
        dashboard.with_row(builders.Row(row.title).id(next(ids)))
        for line in row.lines:
            for panel, width in zip(line, widths(len(line))):
                dashboard.with_panel(panel.id(next(ids)).span(width))
    return dashboard.build()
