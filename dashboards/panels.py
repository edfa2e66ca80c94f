"""Grafana panels with the house conventions applied once.

Every panel reads the `datasource` variable, has a unit, a description and colour bands;
a query may carry its own bands (a stat showing several values, each with its own red).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap as heatmap_builders
from grafana_foundation_sdk.builders import prometheus
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import statetimeline
from grafana_foundation_sdk.builders import table as table_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

from kvcache_exporter import contract
from kvcache_exporter.dashboards import bands

DATASOURCE_VARIABLE = "datasource"
DATASOURCE = common.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VARIABLE}}}")

# Every description says what the panel shows, then this, then what to do about it.
RED_ADVICE = "When it is red:"

STAT_HEIGHT = 4
# The worst lines a time series' legend lists without scrolling: Grafana 12.4's legend below a graph takes at most
# 35 % of the panel's height and scrolls the rest (its legend options have no row limit), and a legend row is as
# tall as its header (24 px). A graph 13 grid units tall (486 px) shows the header and five rows whole, and a sliver
# of the sixth that says there are more; 8 units showed two and a half.
LEGEND_ROWS = 5
GRAPH_HEIGHT = 13
TABLE_HEIGHT = 10  # about eight rows, then it scrolls: the worst pools come first
# Grafana's table gives each column at least 150 px: nine columns would not fit 1200 px, and the last ones
# would hide behind a scroll bar. Columns share the width down to this.
TABLE_COLUMN_MIN_WIDTH = 100
REF_IDS = "ABCDEFGH"
# What a stat or a table cell shows where a value is missing (no series, or NaN as histogram_quantile() gives
# over no requests). Without it Grafana paints an empty cell, and a stat's "No data", in the first band's colour:
# green reads "fine" for a target whose engine has no source, red "short" for a pool where nothing runs.
NO_DATA = "No data"
# A time series' legend: its last and largest value, sorted by the last (Grafana names the column "Last *").
LEGEND_CALCS = ("lastNotNull", "max")
LEGEND_SORT = "Last *"


def describe(shows: str, when_red: str) -> str:
    return f"{shows}\n\n{RED_ADVICE} {when_red}"


def _engines_without(family: str) -> str:
    """The engines that have no source for a contract family (the adapters' `not_reported`), in words."""
    from kvcache_exporter.adapters import ADAPTERS

    titles = [adapter.title for adapter in ADAPTERS.values() if family in adapter.not_reported]
    return ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else "".join(titles)


def without_source(family: str) -> str:
    """The sentence naming the engines that have no source for a contract family: their targets have no line in
    the panel, which is not a reading of 0."""
    named = _engines_without(family)
    return f" No line for {named} targets: their engine has no source for it (absent, not 0)." if named else ""


def no_value_without_source(family: str) -> str | None:
    """What a panel of a family some engines have no source for says where it has no value at all (Grafana's
    noValue, drawn in the panel's own size instead of its big "No data"): once, and why."""
    named = _engines_without(family)
    return f"No data: {named} {'export' if ' and ' in named else 'exports'} none" if named else None


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    steps: bands.Steps | None = None  # this query's own colour bands, over the panel's


@dataclass(frozen=True)
class Column:
    """A column of a table: one instant query, its header, unit, bands and value names."""

    header: str
    expr: str
    unit: str
    steps: bands.Steps
    mappings: list[models.ValueMapping] | None = None
    width: int | None = None  # px; None shares the table's width with the others
    decimals: int | None = None  # None: Grafana's own, about three significant digits


@dataclass(frozen=True)
class Link:
    """A data link on a panel's series (the URL may use ${__field.labels.*} and variables)."""

    title: str
    url: str


_FAMILY = re.compile(r"\bkvcache_[a-z0-9_]+")


def no_data_text(queries: list[Query], says: str | None) -> str | None:
    """What a panel shows without data: what it says already (`says`: which engines export none), and, when its
    queries read families of groups a configuration can turn off (`families:`), that the group may be off and
    the series that says so."""
    groups = sorted({family.group for query in queries for name in _FAMILY.findall(query.expr)
                     if (family := contract.family_of(name)) and family.group in contract.OPTIONAL_GROUPS})
    if not groups:
        return says
    named = " or ".join(groups)
    return f"{says or NO_DATA} (or the {named} group is off: see kvcache_exporter_group_enabled)"


def _with_basics(panel, title: str, description: str, unit: str, queries: list[Query], steps: bands.Steps,
                 links: tuple[Link, ...], query_format: prometheus_models.PromQueryFormat | None = None,
                 instant: bool = False, no_value: str | None = None):
    if len(queries) > len(REF_IDS):
        raise ValueError(f"{title}: at most {len(REF_IDS)} queries per panel")
    panel.title(title).description(description).unit(unit).datasource(DATASOURCE)
    says = no_value if no_value is not None else no_data_text(queries, None)
    if says is not None:
        panel.no_value(says)
    panel.thresholds(bands.config(steps))
    for ref_id, query in zip(REF_IDS, queries):
        target = (prometheus.Dataquery().datasource(DATASOURCE).ref_id(ref_id)
                  .expr(query.expr).legend_format(query.legend))
        if query_format is not None:
            target.format(query_format)
        if instant:
            target.instant()
        panel.with_target(target)
        if query.steps is not None:
            own_bands = models.DynamicConfigValue("thresholds", bands.config(query.steps).build())
            panel.override_by_query(ref_id, [own_bands])
    if links:
        panel.data_links([dashboard_builders.DashboardLink(link.title).url(link.url) for link in links])
    return panel


def missing_value(text: str = NO_DATA) -> models.ValueMapping:
    """A missing value as such: `text` on no colour (a mapping comes before Grafana's noValue: a stat with one says
    its noValue here too)."""
    return models.SpecialValueMap(models.DashboardSpecialValueMapOptions(
        match=models.SpecialValueMatch.NULL_AND_NAN, result=models.ValueMappingResult(text=text, color="transparent")))


def _uncoloured(steps: bands.Steps) -> bands.Steps:
    """A stat's neutral band as no colour (the missing value's "transparent"); any other band as it is."""
    return ((None, "transparent"),) if steps == bands.neutral() else steps


def stat(title: str, description: str, unit: str, queries: list[Query], steps: bands.Steps,
         mappings: list[models.ValueMapping] | None = None, min_max: tuple[float, float] | None = None,
         named: bool = False, links: tuple[Link, ...] = (), no_value: str | None = None, trend: bool = True):
    """A current value (the last one in range), coloured by its band. `named`: the value now, from an instant
    query, with the name its legend gives it (which pool it is). `no_value`: what it says without any value.
    `trend`: the range drawn under the value (not for a code a mapping names: its words get the whole panel)."""
    # A value without a band stands on no colour: the neutral band's blue background would mean nothing.
    steps = _uncoloured(steps)
    queries = [replace(query, steps=_uncoloured(query.steps)) if query.steps else query for query in queries]
    panel = stat_builders.Panel().height(STAT_HEIGHT)
    panel.reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    panel.color_mode(common.BigValueColorMode.BACKGROUND)
    panel.graph_mode(common.BigValueGraphMode.AREA if trend and not named else common.BigValueGraphMode.NONE)
    panel.text_mode(common.BigValueTextMode.VALUE_AND_NAME if len(queries) > 1 or named
                    else common.BigValueTextMode.AUTO)
    no_value = no_data_text(queries, no_value)
    panel.mappings([*(mappings or []), missing_value(no_value or NO_DATA)])
    if min_max:
        panel.min(min_max[0]).max(min_max[1])
    return _with_basics(panel, title, description, unit, queries, steps, links, instant=named, no_value=no_value)


def timeseries(title: str, description: str, unit: str, queries: list[Query], steps: bands.Steps,
               links: tuple[Link, ...] = (), min_max: tuple[float, float] | None = None, worst_low: bool = False,
               no_value: str | None = None):
    """Lines over time; a band with more than one step is drawn as threshold lines. The legend and the tooltip
    list the worst line first by its last value: the highest, or with `worst_low` the lowest (headroom, time
    until full, hit ratio), so the LEGEND_ROWS legend rows the panel's height shows are the worst ones."""
    panel = timeseries_builders.Panel().height(GRAPH_HEIGHT).line_width(1).fill_opacity(10)
    panel.legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                 .placement(common.LegendPlacement.BOTTOM).show_legend(True).calcs([*LEGEND_CALCS])
                 .sort_by(LEGEND_SORT).sort_desc(not worst_low))
    panel.tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                  .sort(common.SortOrder.ASCENDING if worst_low else common.SortOrder.DESCENDING))
    if len(steps) > 1:
        panel.thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    if min_max:
        panel.min(min_max[0]).max(min_max[1])
    return _with_basics(panel, title, description, unit, queries, steps, links,
                        no_value=no_data_text(queries, no_value))


def state_timeline(title: str, description: str, query: Query, mappings: list[models.ValueMapping],
                   links: tuple[Link, ...] = ()):
    """One lane per series; the value is a code that `mappings` names and colours.

    The colour scheme is fixed, not "from thresholds": with thresholds and merged values Grafana colours each lane by
    its threshold step and ignores the mappings (its issues 41075 and 71804: one blue state, "-∞+"). A missing
    value maps to no text: the legend, which lists every state the lanes' values display, would list the panel's
    noValue otherwise."""
    panel = statetimeline.Panel().height(GRAPH_HEIGHT).mappings([*mappings, missing_value("")]).merge_values(True)
    # The legend lists the states shown with their colours: what each colour of a lane means.
    panel.legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                 .placement(common.LegendPlacement.BOTTOM).show_legend(True))
    panel.show_value(common.VisibilityMode.NEVER).fill_opacity(80)
    panel.color_scheme(dashboard_builders.FieldColor().mode(models.FieldColorModeId.FIXED))
    return _with_basics(panel, title, description, "none", [query], bands.neutral(), links)


def heatmap(title: str, description: str, unit: str, query: Query):
    """Pre-bucketed histogram data: one column per interval, one cell per bucket."""
    panel = heatmap_builders.Panel().height(GRAPH_HEIGHT).calculate(False)
    panel.y_axis(heatmap_builders.YAxisConfig().unit(unit))
    panel.cell_values(heatmap_builders.CellValues().unit("count:requests"))
    panel.color(heatmap_builders.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME).scheme("Oranges")
                .scale(heatmap_models.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
    return _with_basics(panel, title, description, unit, [query], bands.neutral(), (),
                        query_format=prometheus_models.PromQueryFormat.HEATMAP)


def table(title: str, description: str, key: str, columns: list[Column], sort_by: str,
          links: tuple[Link, ...] = ()):
    """One row per `key` value; each column an instant query, merged on `key`, sorted on `sort_by` (descending).

    Every query keeps only the `key` label, so Grafana's merge joins them into one row each;
    the organize step names the value columns (`Value #A` ...) after their headers.
    """
    panel = table_builders.Panel().height(TABLE_HEIGHT).min_width(TABLE_COLUMN_MIN_WIDTH)
    # The SDK writes the pre-12.4 table's `footer` option, which Grafana 12.4's table model no longer
    # has (footers are per field now; @grafana/schema 12.4 rejects the key), and offers no way to unset it.
    panel._internal.options.footer = None
    panel.sort_by([common_builders.TableSortByFieldState().display_name(sort_by).desc(True)])
    panel.with_transformation(models.DataTransformerConfig(id_val="merge", options={}))
    names = {f"Value #{ref_id}": column.header for ref_id, column in zip(REF_IDS, columns)}
    panel.with_transformation(models.DataTransformerConfig(
        id_val="organize", options={"excludeByName": {"Time": True}, "renameByName": names,
                                    "indexByName": {key: 0, **{n: i + 1 for i, n in enumerate(names)}}}))
    cells = models.DynamicConfigValue("custom.cellOptions", {"type": "color-background", "mode": "basic"})
    # A header wider than its column wraps onto a second line instead of losing its start ("…ng with KV room"),
    # and so does a key (a pod's name: "sglang-sat-dp" for "sglang-sat-dp2" names another pool). Grafana 12.4's
    # TableNG reads custom.wrapHeaderText and custom.wrapText, which the SDK's builder does not offer.
    wrapped = models.DynamicConfigValue("custom.wrapHeaderText", True)
    # The key and the sort column filter (which pools, which states); a number's filter button would take a fifth
    # of its header's width, and its header's words ran past the column's left edge.
    filterable = models.DynamicConfigValue("custom.filterable", True)
    panel.override_by_name(key, [models.DynamicConfigValue("custom.wrapText", True), filterable])
    for ref_id, column in zip(REF_IDS, columns):
        properties = [models.DynamicConfigValue("unit", column.unit), wrapped,
                      models.DynamicConfigValue("thresholds", bands.config(column.steps).build()),
                      models.DynamicConfigValue("mappings", [*(column.mappings or []), missing_value()])]
        # A cell is coloured where its colour means something: a band, or a mapping's colour. A column without
        # either (running requests, TTFT) would be painted the neutral band's blue.
        if len(column.steps) > 1 or column.mappings:
            properties.append(cells)
        if column.header == sort_by:
            properties.append(filterable)
        if column.width is not None:
            properties.append(models.DynamicConfigValue("custom.width", column.width))
        if column.decimals is not None:
            properties.append(models.DynamicConfigValue("decimals", column.decimals))
        panel.override_by_name(column.header, properties)
    queries = [Query(column.expr, column.header) for column in columns]
    return _with_basics(panel, title, description, "none", queries, bands.neutral(), links,
                        query_format=prometheus_models.PromQueryFormat.TABLE, instant=True)


def value_names(names: dict[int, tuple[str, str]]) -> list[models.ValueMapping]:
    """Value mapping from codes to (text, colour)."""
    return [models.ValueMap({
        str(code): models.ValueMappingResult(text=text, color=color, index=index)
        for index, (code, (text, color)) in enumerate(names.items())
    })]


def range_names(names: dict[int, tuple[str, str]]) -> list[models.ValueMapping]:
    """Value mapping from codes to (text, colour), each code covering [code, code + 1): a value that adds a tie-break
    below 1 to its code (a sort key) reads as its code."""
    return [models.RangeMap(models.DashboardRangeMapOptions(
        from_val=code, to=code + 0.999999, result=models.ValueMappingResult(text=text, color=color, index=index)))
        for index, (code, (text, color)) in enumerate(names.items())]
