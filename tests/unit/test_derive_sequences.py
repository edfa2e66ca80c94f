"""Pages over time through parse -> adapt -> derive: the pressure state at every poll, as each
sequence's sequence.yml says (with its reasoning)."""

from __future__ import annotations

import math

import pytest
import yaml

from devtools import harness
from kvcache_exporter import adapters, derive
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.top import rows as top_rows

# Each test twice: with the adapters' compiled loops and with their pure-Python reference (conftest.py).
pytestmark = pytest.mark.usefixtures("fold")

SEQUENCES = sorted((harness.FIXTURES / "sequences").iterdir())


@pytest.mark.parametrize("directory", SEQUENCES, ids=lambda p: p.name)
def test_pressure_state_along_the_sequence(directory):
    spec = yaml.safe_load((directory / "sequence.yml").read_text())
    thresholds = Thresholds.from_mapping(spec["thresholds"])
    histories: dict = {}
    states = []
    for step in spec["pages"]:
        text = (directory / step["page"]).read_text()
        adapter = adapters.detect(text)
        assert adapter.engine == spec["engine"]
        snapshot = adapter.adapt(parser.parse(text, adapter.wanted))
        ranks, histories = derive.derive(snapshot, histories, float(step["t"]), thresholds)
        rank = ranks["0"]
        assert rank.gauges["usage_ratio"] == step["usage_ratio"]
        assert rank.values.counters.get("preemptions_total", 0.0) == step["preemptions_total"]
        for key in ("requests_waiting_for_kv", "requests_waiting_with_kv_room", "headroom_requests"):
            if key in step:
                assert math.isclose(rank.gauges[key], step[key], rel_tol=1e-9), (step["page"], key)
        states.append((rank.pressure, rank.reason))
        if "text" in step:  # the words `top` shows, from this pool's gauges and the window's preemption rate
            rate = derive.rate(histories["0"].preemptions)
            row = {**rank.gauges, "reason": rank.reason, "preemptions_per_min": None if rate is None else rate * 60}
            assert top_rows.why(row, thresholds) == step["text"], step["page"]
    assert states == [(step["state"], step["reason"]) for step in spec["pages"]]
