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


# The time series each alert is about, by the start of their titles: its firing is drawn there, where the lines
# that made it fire are; the other alerts are drawn on every panel.
ALERT_PANELS = {
    "KVCacheShortageQueueing": ("Waiting requests by cause", "Pressure state over time", "Headroom per"),
    "KVCachePreemptionStorm": ("Preemption rate", "Pressure state over time"),
    "KVCacheNearlyFull": ("KV usage per", "Time until full"),
    "KVCachePrefixHitRateDrop": ("Prefix-cache hit ratio per", "Hit ratio vs baseline"),
    "KVCacheQueueDominatesTTFT": ("Share of TTFT spent queueing", "Queue time"),
    "KVCacheTargetDown": ("Targets up over time",),
}


def firing_alerts_of(labels: tuple[str, ...], alertname: str = 'alertname=~"KVCache.*"') -> str:
    """Firing alerts (of `alertname`, a matcher) whose `labels` match the dashboard's variables, and those about no
    target at all (the exporter itself), which concern every target."""
    firing = FIRING_ALERTS_MATCHERS.replace('alertname=~"KVCache.*"', alertname)
    if not labels:
        return f"ALERTS{{{firing}}}"
    matchers = ", ".join(f'{label}=~"${label}"' for label in labels)
    return f"ALERTS{{{firing}, {matchers}}} " f'or ALERTS{{{firing}, target=""}}'


@dataclass(frozen=True)
class Row:
    """A titled row; each line of panels shares the grid's width equally."""

    title: str
    lines: tuple[tuple[object, ...], ...]


def widths(count: int) -> list[int]:
    """Split the grid's width into `count` near-equal integer widths, wider ones first."""
    base, extra = divmod(GRID_WIDTH, count)
    return [base + 1 if index < extra else base for index in range(count)]


ANNOTATION_STEP = "15s"


def firing_alerts(labels: tuple[str, ...], name: str = "Firing KV-cache alerts",
                  alertname: str = f'alertname!~"{"|".join(ALERT_PANELS)}", alertname=~"KVCache.*"',
                  panel_ids: list[int] | None = None):
    """The annotation of the firing alerts `alertname` matches, on the panels `panel_ids` (every panel: None)."""
    query = (
        builders.AnnotationQuery()
        .name(name)
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .target(prometheus.Dataquery().datasource(DATASOURCE).ref_id("Anno").expr(firing_alerts_of(labels, alertname)))
        .title_format("{{alertname}}")
        .text_format("{{target}} {{severity}}")
        .tag_keys("alertname,severity,target")
        .use_value_for_time(False)
        # The minimum step of its query (Grafana's default is 60s): an alert that fired for less than a minute,
        # or the last minute of a range, is drawn too.
        .step(ANNOTATION_STEP)
    )
    if panel_ids is not None:
        query.filter(builders.AnnotationPanelFilter().exclude(False).ids(panel_ids))
    return query


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
        # Both dashboards carry the tag, so this shows the other one and keeps time range and variables.
        .link(builders.DashboardLink("KV cache dashboards").type(models.DashboardLinkType.DASHBOARDS)
              .tags([TAG]).include_vars(True).keep_time(True))
    )
    for variable in filters:
        dashboard.with_variable(variable)
    ids = itertools.count(1)
    titles: dict[str, int] = {}
    for row in rows:
        dashboard.with_row(builders.Row(row.title).id(next(ids)))
        for line in row.lines:
            for panel, width in zip(line, widths(len(line))):
                titles[panel._internal.title] = next(ids)
                dashboard.with_panel(panel.id(titles[panel._internal.title]).span(width))
    dashboard.annotation(firing_alerts(alerts_of))
    for alert, starts in ALERT_PANELS.items():
        panel_ids = [id_ for title, id_ in titles.items() if title.startswith(starts)]
        dashboard.annotation(firing_alerts(alerts_of, alert, f'alertname="{alert}"', panel_ids))
    return dashboard.build()
