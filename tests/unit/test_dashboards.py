"""The dashboards' source, the committed JSON and what the JSON says (thresholds, variables, links)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.dashboards import bands, build, fleet, target
from kvcache_exporter.dashboards import variables as variables_module
from kvcache_exporter.dashboards.signals import triage
from devtools import build_dashboards, lint_dashboards as lint
from kvcache_exporter.contract import PRESSURE_STATES
from kvcache_exporter.thresholds import DEFAULT, Thresholds

FILES = (fleet.FILENAME, target.FILENAME)


def committed(name: str) -> dict:
    return json.loads((build.GENERATED / name).read_text())


def panel(dashboard: dict, title: str) -> dict:
    matches = [p for p in lint.panels(dashboard) if p["title"] == title]
    assert len(matches) == 1, f"{len(matches)} panels titled {title!r}"
    return matches[0]


def steps(panel_json: dict, ref_id: str | None = None) -> list[tuple[float | None, str]]:
    """The colour steps of a panel, or of one query's override."""
    if ref_id is None:
        config = panel_json["fieldConfig"]["defaults"]["thresholds"]
    else:
        [override] = [o for o in panel_json["fieldConfig"]["overrides"] if o["matcher"]["options"] == ref_id]
        [config] = [p["value"] for p in override["properties"] if p["id"] == "thresholds"]
    return [(step["value"], step["color"]) for step in config["steps"]]


def test_committed_json_is_what_the_source_builds(capsys):
    for name, dashboard in build.build_all().items():
        assert (build.GENERATED / name).read_text() == build.render(dashboard), f"{name}: run `make dashboards`"
    assert (build_dashboards.main(["--check"]), capsys.readouterr().err) == (0, "")


def test_check_fails_on_drift_and_a_build_repairs_it(tmp_path):
    for name in FILES:
        shutil.copy(build.GENERATED / name, tmp_path / name)
    assert build_dashboards.main(["--check", "--out", str(tmp_path)]) == 0

    edited = committed(fleet.FILENAME)
    edited["title"] = "edited by hand"
    (tmp_path / fleet.FILENAME).write_text(json.dumps(edited, indent=2) + "\n")
    (tmp_path / target.FILENAME).unlink()
    assert build_dashboards.drifted({n: (build.GENERATED / n).read_text() for n in FILES}, tmp_path) == list(FILES)
    assert build_dashboards.main(["--check", "--out", str(tmp_path)]) == 1

    assert build_dashboards.main(["--out", str(tmp_path)]) == 0
    assert build_dashboards.main(["--check", "--out", str(tmp_path)]) == 0
    assert (tmp_path / fleet.FILENAME).read_text() == (build.GENERATED / fleet.FILENAME).read_text()


@pytest.mark.parametrize("name", FILES)
def test_generated_json_loads_back_through_the_sdk_models(name):
    text = (build.GENERATED / name).read_text()
    loaded = models.Dashboard.from_json(json.loads(text))
    assert isinstance(loaded, models.Dashboard)
    assert json.dumps(loaded, cls=JSONEncoder, indent=2) + "\n" == text
    # The typed model holds every panel, not a dict it passed through.
    row_count = sum(isinstance(p, models.RowPanel) for p in loaded.panels)
    assert row_count == sum(p["type"] == "row" for p in json.loads(text)["panels"]) >= 6
    assert all(isinstance(p, (models.Panel, models.RowPanel)) for p in loaded.panels)


def test_dashboards_identity_and_conventions():
    for name, uid in ((fleet.FILENAME, "kvcache-fleet"), (target.FILENAME, "kvcache-target")):
        dashboard = committed(name)
        assert dashboard["uid"] == uid
        assert dashboard["schemaVersion"] == 42
        assert "kvcache" in dashboard["tags"]
        datasource = dashboard["templating"]["list"][0]
        assert (datasource["name"], datasource["type"]) == ("datasource", "datasource")
        assert datasource["query"] == "prometheus"
        alerts, *concerned = dashboard["annotations"]["list"]
        # Alerts of the targets the variable selects, and those about the exporter itself (no target); those
        # about one signal are drawn on its time series only, the others on every panel.
        assert alerts["target"]["expr"] == (
            'ALERTS{alertstate="firing", alertname!~"KVCacheShortageQueueing|KVCachePreemptionStorm|'
            'KVCacheNearlyFull|KVCachePrefixHitRateDrop|KVCacheQueueDominatesTTFT|KVCacheTargetDown", '
            'alertname=~"KVCache.*", target=~"$target"} or ALERTS{alertstate="firing", alertname!~"KVCacheShortage'
            'Queueing|KVCachePreemptionStorm|KVCacheNearlyFull|KVCachePrefixHitRateDrop|KVCacheQueueDominatesTTFT|'
            'KVCacheTargetDown", alertname=~"KVCache.*", target=""}')
        assert alerts["datasource"]["uid"] == "${datasource}" and "filter" not in alerts
        by_id = {p["id"]: p for p in lint.panels(dashboard)}
        drawn_on = {a["name"]: [by_id[i]["title"] for i in a["filter"]["ids"]] for a in concerned}
        assert all(a["target"]["expr"].startswith(f'ALERTS{{alertstate="firing", alertname="{a["name"]}"')
                   and not a["filter"]["exclude"] for a in concerned)
        per_ = per(dashboard)
        assert sorted(drawn_on["KVCacheShortageQueueing"]) == [
            f"Headroom {per_}", "Pressure state over time", f"Waiting requests by cause {per_}"]
        assert drawn_on["KVCachePreemptionStorm"] == ["Pressure state over time", f"Preemption rate {per_}"]
        assert drawn_on["KVCacheNearlyFull"] == [f"KV usage {per_}", f"Time until full {per_}"]
        assert drawn_on["KVCacheTargetDown"] == ["Targets up over time"]
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        titles = [p["title"] for p in lint.panels(dashboard)]
        assert len(titles) == len(set(titles)), "panel titles name panels in docs and tests: keep them unique"
        # Panels tile the 24-column grid without overlapping.
        cells = set()
        for p in dashboard["panels"]:
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not cells & area, p["title"]
            cells |= area


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_fleet_variables_filter_by_static_labels_namespace_engine_model_pod_and_target():
    fleet_vars = variables(committed(fleet.FILENAME))
    assert list(fleet_vars) == ["datasource", "cluster", "pool", "namespace", "engine", "model", "pod", "target"]
    for name in ("cluster", "pool", "namespace", "engine", "model", "pod", "target"):
        assert fleet_vars[name]["multi"] and fleet_vars[name]["includeAll"]
        assert fleet_vars[name]["allValue"] == ".*"
    # Each filter lists only values that the filters before it allow (a per-target family has no model).
    assert fleet_vars["target"]["query"] == (
        'label_values(kvcache_target_up{cluster=~"$cluster", pool=~"$pool", namespace=~"$namespace", '
        'engine=~"$engine", pod=~"$pod"}, target)')
    assert fleet_vars["model"]["query"].startswith("label_values(kvcache_usage_ratio{")

    target_vars = variables(committed(target.FILENAME))
    assert list(target_vars) == ["datasource", "cluster", "pool", "namespace", "target"]
    assert not target_vars["target"]["multi"] and not target_vars["target"]["includeAll"]


def test_the_namespace_and_pod_filters_are_the_labels_kubernetes_probe_mode_sets():
    from deploy.kubernetes import probe
    from deploy.kubernetes.deployment import Deployment

    relabeled = {rule.get("target_label") for rule in probe.relabel_rules(Deployment())}
    assert {variables_module.NAMESPACE, variables_module.POD} <= relabeled
    # A static label named like one of them is one filter, not two.
    board = json.loads(build.render(build.build_all(static_labels=("namespace", "pool"))[fleet.FILENAME]))
    assert list(variables(board)) == ["datasource", "namespace", "pool", "engine", "model", "pod", "target"]


def test_bands_and_descriptions_come_from_thresholds():
    custom = Thresholds(high_water_ratio=0.8, low_water_ratio=0.6, thrashing_preemptions_per_second=0.05,
                        preemption_storm_critical_per_second=2.0, queue_share_of_ttft=0.3,
                        prefix_hit_drop_fraction=0.4, prefix_hit_baseline_offset="2h",
                        traffic_floor_prefix_tokens_per_second=25.0)
    for thresholds in (DEFAULT, custom):
        built = {name: json.loads(build.render(d)) for name, d in build.build_all(thresholds).items()}
        for dashboard in built.values():
            usage = [(None, "green"), (thresholds.low_water_ratio, "yellow"), (thresholds.high_water_ratio, "red")]
            assert steps(panel(dashboard, f"KV usage {per(dashboard)}")) == usage
            assert steps(panel(dashboard, "Fullest pool's KV usage")) == usage
            assert steps(panel(dashboard, f"Preemption rate {per(dashboard)}")) == [
                (None, "green"), (thresholds.thrashing_preemptions_per_second, "red"),
                (thresholds.preemption_storm_critical_per_second, "dark-red")]
            most = "Most preemptions per minute" if per(dashboard) == "per target" else "Preemptions per minute"
            assert steps(panel(dashboard, most)) == [
                (None, "green"), (pytest.approx(thresholds.thrashing_preemptions_per_second * 60), "red"),
                (pytest.approx(thresholds.preemption_storm_critical_per_second * 60), "dark-red")]
            assert steps(panel(dashboard, "Share of TTFT spent queueing")) == [
                (None, "green"), (thresholds.queue_share_of_ttft, "red")]
            baseline = panel(dashboard, "Hit ratio vs baseline")
            assert steps(baseline) == [(None, "red"), (thresholds.prefix_hit_drop_fraction, "green")]
            expr = baseline["targets"][0]["expr"]
            assert f"offset {thresholds.prefix_hit_baseline_offset})" in expr
            assert f">= {thresholds.traffic_floor_prefix_tokens_per_second:g})" in expr
            assert f"{thresholds.high_water_ratio:.0%}" in panel(dashboard, "Fullest pool's KV usage")["description"]
            until_full = panel(dashboard, f"Time until full {per(dashboard)}")
            assert steps(until_full) == [(None, "red"), (thresholds.nearly_full_horizon_seconds, "green")]
            assert f">= {thresholds.low_water_ratio:g})" in until_full["targets"][0]["expr"]
            assert steps(panel(dashboard, f"Headroom {per(dashboard)}")) == [(None, "red"), (1, "green")]
    # The committed JSON was built with the defaults.
    assert steps(panel(committed(fleet.FILENAME), "Fullest pool's KV usage"))[-1] == (DEFAULT.high_water_ratio, "red")


def per(dashboard: dict) -> str:
    return "per target" if dashboard["uid"] == "kvcache-fleet" else "per rank"


def test_counts_where_one_is_a_problem_turn_red_at_one():
    dashboard = committed(fleet.FILENAME)
    assert steps(panel(dashboard, "Targets up"), "B") == [(None, "green"), (1, "red")]
    assert steps(panel(dashboard, "Waiting requests"), "A") == [(None, "green"), (1, "red")]
    assert steps(panel(dashboard, "Waiting requests"), "B") == [(None, "green"), (1, "yellow")]
    assert steps(panel(dashboard, "Pools without room for one more request")) == [(None, "green"), (1, "red")]
    states = panel(dashboard, "Targets per pressure state")
    assert [t["legendFormat"] for t in states["targets"]] == ["ok", "tight", "capped", "saturated", "thrashing", "down"]
    assert [steps(states, ref)[-1][1] for ref in "BCDEF"] == ["yellow", "orange", "red", "dark-red", "purple"]


def test_configuration_moves_bands_and_names_the_label_variables(tmp_path, capsys):
    config = tmp_path / "exporter.yml"
    config.write_text(
        "labels: {region: eu}\n"
        "pressure: {high_water_ratio: 0.85}\n"
        "targets:\n"
        "  - {url: 'http://a:8000/metrics', labels: {pool: chat, team: gold}}\n"
        "  - {url: 'http://b:8000/metrics'}\n"
    )
    thresholds, labels, pd_group_label = build.settings_from(config)
    assert thresholds.high_water_ratio == 0.85 and thresholds.low_water_ratio == DEFAULT.low_water_ratio
    assert labels == ("region", "pool", "team") and pd_group_label == "model"
    assert build_dashboards.main(["--config", str(config), "--out", str(tmp_path)]) == 0
    built = json.loads((tmp_path / fleet.FILENAME).read_text())
    assert list(variables(built)) == ["datasource", "region", "pool", "team", "namespace", "engine", "model", "pod",
                                      "target"]
    assert steps(panel(built, "Fullest pool's KV usage"))[-1] == (0.85, "red")
    assert 'team=~"$team"' in panel(built, "Fullest pool's KV usage")["targets"][0]["expr"]

    config.write_text("pressure: {no_such_threshold: 1}\n")
    assert build_dashboards.main(["--config", str(config), "--out", str(tmp_path / "not-written")]) == 2
    assert "pressure.no_such_threshold: unknown key" in capsys.readouterr().err
    assert not (tmp_path / "not-written").exists()
    config.write_text("pressure: {}\n")
    assert build.settings_from(config)[1] == build.DEFAULT_STATIC_LABELS


def test_fleet_series_drill_down_to_the_target_dashboard():
    fleet_json, target_json = committed(fleet.FILENAME), committed(target.FILENAME)
    target_variables = set(variables(target_json))
    linked = []
    for p in lint.panels(fleet_json):
        # A table keeps the target label as a column; a graph names it in its legend.
        per_target = p["type"] == "table" or any("{{target}}" in t["legendFormat"] for t in p["targets"])
        links = p["fieldConfig"]["defaults"].get("links", [])
        assert bool(links) == per_target, p["title"]
        for link in links:
            url = link["url"]
            assert url.startswith(f"/d/{target_json['uid']}/")
            assert "var-target=${__field.labels.target}" in url
            passed = set(re.findall(r"\$\{(\w+):queryparam\}", url)) | set(re.findall(r"var-(\w+)=", url))
            assert passed == target_variables, p["title"]
            linked.append(p["title"])
    assert {"KV usage per target", "Pressure state over time", "Preemption rate per target",
            "Share of TTFT spent queueing", "Targets up over time", "Pools that need help now",
            "Headroom per target", "Time to first token p90"} <= set(linked)
    # Both dashboards link to each other through their shared tag, keeping time and variables.
    for dashboard in (fleet_json, target_json):
        [link] = dashboard["links"]
        assert (link["type"], link["tags"]) == ("dashboards", ["kvcache"])
        assert link["includeVars"] and link["keepTime"]


def test_target_dashboard_details():
    dashboard = committed(target.FILENAME)
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "KV", "Pressure", "Prefix cache", "Offload tiers", "What more KV would buy", "Latency",
                    "KV memory", "Disaggregated prefill/decode", "Exporter health"]
    heatmaps = {p["title"]: p for p in lint.panels(dashboard) if p["type"] == "heatmap"}
    assert set(heatmaps) == {"Time to first token distribution", "Queue time distribution"}
    for p in heatmaps.values():
        [query] = p["targets"]
        assert query["format"] == "heatmap" and p["options"]["calculate"] is False
        assert query["expr"].startswith("sum by (le, target) (increase(")
    memory = " ".join(t["expr"] for p in lint.panels(dashboard) for t in p["targets"] if "bytes" in t["expr"])
    for metric in ("kvcache_bytes_per_token", "kvcache_capacity_bytes", "kvcache_used_bytes"):
        assert metric in memory
    # Per-pool lines are split by data-parallel rank inside the target.
    assert "max by (target, dp_rank)" in panel(dashboard, "KV usage per rank")["targets"][0]["expr"]
    fleet_usage = panel(committed(fleet.FILENAME), "KV usage per target")
    assert steps(panel(dashboard, "KV usage per rank")) == steps(fleet_usage)


def test_ratios_divide_sums_and_quantiles_keep_one_bucket_layout():
    dashboard = committed(fleet.FILENAME)
    hit = panel(dashboard, "Prefix-cache hit ratio per target")["targets"][0]["expr"]
    assert re.fullmatch(
        r"sum by \(target\) \(rate\(kvcache_prefix_cache_hit_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) / "
        r"\(sum by \(target\) \(rate\(kvcache_prefix_cache_queried_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) "
        r"> 0\)", hit)
    share = panel(dashboard, "Share of TTFT spent queueing")["targets"][0]["expr"]
    assert share.startswith("((clamp_max(sum by (target) (rate(kvcache_queue_time_seconds_sum{")
    assert "/ (sum by (target) (rate(kvcache_time_to_first_token_seconds_sum{" in share
    assert f"kvcache_e2e_request_latency_seconds_count" in share and f">= {DEFAULT.traffic_floor_requests_per_second:g}" in share
    assert "_bucket" not in share
    for name in FILES:
        for p in lint.panels(committed(name)):
            for t in p["targets"]:
                for labels in re.findall(r"histogram_quantile\([0-9.]+, sum by \(([^)]*)\)", t["expr"]):
                    assert "target" in labels.split(", "), (p["title"], t["expr"])


def test_pressure_state_codes_follow_the_exporters_states():
    assert set(bands.STATE_COLORS) == set(PRESSURE_STATES)
    for name in FILES:
        timeline = panel(committed(name), "Pressure state over time")
        [mapping] = [m for m in timeline["fieldConfig"]["defaults"]["mappings"] if m["type"] == "value"]
        assert [mapping["options"][str(code)]["text"] for code in range(len(PRESSURE_STATES))] == list(PRESSURE_STATES)
        expr = timeline["targets"][0]["expr"]
        for code, state in enumerate(PRESSURE_STATES):
            assert f'state="{state}"}} * {code}' in expr


def test_the_grafana_version_the_docs_state_is_the_one_tested():
    """The compose stack's Grafana, the renderer's and the schema's packages are one version, and the README and
    docs/dashboards.md name it."""
    repo = build.GENERATED.parents[1]
    (compose,) = re.findall(r"image: grafana/grafana:(\S+)", (repo / "docker-compose.yml").read_text())
    packages = json.loads((repo / "devtools" / "grafana-render" / "package.json").read_text())["dependencies"]
    assert {version for name, version in packages.items() if name.startswith("@grafana/")} == {compose}
    minor = ".".join(compose.split(".")[:2])
    assert re.findall(r"Tested against Grafana (\S+?):", (repo / "docs" / "dashboards.md").read_text()) == [minor]
    assert re.findall(r"\*\*Grafana (\S+)\*\*: the version the dashboards are tested against",
                      (repo / "README.md").read_text()) == [minor]


def test_the_pd_rows_read_prefill_and_decode_pools_only():
    """Every query of both dashboards' P/D rows selects role prefill or decode: a unified vLLM pool with an
    offload connector exports the stage gauge for its loads from the offload tier, no transfer between pools."""
    for name in FILES:
        dashboard = committed(name)
        rows = [p for p in dashboard["panels"] if p["type"] == "row"]
        start = next(i for i, p in enumerate(dashboard["panels"]) if p.get("title") == "Disaggregated prefill/decode")
        following = dashboard["panels"][start + 1:]
        end = next((i for i, p in enumerate(following) if p["type"] == "row"), len(following))
        panels = following[:end] + next(r for r in rows if r["title"] == "Disaggregated prefill/decode").get(
            "panels", [])
        assert len(panels) >= 4, name
        for p in panels:
            for t in p["targets"]:
                for selector in re.findall(r"kvcache_[a-z_]+\{[^}]*\}", t["expr"]):
                    assert 'role=~"prefill|decode"' in selector, (name, p["title"], selector)


def test_on_call_reads_the_worst_first_and_why():
    """Legends list the worst line first (the highest last value, the lowest where less is worse), state timelines
    carry their colour legend, the triage table's State says why in the contract's words with the down code above
    them, and the fullest pool's stat names its pool."""
    for name in (fleet.FILENAME, target.FILENAME):
        dashboard = committed(name)
        per_ = per(dashboard)
        low_first = {f"Headroom {per_}", f"Time until full {per_}", f"Prefix-cache hit ratio {per_}"}
        for p in lint.panels(dashboard):
            if p["type"] == "timeseries":
                legend = p["options"]["legend"]
                assert (legend["sortBy"], legend["showLegend"]) == ("Last *", True), p["title"]
                assert "lastNotNull" in legend["calcs"], p["title"]
                assert legend["sortDesc"] == (p["title"] not in low_first), p["title"]
            elif p["type"] == "state-timeline":
                assert p["options"]["legend"]["showLegend"], p["title"]
                # Merged values coloured "from thresholds" would draw each lane in its threshold step's colour,
                # mappings ignored (Grafana's issues 41075, 71804): a fixed scheme leaves the colours to the mappings.
                assert (p["options"]["mergeValues"], p["fieldConfig"]["defaults"]["color"]["mode"]) == (True, "fixed")
                mappings = p["fieldConfig"]["defaults"]["mappings"]
                assert {"type": "special", "options": {"match": "null+nan", "result": {
                    "text": "", "color": "transparent"}}} in mappings, p["title"]
        timeline = panel(dashboard, "Pressure state over time")
        [codes] = [m["options"] for m in timeline["fieldConfig"]["defaults"]["mappings"] if m["type"] == "value"]
        assert {code: (named["text"], named["color"]) for code, named in codes.items()} == {
            str(code): (state, bands.STATE_COLORS[state]) for code, state in enumerate(PRESSURE_STATES)}
        fullest = panel(dashboard, "Fullest pool's KV usage")
        assert fullest["targets"][0]["legendFormat"] == "{{target}} rank {{dp_rank}}"
        assert fullest["targets"][0]["instant"] and fullest["options"]["textMode"] == "value_and_name"
    dashboard = committed(fleet.FILENAME)
    table = panel(dashboard, "Pools that need help now")
    [state] = [o for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "State"]
    properties = {p["id"]: p["value"] for p in state["properties"]}
    ranges = [m["options"] for m in properties["mappings"] if m["type"] == "range"]
    # One range per reason, mildest first, then down; each [code, code + 1) so the tie-break reads as its code.
    assert [(r["from"], r["result"]["text"]) for r in ranges] == [
        (0, "ok"), (1, "tight: at or above the high-water mark 90%"), (2, "capped: a concurrency or batch cap, not KV"),
        (3, "capped: none running, the engine admits nothing"),
        (4, "saturated: preempted just now for KV"), (5, "saturated: less KV free than one request holds"),
        (6, "saturated: queue at or above 75% used"), (7, "thrashing: preempting to free KV"),
        (8, "down: the exporter cannot poll it")]
    assert all(r["to"] < r["from"] + 1 for r in ranges)
    assert [r["result"]["color"] for r in ranges] == ["green", "yellow", "orange", "orange", "red", "red", "red",
                                                      "dark-red", "purple"]
    assert properties["custom.width"] == triage.STATE_WIDTH
    # The stat beside it counts each target once, by its worst rank, and the down ones: its counts add up to the rows.
    states = panel(dashboard, "Targets per pressure state")
    for query, state in zip(states["targets"], ("ok", "tight", "capped", "saturated", "thrashing")):
        assert query["expr"].startswith("count ((max by (target) (") and query["expr"].endswith(
            f") == {('ok', 'tight', 'capped', 'saturated', 'thrashing').index(state)}) or vector(0)"), state
    assert states["targets"][5]["expr"].startswith('count (kvcache_target_up{') and "== 0" in states["targets"][5]["expr"]
