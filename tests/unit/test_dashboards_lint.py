"""The lint over the generated JSON, and proof that each of its rules catches what it is for."""

from __future__ import annotations

import copy
import json

import pytest

from kvcache_exporter.dashboards import build, fleet, target
from devtools import build_dashboards, lint_dashboards as lint

FILES = (fleet.FILENAME, target.FILENAME)


def committed(name: str) -> dict:
    return json.loads((build.GENERATED / name).read_text())


@pytest.mark.parametrize("name", FILES)
def test_generated_dashboards_pass_the_lint(name):
    dashboard = committed(name)
    assert lint.problems(dashboard) == []
    exprs = [expr for _, expr in lint.queries(dashboard)]
    assert len(exprs) >= 30
    # The checks saw the contract: every query reads at least one series, all of them kvcache_* or ALERTS.
    names = {n for expr in exprs for n in lint.metric_names(expr)}
    assert all(lint.metric_names(expr) for expr in exprs)
    assert {n for n in names if not n.startswith("kvcache_")} == {"ALERTS"}
    assert all("rate(" not in expr or "[$__rate_interval]" in expr for expr in exprs)


@pytest.mark.parametrize("expr, problem", [
    ('sum(vllm:kv_cache_usage_perc{model_name="m"})', "raw engine series (vllm:)"),
    ("sum(rate(sglang:num_retracted_requests_total[$__rate_interval]))", "raw engine series (sglang:)"),
    ("sum(up)", "reads up, which is not in the kvcache_* contract"),
    ("sum(kvcache_prefix_cache_hit_tokens_total) / sum(kvcache_prefix_cache_queried_tokens_total)",
     "uses counter kvcache_prefix_cache_hit_tokens_total outside rate()/increase()"),
    ("sum(rate(kvcache_preemptions_total[5m]))", "range [5m] is not [$__rate_interval]"),
    ("histogram_quantile(0.9, rate(kvcache_queue_time_seconds_bucket[$__rate_interval]))",
     "histogram_quantile() without sum by (le, ...)"),
    ("histogram_quantile(0.9, sum by (target) (rate(kvcache_queue_time_seconds_bucket[$__rate_interval])))",
     "histogram_quantile() without sum by (le, ...)"),
    ("avg by (pool) (kvcache_usage_ratio)", "sums or averages a ratio gauge"),
    # A misspelt contract name reads nothing: the lint knows the contract's names, not just its prefix.
    ("max(kvcache_usage_ratios)", "reads kvcache_usage_ratios, which is not in the kvcache_* contract"),
    ("sum(kvcache_requests_waiting_for_kv_room)", "reads kvcache_requests_waiting_for_kv_room, which is not"),
    ("histogram_quantile(0.9, sum by (le) (rate(kvcache_time_to_first_token_seconds_bucket[$__rate_interval])))",
     "drops target and engine"),
    ("histogram_quantile(0.9, sum by (le, pool) (rate(kvcache_time_to_first_token_seconds_bucket[$__rate_interval])))",
     "drops target and engine"),
    ("histogram_quantile(0.9, sum by (le, target) (rate(kvcache_queue_time_seconds_bucket[$__rate_interval]))) / "
     "(histogram_quantile(0.9, sum by (le, target) (rate(kvcache_time_to_first_token_seconds_bucket"
     "[$__rate_interval]))) > 0)", "divides one histogram_quantile() by another"),
    ("clamp_max(max by (target) (histogram_quantile(0.9, sum by (le, target) (rate(kvcache_queue_time_seconds_bucket"
     "[$__rate_interval])))) / max by (target) (histogram_quantile(0.9, sum by (le, target) "
     "(rate(kvcache_time_to_first_token_seconds_bucket[$__rate_interval])))), 1)",
     "divides one histogram_quantile() by another"),
    ("sum(kvcache_time_to_first_token_seconds_sum) / sum(kvcache_time_to_first_token_seconds_count)",
     "uses counter kvcache_time_to_first_token_seconds_count outside rate()/increase()"),
    ("", "empty query"),
])
def test_lint_catches(expr, problem):
    found = lint.expression_problems(expr)
    assert any(problem in p for p in found), found


@pytest.mark.parametrize("expr", [
    'sum by (le) (increase(kvcache_queue_time_seconds_bucket{target=~"$target"}[$__rate_interval]))',
    "sum(rate(kvcache_preemptions_total[$__rate_interval] offset 1h)) * 60",
    "histogram_quantile(0.99, sum by (le, target) "
    "(rate(kvcache_inter_token_latency_seconds_bucket[$__rate_interval])))",
    "time() - max by (target) (kvcache_target_last_success_timestamp_seconds)",
    'count(kvcache_target_up{engine=~"$engine"} == 0) or vector(0)',
    'max(kvcache_usage_ratio{target="a:8000"})',
    "histogram_quantile(0.9, sum by (le, engine) (rate(kvcache_queue_time_seconds_bucket[$__rate_interval])))",
    "clamp_max(sum by (target) (rate(kvcache_queue_time_seconds_sum[$__rate_interval])) / "
    "(sum by (target) (rate(kvcache_time_to_first_token_seconds_sum[$__rate_interval])) > 0), 1)",
    "max(histogram_quantile(0.9, sum by (le, target) (rate(kvcache_queue_time_seconds_bucket[$__rate_interval]))))"
    " / 60",
])
def test_lint_accepts(expr):
    assert lint.expression_problems(expr) == []


def test_lint_checks_panels_annotations_and_variables():
    broken = copy.deepcopy(committed(fleet.FILENAME))
    panels = [p for p in broken["panels"] if p["type"] != "row"]
    panels[0]["datasource"] = {"type": "prometheus", "uid": "some-fixed-uid"}
    panels[1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "some-fixed-uid"}
    del panels[2]["fieldConfig"]["defaults"]["unit"]
    panels[3]["description"] = "Shows something."
    panels[4]["targets"] = []
    broken["annotations"]["list"][0]["datasource"] = None
    [target_variable] = [v for v in broken["templating"]["list"] if v["name"] == "target"]
    target_variable["query"] = "label_values(vllm:num_requests_running, target)"
    # Panels inside a collapsed row are checked too.
    hidden = copy.deepcopy(panels[5])
    hidden["targets"][0]["expr"] = "sum(kvcache_preemptions_total)"
    broken["panels"].append({"type": "row", "collapsed": True, "title": "hidden", "panels": [hidden],
                             "gridPos": {"h": 1, "w": 24, "x": 0, "y": 999}, "id": 999})

    found = "\n".join(lint.problems(broken))
    titles = [p["title"] for p in panels]
    assert f"panel {titles[0]!r}: datasource is" in found
    assert f"panel {titles[1]!r} query A: datasource is" in found
    assert f"panel {titles[2]!r}: no unit" in found
    assert f"panel {titles[3]!r}: description does not say what to do when it is red" in found
    assert f"panel {titles[4]!r}: no query" in found
    assert "annotation 'Firing KV-cache alerts': datasource is None" in found
    assert "variable 'target': names a raw engine series (vllm:)" in found
    assert "uses counter kvcache_preemptions_total outside rate()/increase()" in found
    assert len(lint.problems(broken)) == 9


def test_build_refuses_to_write_a_dashboard_that_fails_the_lint(tmp_path, monkeypatch, capsys):
    original = build.build_all

    def with_a_raw_engine_query(*args):
        built = original(*args)
        built[fleet.FILENAME].panels[1].targets[0].expr = "sum(vllm:num_requests_waiting)"
        return built

    monkeypatch.setattr(build_dashboards, "build_all", with_a_raw_engine_query)
    assert build_dashboards.main(["--out", str(tmp_path)]) == 2
    assert "raw engine series (vllm:)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
