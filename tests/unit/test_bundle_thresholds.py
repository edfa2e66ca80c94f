"""One configuration, one set of numbers: `kvcache-exporter assets --config` with any one threshold changed writes the
new value into every output that states that threshold (the rules, the runbook, the dashboards), leaves the others
byte for byte, and leaves the old value nowhere it stood: in no rule, runbook section or panel that the change
touched, unless another threshold of that rule, section or panel has the same value."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest
import yaml

from kvcache_exporter.alerts import runbook
from kvcache_exporter.alerts.rules import pressure
from kvcache_exporter.commands import assets
from kvcache_exporter.thresholds import DEFAULT
from kvcache_exporter.units import format_duration

NAMES = [f.name for f in fields(DEFAULT)]
# The thresholds the dashboards draw (a band, a line or a number in a description): the usage bands, the preemption
# bands, the traffic floors the panels share with the alerts, the share and ratio bands, the time-to-full horizon,
# the offload, transfer and TTFT bounds, and the state's window (the preemption panels say which window the state
# reads beside their own). The others are the rules' alone (durations, windows of rules, the
# P/D and fleet alerts' shares).
DRAWN = {"high_water_ratio", "low_water_ratio", "thrashing_preemptions_per_second",
         "preemption_storm_critical_per_second", "traffic_floor_requests_per_second",
         "traffic_floor_prefix_tokens_per_second", "prefix_hit_drop_fraction", "prefix_hit_baseline_offset",
         "capacity_miss_share", "queue_share_of_ttft", "nearly_full_horizon_seconds",
         "offload_load_max_seconds_per_token", "kv_transfer_failure_ratio", "kv_transfer_link_bytes_per_second",
         "kv_transfer_bandwidth_low_fraction", "shortage_critical_ttft_seconds", "window_seconds",
         "routing_loss_share", "preemption_demand_share"}
# Read by the exporter alone (it decides the pressure state `thrashing`, which the rules read as a state).
EXPORTER_ONLY = {"thrashing_preemptions_per_second"}


def changed(name: str):
    """A value no default has, in every form the outputs print."""
    default = getattr(DEFAULT, name)
    if isinstance(default, str):
        return "17m"
    if name == "high_water_ratio":
        return 0.97  # the configuration requires it above low_water_ratio
    if name.endswith(("_ratio", "_fraction", "_share", "_of_ttft")):
        return 0.37
    return default * 7


def forms(name: str, value) -> set[str]:
    """How the outputs print a threshold's value: as the rules do (0.9, 2m, 1800), and a ratio as a percentage (90%),
    a duration in seconds as one (30m), a rate per second also per minute (the preemption panels), the link rate in
    GB/s, the seconds to load a token as tokens per second."""
    if isinstance(value, str):
        return {value}
    found = {f"{value:g}", json.dumps(value)}
    if name.endswith(("_ratio", "_fraction", "_share", "_of_ttft")):
        found |= {f"{value * 100:g}%", f"{value:.0%}"}
    elif name in ("window_seconds", "nearly_full_horizon_seconds"):
        found.add(format_duration(value))
    elif name.endswith("_preemptions_per_second") or name.startswith("preemption_storm"):
        found |= {f"{value * 60:g}", json.dumps(value * 60)}  # as a label and as a panel threshold
    elif name == "kv_transfer_link_bytes_per_second":
        found.add(f"{value / 1e9:g}")
    elif name == "offload_load_max_seconds_per_token":
        found.add(f"{1 / value:,.0f}")
    return found


def occurs(form: str, text: str) -> bool:
    return re.search(rf"(?<![\w.,]){re.escape(form)}(?![\w%]|\.\d|,\d)", text) is not None


def parts(files: dict[str, bytes]) -> dict[tuple[str, str], str]:
    """(output, unit) -> text: each rule, each runbook section, each dashboard panel's description and bands."""
    found = {}
    for group in yaml.safe_load(files[assets.RULES])["groups"]:
        for rule in group["rules"]:
            key = rule.get("alert", rule.get("record")) + repr(rule.get("labels"))
            # A rate's factor to per minute is seconds in a minute, whatever the window (60 s by default) says.
            found["rules", key] = yaml.safe_dump(rule).replace(pressure.PER_MINUTE + "rate(", "rate(")
    for title, body in runbook.sections(files[assets.RUNBOOK].decode()):
        found["runbook", title] = body
    for path, content in files.items():
        if path.startswith("dashboards/"):
            for panel in _panels(json.loads(content)):
                bands = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds")
                found["dashboards", f"{path}:{panel['title']}:{panel.get('id')}"] = (
                    panel.get("description", "") + json.dumps(bands))
    return found


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())


def outputs(tmp_path, name: str | None) -> dict[tuple[str, str], str]:
    config = tmp_path / f"{name or 'default'}.yml"
    config.write_text(yaml.safe_dump({"pressure": {name: changed(name)} if name else {}}))
    return parts(assets.for_config(str(config)))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bundles")
    default = outputs(tmp_path, None)
    touched = {}
    for name in NAMES:
        bundle = outputs(tmp_path, name)
        assert bundle.keys() == default.keys(), name
        touched[name] = {key: text for key, text in bundle.items() if text != default[key]}
    return default, touched


@pytest.mark.parametrize("name", NAMES)
def test_each_threshold_changes_every_output_that_states_it(bundles, name):
    default, touched = bundles
    expected = {"runbook"} | ({"dashboards"} if name in DRAWN else set()) | (
        set() if name in EXPORTER_ONLY else {"rules"})
    assert {output for output, _ in touched[name]} == expected
    new, old = forms(name, changed(name)), forms(name, getattr(DEFAULT, name))
    assert not new & old
    for output in expected:
        shown = {form for (where, unit), text in touched[name].items() if where == output
                 for form in new if occurs(form, text) and not occurs(form, default[where, unit])}
        assert shown, f"{output}: {name}={changed(name)} changed it but is not written in it"
    for key, text in touched[name].items():
        # The same number may be another threshold's default in the same rule, section or panel.
        shared = set().union(*(forms(other, getattr(DEFAULT, other)) for other in NAMES
                               if other != name and key in touched[other]))
        stale = sorted(form for form in old - shared if occurs(form, text))
        assert stale == [], f"{key}: still says {stale} after {name} changed to {changed(name)}"


def test_the_template_states_no_threshold_but_through_a_placeholder():
    """Where a threshold's placeholder stands in a runbook section, its default value is not also written out."""
    template = runbook.template()
    for title, body in runbook.sections(template):
        prose = runbook.PLACEHOLDER.sub("", body)
        for name in set(match[0] for match in runbook.PLACEHOLDER.findall(body)):
            written = sorted(form for form in forms(name, getattr(DEFAULT, name)) if occurs(form, prose))
            assert written == [], f"{title}: {name}'s default written out as {written}"
