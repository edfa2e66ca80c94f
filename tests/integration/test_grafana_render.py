"""Grafana 12.4's own code on our dashboards (devtools/grafana-render/): the generated JSON validates against
@grafana/schema's types and a broken copy does not; the renderer draws panels from a real Prometheus with
Grafana's units, colours, value mappings, table merge and sort, and names a panel whose query fails."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest

from devtools import grafana_render, harness
from kvcache_exporter.contract import PRESSURE_REASONS, PRESSURE_STATES
from kvcache_exporter.dashboards.bands import STATE_COLORS
from kvcache_exporter.dashboards.panels import LEGEND_ROWS
from devtools.lint_dashboards import panels as panels_of

RENDER = grafana_render.RENDER
GENERATED = sorted(grafana_render.GENERATED.glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
LOW_WATER_CODE = list(PRESSURE_REASONS).index("low_water")  # the triage table's State code of the reason


def node(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    if not (RENDER / "node_modules").is_dir():
        raise RuntimeError(f"{RENDER}/node_modules is missing: `make deps` (scripts/install-test-deps) runs npm ci there")
    return subprocess.run([harness.require_binary("node"), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=harness.REPO)


def validate(*paths) -> subprocess.CompletedProcess:
    return node(str(RENDER / "validate.mjs"), *map(str, paths))


def test_generated_dashboards_validate_against_grafana_schema():
    result = validate(*GENERATED)
    assert (result.returncode, result.stderr) == (0, "")
    assert "valid against @grafana/schema 12.4.0" in result.stdout


def test_a_broken_dashboard_fails_naming_each_broken_panel(tmp_path):
    dashboard = json.loads((harness.REPO / "dashboards" / "generated" / "kvcache-fleet.json").read_text())
    panels = {panel["title"]: panel for panel in dashboard["panels"]}
    panels["Fullest pool's KV usage"]["options"]["colorMode"] = "rainbow"
    panels["KV usage per target"]["fieldConfig"]["defaults"]["unti"] = "percent"
    panels["Pools that need help now"]["gridPos"]["w"] = "24"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(dashboard))
    result = validate(broken)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert any("panel \"Fullest pool's KV usage\"" in line and '"rainbow"' in line for line in lines), lines
    assert any('panel "KV usage per target"' in line and "unti" in line for line in lines), lines
    assert any('panel "Pools that need help now"' in line and "string" in line for line in lines), lines
    assert not any('panel "Targets up"' in line for line in lines)


def test_a_file_that_is_not_json_exits_2(tmp_path):
    path = tmp_path / "dashboard.json"
    path.write_text("{not json")
    result = validate(path)
    assert result.returncode == 2
    assert f"{path}: cannot read as JSON" in result.stderr


def panel(panel_id: int, kind: str, title: str, x: int, targets: list[dict], defaults: dict, options: dict,
          **extra) -> dict:
    return {"type": kind, "id": panel_id, "title": title, "datasource": DATASOURCE,
            "gridPos": {"h": 6, "w": 6, "x": x, "y": 1},
            "targets": [{"datasource": DATASOURCE, "refId": chr(65 + i), **t} for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": extra.pop("overrides", [])}, "options": options, **extra}


def bands(*steps) -> dict:
    return {"mode": "absolute", "steps": [{"value": value, "color": color} for value, color in steps]}


STAT = {"colorMode": "background", "graphMode": "none", "textMode": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "values": False}}
USAGE_BANDS = bands((None, "green"), (0.75, "yellow"), (0.9, "red"))
STATES = [{"type": "value", "options": {"0": {"text": "ok", "color": "green", "index": 0},
                                         "3": {"text": "saturated", "color": "red", "index": 1}}}]
TABLE_ROW = 'label_replace(vector({value}), "target", "{name}", "", "")'


def demo_dashboard() -> dict:
    usage = " or ".join(TABLE_ROW.format(value=v, name=n) for n, v in (("a", 0.5), ("b", 0.95), ("c", 0.8)))
    state = " or ".join(TABLE_ROW.format(value=v, name=n) for n, v in (("a", 0), ("b", 3), ("c", 0)))
    table = panel(5, "table", "Worst first", 0, [
        {"expr": state, "format": "table", "instant": True, "range": False, "legendFormat": "State"},
        {"expr": usage, "format": "table", "instant": True, "range": False, "legendFormat": "KV usage"},
    ], {"thresholds": bands((None, "blue"))}, {"showHeader": True, "sortBy": [{"displayName": "KV usage", "desc": True}]},
        transformations=[{"id": "merge", "options": {}}, {"id": "organize", "options": {
            "excludeByName": {"Time": True}, "renameByName": {"Value #A": "State", "Value #B": "KV usage"},
            "indexByName": {"target": 0, "Value #A": 1, "Value #B": 2}}}],
        overrides=[{"matcher": {"id": "byName", "options": "State"}, "properties": [
                       {"id": "mappings", "value": STATES},
                       {"id": "custom.cellOptions", "value": {"type": "color-background", "mode": "basic"}}]},
                   {"matcher": {"id": "byName", "options": "KV usage"}, "properties": [
                       {"id": "unit", "value": "percentunit"}, {"id": "thresholds", "value": USAGE_BANDS},
                       {"id": "custom.cellOptions", "value": {"type": "color-background", "mode": "basic"}}]}])
    table["gridPos"] = {"h": 8, "w": 24, "x": 0, "y": 7}
    timeline = panel(8, "state-timeline", "State lanes", 0, [{"expr": state, "legendFormat": "{{target}}"}],
                     {"unit": "none", "mappings": STATES, "thresholds": bands((None, "blue")), "color": {"mode": "fixed"}},
                     {"showValue": "never", "rowHeight": 0.9, "mergeValues": True})
    timeline["gridPos"] = {"h": 5, "w": 24, "x": 0, "y": 15}
    return {
        "uid": "render-test", "title": "render test", "schemaVersion": 42, "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": []},
        "panels": [
            {"type": "row", "id": 1, "title": "Stats", "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
             "panels": []},
            panel(2, "stat", "Usage", 0, [{"expr": "vector(0.953)", "legendFormat": "usage"}],
                  {"unit": "percentunit", "thresholds": USAGE_BANDS}, STAT),
            panel(3, "stat", "State", 6, [{"expr": "vector(3)", "legendFormat": "state"}],
                  {"unit": "none", "mappings": STATES, "thresholds": bands((None, "blue"))}, STAT),
            panel(4, "stat", "Absent", 12, [{"expr": "kvcache_no_such_series", "legendFormat": "x"}],
                  {"unit": "percentunit", "thresholds": USAGE_BANDS}, STAT),
            panel(6, "timeseries", "Two seconds", 18, [{"expr": "vector(2)", "legendFormat": "two"}],
                  {"unit": "s", "thresholds": bands((None, "green"))},
                  {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["lastNotNull"]},
                   "tooltip": {"mode": "multi", "sort": "desc"}}),
            table,
            timeline,
        ],
    }


@pytest.fixture(scope="module")
def built_page():
    """The page built as `make dashboards-render` builds it (npm ci and Chromium first when missing)."""
    grafana_render.build_page()


@pytest.fixture(scope="module")
def empty_prometheus(tmp_path_factory):
    """A Prometheus with nothing to scrape: vector() and label_replace() need no series."""
    with harness.prometheus(tmp_path_factory.mktemp("prometheus"), {"global": {"scrape_interval": "5s"}}) as prom:
        yield prom.url


def render(prometheus_url: str, dashboard: dict, tmp_path) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(dashboard))
    result = grafana_render.render(prometheus_url, tmp_path / "out", [path])
    return result, grafana_render.displayed(tmp_path / "out", dashboard["uid"])


def test_grafana_draws_values_with_units_colours_mappings_and_the_table_worst_first(built_page, empty_prometheus,
                                                                                     tmp_path):
    result, shown = render(empty_prometheus, demo_dashboard(), tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert [(v["text"], v["colorName"]) for v in shown["Usage"]["values"]] == [("95.3%", "red")]
    assert [(v["text"], v["colorName"]) for v in shown["State"]["values"]] == [("saturated", "red")]
    # No series: Grafana writes "No data" on the first band's colour, here green.
    assert [(v["text"], v["colorName"]) for v in shown["Absent"]["values"]] == [("No data", "green")]
    assert [(row["name"], row["values"]) for row in shown["Two seconds"]["legend"]] == [("two", {"Last *": "2 s"})]
    table = shown["Worst first"]
    assert table["columns"] == ["target", "State", "KV usage"]
    assert [[(cell["text"], cell["colorName"]) for cell in row[1:]] for row in table["rows"]] == [
        [("saturated", "red"), ("95%", "red")],
        [("ok", "green"), ("80%", "yellow")],
        [("ok", "green"), ("50%", "green")],
    ]
    assert [row[0]["text"] for row in table["rows"]] == ["b", "c", "a"]
    assert [(lane["name"], lane["last"], lane["colorName"]) for lane in shown["State lanes"]["lanes"]] == [
        ("a", "ok", "green"), ("b", "saturated", "red"), ("c", "ok", "green")]
    for record in shown.values():
        assert (tmp_path / "out" / "render-test" / record["png"]).stat().st_size > 1000


def test_a_failing_query_is_shown_in_its_panel_and_named_in_the_exit(built_page, empty_prometheus, tmp_path):
    dashboard = demo_dashboard()
    broken = copy.deepcopy(dashboard["panels"][1])
    broken.update(id=7, title="Broken query", gridPos={"h": 6, "w": 6, "x": 0, "y": 20})
    broken["targets"][0]["expr"] = "sum(kvcache_usage_ratio"
    dashboard["panels"].append(broken)
    result, shown = render(empty_prometheus, dashboard, tmp_path)
    assert result.returncode == 1
    assert 'panel "Broken query" (id 7): bad_data' in result.stderr
    assert "bad_data" in shown["Broken query"]["error"]
    assert [v["text"] for v in shown["Usage"]["values"]] == ["95.3%"]  # the others still draw


def missing_values_dashboard() -> dict:
    """The fleet dashboard's own fullest-pool stat and triage table, fed by vector() queries: pool "a" with every
    value, pool "b" without headroom (nothing runs), without preemptions (an engine that does not count them) and
    with a NaN TTFT (histogram_quantile over no requests); the stat with no series at all."""
    fleet = json.loads((grafana_render.GENERATED / "kvcache-fleet.json").read_text())
    by_title = {panel["title"]: panel for panel in panels_of(fleet)}
    stat = copy.deepcopy(by_title["Fullest pool's KV usage"])
    stat["targets"][0]["expr"] = "kvcache_no_such_series"
    stat["gridPos"] = {"h": 4, "w": 6, "x": 0, "y": 1}
    table = copy.deepcopy(by_title["Pools that need help now"])
    table["gridPos"] = {"h": 6, "w": 24, "x": 0, "y": 5}
    values = {"State": (LOW_WATER_CODE + 0.85, 0), "KV usage": (0.953, 0.5), "Headroom": (0.5, None), "Waiting for KV": (2, 0),
              "Waiting with KV room": (0, 0), "Running": (4, 0), "Preempted per min": (3, None),
              "TTFT p90": (1.5, "NaN")}
    for query in table["targets"]:
        pools = zip("ab", values[query["legendFormat"]])
        query["expr"] = " or ".join(TABLE_ROW.format(value=f"scalar(vector(0) / 0)" if v == "NaN" else v, name=name)
                                    for name, v in pools if v is not None)
    return {"uid": "missing-values", "title": "missing values", "schemaVersion": fleet["schemaVersion"],
            "time": {"from": "now-15m", "to": "now"}, "templating": {"list": []},
            "panels": [{"type": "row", "id": 1, "title": "Overview", "collapsed": False,
                        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "panels": []}, stat, table]}


def test_a_missing_value_reads_no_data_on_no_colour_not_in_a_band(built_page, empty_prometheus, tmp_path):
    """Without the dashboards' missing-value mapping Grafana paints an empty cell, and a stat's "No data", in the
    first band's colour (as "Absent" above): an empty green Preempted per min reads "fine", an empty red Headroom
    "short". With it a missing value reads "No data" (a stat: its noValue) on no colour, and a present one keeps
    its band."""
    result, shown = render(empty_prometheus, missing_values_dashboard(), tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    # The stat says what its noValue says (that its group may be off, too), on no colour.
    fleet = json.loads((grafana_render.GENERATED / "kvcache-fleet.json").read_text())
    [says] = [panel["fieldConfig"]["defaults"]["noValue"] for panel in panels_of(fleet)
              if panel["title"] == "Fullest pool's KV usage"]
    assert says.startswith("No data")
    assert [(v["text"], v["colorName"]) for v in shown["Fullest pool's KV usage"]["values"]] == [(says, None)]
    table = shown["Pools that need help now"]
    rows = {row[0]["text"]: {cell["column"]: (cell["text"], cell["colorName"]) for cell in row[1:]}
            for row in table["rows"]}
    assert [row[0]["text"] for row in table["rows"]] == ["a", "b"]  # worst state first
    for column in ("Headroom", "Preempted per min", "TTFT p90"):
        assert rows["b"][column] == ("No data", None), column
        assert rows["a"][column][0] != "No data", column
    # Coloured where a band or a mapping gives the colour a meaning; Running and TTFT have neither: no colour.
    assert rows["a"]["Headroom"][1] is not None and rows["a"]["Preempted per min"][1] is not None
    assert rows["a"]["TTFT p90"] == ("1.50 s", None) and rows["a"]["Running"] == ("4", None)
    # low_water's code with a tie-break, in the contract's words at the default low-water mark
    assert rows["a"]["State"] == ("saturated: queue at or above 75% used", "red")
    assert rows["b"]["State"] == ("ok", "green")
    # KV usage to one decimal in every cell, the precision the State column's sort key ties on (Grafana's own choice
    # writes 50% and 95.3%).
    assert rows["a"]["KV usage"] == ("95.3%", "red") and rows["b"]["KV usage"] == ("50.0%", "green")
    assert rows["a"]["Headroom"][1] == "red" and rows["a"]["Preempted per min"][1] != "green"


def lanes(codes: dict[str, int]) -> str:
    """One series per target, each holding its code (a range query: a lane of one state each); "gappy" holds 0 only
    in the first half of every ten minutes (a lane with gaps Grafana fills with nulls)."""
    gappy = 'label_replace(vector(0) and on() (vector(time()) % 600 < 300), "target", "gappy", "", "")'
    return " or ".join([*(TABLE_ROW.format(value=code, name=name) for name, code in codes.items()), gappy])


def legends_dashboard() -> dict:
    """The fleet dashboard's own "Pressure state over time", "KV usage per target" and the state timeline coloured
    "from thresholds" as it was before, fed by vector() queries."""
    fleet = json.loads((grafana_render.GENERATED / "kvcache-fleet.json").read_text())
    by_title = {panel["title"]: panel for panel in panels_of(fleet)}
    timeline = copy.deepcopy(by_title["Pressure state over time"])
    # Lanes a..e in the order Prometheus sorts them, their states in an order that is not the mappings'.
    timeline["targets"][0]["expr"] = lanes(dict(zip("abcde", (3, 0, 4, 1, 2))))
    thresholds = copy.deepcopy(timeline)
    thresholds.update(id=91, title="Coloured from thresholds")
    thresholds["fieldConfig"]["defaults"]["color"] = {"mode": "thresholds"}
    usage = copy.deepcopy(by_title["KV usage per target"])
    usage["targets"][0]["expr"] = " or ".join(TABLE_ROW.format(value=v, name=f"pool{v:g}") for v in USAGES)
    y = 1
    for panel_json in (timeline, thresholds, usage):
        panel_json["gridPos"] = {**panel_json["gridPos"], "x": 0, "y": y}
        y += panel_json["gridPos"]["h"]
    return {"uid": "legends", "title": "legends", "schemaVersion": fleet["schemaVersion"],
            "time": {"from": "now-15m", "to": "now"}, "templating": {"list": []},
            "panels": [{"type": "row", "id": 1, "title": "Legends", "collapsed": False,
                        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "panels": []}, timeline, thresholds, usage]}


USAGES = (0.25, 0.6, 0.95, 0.1, 0.8, 0.4, 0.7)  # seven pools' KV usage: more than the legend shows unscrolled


def test_state_timelines_show_each_state_in_its_mapping_colour_and_legends_their_worst_lines(
        built_page, empty_prometheus, tmp_path):
    """The pressure state timeline's legend (Grafana's TimelineChart legend: every state the lanes' values display,
    once, in the order the values first show it) lists every state of the contract in the colour its mapping gives
    it, and nothing for the gaps. Coloured "from thresholds" with merged values (as Grafana's defaults are) the same
    lanes are all the base threshold's blue, the mappings ignored: Grafana 12.4's behaviour, which the dashboards
    avoid. "KV usage per target" shows the pools with the highest usage first, the worst LEGEND_ROWS of them without
    scrolling."""
    dashboard = legends_dashboard()
    result, shown = render(empty_prometheus, dashboard, tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    timeline = shown["Pressure state over time"]
    [query] = timeline["queries"]
    order = [int(points[0][1]) for labels, points in grafana_render.answer(empty_prometheus, query)]
    first_shown = list(dict.fromkeys(PRESSURE_STATES[code] for code in order))
    assert sorted(first_shown) == sorted(PRESSURE_STATES)
    assert [(item["name"], item["colorName"]) for item in timeline["legend"]] == [
        (state, STATE_COLORS[state]) for state in first_shown]
    assert {lane["name"]: (lane["last"], lane["colorName"]) for lane in timeline["lanes"]} == {
        **{name: (PRESSURE_STATES[code], STATE_COLORS[PRESSURE_STATES[code]])
           for name, code in zip("abcde", (3, 0, 4, 1, 2))}, "gappy": ("ok", "green")}
    thresholds = shown["Coloured from thresholds"]
    assert [item["colorName"] for item in thresholds["legend"]] == ["blue"]
    assert thresholds["legend"][0]["name"] not in PRESSURE_STATES
    assert {lane["colorName"] for lane in thresholds["lanes"]} == {"blue"}
    legend = shown["KV usage per target"]["legend"]
    worst_first = sorted(USAGES, reverse=True)
    assert [row["name"] for row in legend] == [f"pool{v:g}" for v in worst_first]
    assert [row["name"] for row in legend if row["visible"]] == [f"pool{v:g}" for v in worst_first[:LEGEND_ROWS]]


# Pools for the triage table's own sort key: (reason, KV usage, waiting, up). b, c and d show 23.9 % and tie on it,
# so the longest queue (d) leads them; a shows 23.6 % and waits longer than b and c (a key in whole percent tied
# it with them at 24 and sorted it above both); g and e hold milder reasons than low_water, the two with the
# longest words, g under a pod's long name; f is down.
POD = "g-vllm-llama-3-1-8b-instruct-7d9f8c6b5-x2x9z"
TRIAGE_POOLS = {"a": ("low_water", 0.236, 2, 1), "b": ("low_water", 0.239, 0, 1), "c": ("low_water", 0.2391, 0, 1),
                "d": ("low_water", 0.2389, 4, 1), "e": ("admits_nothing", 0.9, 9, 1),
                POD: ("free_below_request", 0.2, 0, 1), "f": (None, None, None, 0)}
# The other columns' values in every pool that is up: wide ones, for the cells' widths.
TRIAGE_OTHERS = {"Headroom": 1234.5, "Waiting for KV": 12345, "Waiting with KV room": 12345, "Running": 1024,
                 "Preempted per min": 1234.5, "TTFT p90": 123.45}


def triage_dashboard() -> dict:
    """The fleet dashboard's triage table, its State and KV usage queries with each kvcache_* selector replaced by
    vector() rows of TRIAGE_POOLS (the rest of each query, the sort key's arithmetic included, as committed); the
    other columns TRIAGE_OTHERS."""
    fleet = json.loads((grafana_render.GENERATED / "kvcache-fleet.json").read_text())
    [table] = [copy.deepcopy(p) for p in panels_of(fleet) if p["title"] == "Pools that need help now"]
    table["gridPos"] = {"h": 8, "w": 24, "x": 0, "y": 1}

    def rows(values: dict[str, float | None]) -> str:
        """The pools' rows of one series; none: an empty vector."""
        present = [TABLE_ROW.format(value=v, name=name) for name, v in values.items() if v is not None]
        return "(" + (" or ".join(present) or "vector(1) == 0") + ")"

    def series(match: re.Match) -> str:
        name, reason = match.group(1), re.search(r'reason="([a-z_]+)"', match.group(2))
        if name == "kvcache_pressure_reason":
            return rows({n: 1 if pool[0] == reason.group(1) else None for n, pool in TRIAGE_POOLS.items()})
        column = {"kvcache_usage_ratio": 1, "kvcache_requests_waiting": 2, "kvcache_target_up": 3}.get(name)
        return rows({n: pool[column] if column else None for n, pool in TRIAGE_POOLS.items()})

    for query in table["targets"]:
        if query["legendFormat"] in ("State", "KV usage"):
            query["expr"] = re.sub(r"\b(kvcache_[a-z_]+)\{([^}]*)\}", series, query["expr"])
        else:
            query["expr"] = rows({n: TRIAGE_OTHERS[query["legendFormat"]] if pool[3] else None
                                  for n, pool in TRIAGE_POOLS.items()})
    return {"uid": "triage", "title": "triage", "schemaVersion": fleet["schemaVersion"],
            "time": {"from": "now-15m", "to": "now"}, "templating": {"list": []},
            "panels": [{"type": "row", "id": 1, "title": "Triage", "collapsed": False,
                        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "panels": []}, table]}


def test_the_triage_table_ties_on_the_usage_its_cells_show(built_page, empty_prometheus, tmp_path):
    """Its State column's sort key, as Grafana sorts and draws it: the down pool first, then the worst reason, then
    the fullest by the KV usage the cells show (one decimal of a percent), then the longest queue. At the
    renderer's 1,200 px no cell or header is cut short, the longest reasons' words and a pod's name included
    (wrapped onto more lines)."""
    result, shown = render(empty_prometheus, triage_dashboard(), tmp_path)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    table = shown["Pools that need help now"]
    order = [row[0]["text"] for row in table["rows"]]
    usage = {row[0]["text"]: next(cell["text"] for cell in row[1:] if cell["column"] == "KV usage")
             for row in table["rows"]}
    assert {name: usage[name] for name in [*"abcde", POD]} == {
        "a": "23.6%", "b": "23.9%", "c": "23.9%", "d": "23.9%", "e": "90.0%", POD: "20.0%"}
    assert order[:2] == ["f", "d"] and sorted(order[2:4]) == ["b", "c"] and order[4:] == ["a", POD, "e"], order
    assert table["clippedColumns"] == []
    assert [(row[0]["text"], cell["column"], cell["text"]) for row in table["rows"] for cell in row
            if cell["clipped"]] == []
