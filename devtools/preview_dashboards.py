"""Draw every panel of both dashboards from a Prometheus URL, one PNG per row, as on-call would see them.

    python -m devtools.preview_dashboards --prometheus http://127.0.0.1:9090 --out preview/ [--range 30m]
                                 [--scrape-interval 15s] [--var target=NAME]

No Grafana server: the queries are the generated JSON's, with the variables substituted the way
Grafana substitutes them (multi-value filters at All = `.*`, the target dashboard's single
`target` on the first value its variable lists unless `--var` names one) and `$__rate_interval`
computed as Grafana computes it. Stats show their last value coloured by their bands, tables
their rows worst first, time series and state timelines their lines. `make dashboards-preview`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvcache_exporter.dashboards import build

# Grafana's default width-derived number of points of a graph; the step is range / this, at least the scrape interval.
MAX_DATA_POINTS = 300
MATCH_ALL = ".*"
COLORS = {"green": "#56A64B", "yellow": "#F2CC0C", "orange": "#FF9830", "red": "#E02F44", "dark-red": "#8F1B2A",
          "blue": "#3274D9"}
TABLE_ROWS = 15  # rows of a table drawn; the PNG says how many more there are


@dataclass(frozen=True)
class Clock:
    """The range a dashboard is drawn over and the intervals Grafana derives from it."""

    end: float
    range_seconds: float
    scrape_seconds: float

    @property
    def step(self) -> float:
        """Grafana's $__interval: range / max data points, never below the scrape interval."""
        return max(self.range_seconds / MAX_DATA_POINTS, self.scrape_seconds)

    @property
    def rate_interval(self) -> float:
        """Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval)."""
        return max(self.step + self.scrape_seconds, 4 * self.scrape_seconds)


def duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration such as 15s or 1h, got {text!r}")
    return float(match.group(1)) * units[match.group(2)]


def promql_duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


class Prometheus:
    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as err:  # Prometheus says why in the body
            payload = json.loads(err.read() or b"{}")
        if payload.get("status") != "success":
            raise ValueError(f"{path} {params}: {payload.get('error')}")
        return payload["data"]

    def range(self, expr: str, clock: Clock) -> list[dict]:
        return self.get("/api/v1/query_range", query=expr, start=clock.end - clock.range_seconds, end=clock.end,
                        step=clock.step)["result"]

    def instant(self, expr: str, clock: Clock) -> list[dict]:
        return self.get("/api/v1/query", query=expr, time=clock.end)["result"]

    def label_values(self, selector: str, label: str) -> list[str]:
        return sorted(self.get(f"/api/v1/label/{label}/values", **{"match[]": selector}))


def substitute(expr: str, values: dict[str, str], clock: Clock) -> str:
    """The query Grafana sends: variables replaced (longest name first), $__rate_interval in milliseconds."""
    expr = expr.replace("$__rate_interval", promql_duration(clock.rate_interval))
    for name in sorted(values, key=len, reverse=True):
        expr = re.sub(rf"\${name}\b", lambda _: values[name], expr)
    if "$" in expr:
        raise ValueError(f"unsubstituted variable in {expr}")
    return expr


def regex_value(value: str) -> str:
    """A single value inside `=~"..."`, as Grafana writes it: regex-escaped, then escaped for the PromQL string."""
    return re.escape(value).replace("\\", "\\\\")


def variable_values(dashboard: dict, prometheus: Prometheus, chosen: dict[str, str], clock: Clock) -> dict[str, str]:
    """Every query variable at All, a single-value one at `chosen` or else at the first value it lists."""
    values: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        name = variable["name"]
        if name in chosen:
            values[name] = regex_value(chosen[name])
        elif variable.get("includeAll"):
            values[name] = MATCH_ALL
        else:
            match = re.fullmatch(r"label_values\((?P<selector>.*), (?P<label>\w+)\)", variable["query"])
            listed = prometheus.label_values(substitute(match.group("selector"), values, clock), match.group("label"))
            values[name] = regex_value(listed[0]) if listed else MATCH_ALL
    return values


def rows(dashboard: dict) -> list[tuple[str, list[dict]]]:
    """(row title, its panels) in dashboard order."""
    out: list[tuple[str, list[dict]]] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append((panel["title"], list(panel.get("panels", []))))
        elif out:
            out[-1][1].append(panel)
    return out


def last_value(series: dict) -> float | None:
    values = [float(v) for _, v in series.get("values", []) if not math.isnan(float(v))]
    return values[-1] if values else None


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip() or "value"


def band_color(steps: list[dict], value: float) -> str:
    color = steps[0]["color"]
    for step in steps[1:]:
        if step["value"] is not None and value >= step["value"]:
            color = step["color"]
    return COLORS.get(color, color)


def panel_steps(panel: dict, ref_id: str | None = None, header: str | None = None) -> list[dict]:
    """The bands of a panel, or of one query's (by refId) or column's (by name) override."""
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"]["options"] in (ref_id, header):
            for prop in override["properties"]:
                if prop["id"] == "thresholds":
                    return prop["value"]["steps"]
    return panel["fieldConfig"]["defaults"]["thresholds"]["steps"]


def value_mappings(panel: dict, header: str | None = None) -> dict[str, dict]:
    """Value mappings of a panel or of one column (by name): code -> {"text", "color"}."""
    mappings = panel["fieldConfig"]["defaults"].get("mappings", [])
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"]["options"] == header:
            mappings = next((p["value"] for p in override["properties"] if p["id"] == "mappings"), mappings)
    return {code: result for mapping in mappings for code, result in mapping["options"].items()}


def value_color(panel: dict, value: float, ref_id: str | None = None, header: str | None = None) -> str:
    """A mapped value's own colour (Grafana lets a mapping's colour win over the bands), else its band's."""
    mapped = value_mappings(panel, header).get(f"{value:g}", {}).get("color")
    return COLORS.get(mapped, mapped) if mapped else band_color(panel_steps(panel, ref_id, header), value)


def formatted(value: float | None, unit: str, mappings: dict[str, dict]) -> str:
    if value is None:
        return "No data"
    if f"{value:g}" in mappings:
        return mappings[f"{value:g}"]["text"]
    if unit == "percentunit":
        return f"{value:.1%}"
    if unit == "s":
        return f"{value:.3g} s" if value < 120 else f"{value / 60:.3g} min"
    suffix = unit.split(":", 1)[1] if unit.startswith("count:") else ("B" if unit == "bytes" else "")
    return f"{value:,.4g} {suffix}".strip()


@dataclass
class PanelData:
    """What one panel's queries returned: per query, (legend, [(t, v)]) series or instant (labels, value) rows."""

    panel: dict
    series: dict[str, list[tuple[dict, list[tuple[float, float]]]]]


def evaluate(panel: dict, prometheus: Prometheus, values: dict[str, str], clock: Clock) -> PanelData:
    results = {}
    for target in panel["targets"]:
        expr = substitute(target["expr"], values, clock)
        if target.get("instant"):
            data = [(item["metric"], [(float(item["value"][0]), float(item["value"][1]))])
                    for item in prometheus.instant(expr, clock)]
        else:
            data = [(item["metric"], [(float(t), float(v)) for t, v in item["values"]])
                    for item in prometheus.range(expr, clock)]
        results[target["refId"]] = data
    return PanelData(panel, results)


def draw_stat(ax, data: PanelData) -> None:
    panel = data.panel
    unit = panel["fieldConfig"]["defaults"]["unit"]
    lines = []
    for target in panel["targets"]:
        for labels, points in data.series[target["refId"]] or [({}, [])]:
            finite = [v for _, v in points if not math.isnan(v)]
            value = finite[-1] if finite else None
            color = value_color(panel, value, ref_id=target["refId"]) if value is not None else "#888888"
            lines.append((legend(target.get("legendFormat", ""), labels), formatted(value, unit, value_mappings(panel)),
                          color))
    ax.set_axis_off()
    # Several values share the tile: smaller figures, each right of its name, so none covers another.
    size, x = (14, 0.5) if len(lines) == 1 else (max(6, 11 - len(lines)), 0.72)
    for index, (name, text, color) in enumerate(lines):
        y = 1 - (index + 0.5) / len(lines)
        ax.text(x, y, f"{text}", ha="center", va="center", fontsize=size if len(text) < 14 else size * 0.7,
                weight="bold", color="white",
                bbox={"facecolor": color, "edgecolor": "none", "boxstyle": "round,pad=0.3"}, transform=ax.transAxes)
        if len(lines) > 1:
            ax.text(0.02, y, name, ha="left", va="center", fontsize=7, transform=ax.transAxes)


def draw_timeseries(ax, data: PanelData, max_lines: int = 12) -> None:
    panel = data.panel
    unit = panel["fieldConfig"]["defaults"]["unit"]
    names = {code: mapped["text"] for code, mapped in value_mappings(panel).items()}
    drawn = []
    for target in panel["targets"]:
        for labels, points in data.series[target["refId"]]:
            finite = [(t, v) for t, v in points if not math.isnan(v)]
            if finite:
                drawn.append((max(v for _, v in finite), legend(target.get("legendFormat", ""), labels), finite))
    drawn.sort(key=lambda item: -item[0])
    for _, name, points in drawn[:max_lines]:
        t0 = points[0][0]
        ax.plot([(t - t0) / 60 for t, _ in points], [v for _, v in points], label=name, linewidth=1,
                drawstyle="steps-post" if panel["type"] == "state-timeline" else "default")
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    if panel["type"] == "timeseries" and len(steps) > 1:
        for step in steps[1:]:
            ax.axhline(step["value"], color=COLORS.get(step["color"], step["color"]), linestyle="--", linewidth=0.8)
    if names:
        ax.set_yticks([int(code) for code in names], list(names.values()))
    elif unit == "percentunit":
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_xlabel("minutes into the range", fontsize=7)
    ax.set_ylabel(unit, fontsize=7)
    ax.tick_params(labelsize=7)
    if drawn:
        extra = f" (+{len(drawn) - max_lines} more)" if len(drawn) > max_lines else ""
        ax.legend(fontsize=6, loc="upper left", title=extra or None, title_fontsize=6)
    else:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)


def draw_heatmap(ax, data: PanelData) -> None:
    [points] = data.series.values()
    by_bound = {}
    for labels, series in points:
        bound = float(labels.get("le", "inf"))
        by_bound[bound] = [v for _, v in series]
    if not by_bound:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
        return
    bounds = sorted(by_bound)
    width = min(len(v) for v in by_bound.values())
    # Cumulative buckets to per-bucket counts.
    grid = [[by_bound[b][i] - (by_bound[bounds[j - 1]][i] if j else 0) for i in range(width)]
            for j, b in enumerate(bounds)]
    ax.imshow(grid, aspect="auto", origin="lower", cmap="Oranges", interpolation="nearest")
    ax.set_yticks(range(len(bounds)), [f"{b:g}" for b in bounds], fontsize=5)
    ax.set_xlabel("interval", fontsize=7)


def table_rows(data: PanelData) -> tuple[list[str], list[list[float | None]], str]:
    """Headers, rows (merged on the key label, sorted as the panel sorts) and the key label."""
    panel = data.panel
    key = next(t for t in panel["transformations"] if t["id"] == "organize")
    order = sorted(key["options"]["indexByName"].items(), key=lambda item: item[1])
    key_label = order[0][0]
    headers = [t["legendFormat"] for t in panel["targets"]]
    merged: dict[str, list[float | None]] = {}
    for index, target in enumerate(panel["targets"]):
        for labels, points in data.series[target["refId"]]:
            row = merged.setdefault(labels.get(key_label, ""), [None] * len(headers))
            row[index] = points[-1][1]
    sort = panel["options"]["sortBy"][0]
    column = headers.index(sort["displayName"])
    ordered = sorted(merged.items(), key=lambda item: (-(item[1][column] if item[1][column] is not None else -1),
                                                       item[0]))
    return headers, [[name, *values] for name, values in ordered], key_label


def draw_table(ax, data: PanelData) -> None:
    panel = data.panel
    headers, table, key_label = table_rows(data)
    ax.set_axis_off()
    if not table:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
        return
    shown = table[:TABLE_ROWS]
    cells, colors = [], []
    for row in shown:
        cells.append([row[0]])
        colors.append(["white"])
        for header, value in zip(headers, row[1:]):
            unit = next(p["value"] for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == header
                        for p in o["properties"] if p["id"] == "unit")
            cells[-1].append(formatted(value, unit, value_mappings(panel, header)))
            colors[-1].append(value_color(panel, value, header=header) if value is not None else "white")
    drawn = ax.table(cellText=cells, cellColours=colors, colLabels=[key_label, *headers], loc="upper center",
                     cellLoc="center")
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7)
    if len(table) > TABLE_ROWS:
        ax.text(0.5, 0.0, f"... {len(table) - TABLE_ROWS} more rows", ha="center", fontsize=7, transform=ax.transAxes)


DRAW = {"stat": draw_stat, "timeseries": draw_timeseries, "state-timeline": draw_timeseries,
        "heatmap": draw_heatmap, "table": draw_table}


def render_row(title: str, panels: list[PanelData], path: Path, heading: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    # Panels sharing a y position form one line of the grid, as in Grafana.
    lines: dict[int, list[PanelData]] = {}
    for data in panels:
        lines.setdefault(data.panel["gridPos"]["y"], []).append(data)
    heights = [max(d.panel["gridPos"]["h"] for d in line) for _, line in sorted(lines.items())]
    figure = pyplot.figure(figsize=(18, 0.45 * sum(heights) + 0.6))
    figure.suptitle(f"{heading} / {title}", fontsize=11, x=0.01, ha="left")
    grid = figure.add_gridspec(len(heights), 24, height_ratios=heights, hspace=0.6, wspace=1.2)
    for row_index, (_, line) in enumerate(sorted(lines.items())):
        for data in line:
            pos = data.panel["gridPos"]
            ax = figure.add_subplot(grid[row_index, pos["x"]:pos["x"] + pos["w"]])
            ax.set_title(data.panel["title"], fontsize=8, loc="left")
            DRAW[data.panel["type"]](ax, data)
    figure.savefig(path, dpi=80, bbox_inches="tight")
    pyplot.close(figure)


def render_dashboard(name: str, prometheus: Prometheus, clock: Clock, chosen: dict[str, str], out: Path) -> list[Path]:
    dashboard = json.loads((build.GENERATED / name).read_text())
    values = variable_values(dashboard, prometheus, chosen, clock)
    heading = f"{dashboard['title']} ({', '.join(f'{k}={v}' for k, v in values.items())}, " \
              f"rate interval {clock.rate_interval:g}s)"
    written = []
    for index, (title, panels) in enumerate(rows(dashboard), 1):
        path = out / f"{dashboard['uid']}-{index:02d}-{re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')}.png"
        render_row(title, [evaluate(p, prometheus, values, clock) for p in panels], path, heading)
        written.append(path)
    return written


def render_all(prometheus_url: str, out: Path, range_seconds: float, scrape_seconds: float,
               chosen: dict[str, str] | None = None, end: float | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(end or time.time(), range_seconds, scrape_seconds)
    prometheus = Prometheus(prometheus_url)
    return [path for name in sorted(build.GENERATED.glob("*.json"))
            for path in render_dashboard(name.name, prometheus, clock, chosen or {}, out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.preview_dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--out", type=Path, default=Path("dashboard-preview"), help="directory of the PNGs")
    parser.add_argument("--range", type=duration, default=duration("30m"), help="time range drawn (%(default)ss)")
    parser.add_argument("--scrape-interval", type=duration, default=duration("15s"),
                        help="Prometheus' scrape interval, as Grafana's data source knows it (%(default)ss)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="set a variable instead of All (or the first value of a single-value one)")
    args = parser.parse_args(argv)
    chosen = {}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"--var {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        chosen[name] = value
    try:
        written = render_all(args.prometheus, args.out, args.range, args.scrape_interval, chosen)
    except (OSError, ValueError) as err:
        print(f"{args.prometheus}: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
