"""The scenario plots of docs/scaling.md ("Autoscaling on KV"): what the fleet tests' Prometheus saw, per fleet.

    .venv/bin/python -m devtools.scaling_plots            # runs the fleet tests, then draws docs/img/scaling/*.png
    .venv/bin/python -m devtools.scaling_plots --from DIR  # draws from traces a run left in DIR

The tests (tests/e2e/test_fleet_e2e.py, tests/e2e/test_fleet_scaling.py, tests/e2e/test_fleet_scaling_pd.py) write
their traces only when TRACE_ENV names a directory: `record` reads each series below over the run from Prometheus,
per model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools import harness

TRACE_ENV = "KVCACHE_SCALING_TRACE"
OUT = harness.REPO / "docs" / "img" / "scaling"
# Per model: what the plots show.
SERIES = {
    "usage": "avg by (model) (kvcache_usage_ratio)",
    "waiting": "sum by (model) (kvcache_requests_waiting)",
    "waiting_for_kv": "sum by (model) (kvcache_requests_waiting_for_kv)",
    "ready": "sum by (model) (kvcache:fleet_replicas_ready:count)",
    "starting": "sum by (model) (kvcache:fleet_replicas_starting:count)",
    "delta": "sum by (model) (kvcache:fleet_replicas:delta)",
    "desired": "sum by (model) (kvcache:fleet_replicas:desired)",
    # A disaggregated fleet's, per role.
    "prefill_usage": 'avg by (model) (kvcache_usage_ratio{role="prefill"})',
    "decode_usage": 'avg by (model) (kvcache_usage_ratio{role="decode"})',
    "prefill_held": ('sum by (model) (kvcache_kv_transfer_held_tokens{role="prefill"})\n'
                     '/ sum by (model) (kvcache_capacity_tokens{role="prefill"})'),
    "prefill_waiting": 'sum by (model) (kvcache_requests_waiting{role="prefill"})',
    "decode_waiting": 'sum by (model) (kvcache_requests_waiting{role="decode"})',
    "decode_ready": 'sum by (model) (kvcache:fleet_replicas_ready:count{role="decode"})',
    "decode_starting": 'sum by (model) (kvcache:fleet_replicas_starting:count{role="decode"})',
    "decode_desired": 'sum by (model) (kvcache:fleet_replicas:desired{role="decode"})',
    "prefill_desired": 'sum by (model) (kvcache:fleet_replicas:desired{role="prefill"})',
}
# What each plot's three panels (KV, queue, replicas) draw: (series, label, line style).
UNIFIED = (
    [("usage", "KV usage (mean of the ready pools)", {})],
    [("waiting", "requests waiting", {}), ("waiting_for_kv", "of them for KV", {})],
    [("ready", "ready", {"linewidth": 2}), ("starting", "starting", {}),
     ("desired", "kvcache:fleet_replicas:desired", {"linestyle": "--"}),
     ("delta", "kvcache:fleet_replicas:delta", {"linestyle": ":"})],
)
DISAGGREGATED = (
    [("prefill_usage", "prefill KV usage", {"linewidth": 3, "alpha": 0.5}),
     ("decode_usage", "decode KV usage (mean of the ready pools)", {}),
     ("prefill_held", "prefill KV held for export (share of its pool)", {"linestyle": "--"})],
    [("prefill_waiting", "requests waiting: prefill", {}), ("decode_waiting", "decode", {})],
    [("decode_ready", "decode ready", {"linewidth": 2}), ("decode_starting", "decode starting", {}),
     ("decode_desired", "decode desired", {"linestyle": "--"}),
     ("prefill_desired", "prefill desired", {"linestyle": ":"})],
)
# The fleets drawn, by model, with their titles (and panels, where not UNIFIED's).
FLEETS = {
    "balanced": "KV-bound: two replicas overloaded alike, a third starting",
    "capped": "Cap-bound: queueing behind the running-request cap",
    "offload": "Offload: a full GPU pool whose CPU tier serves the hits",
    "converging": "Converging: replicas added as the signal asks (the HPA's behaviour)",
    "step": "A step from 3 to 5 replicas' load, and back: scale-out whole, scale-in one a window",
    "ramp": "A ramp from 3 to 5 replicas' load over 5 minutes",
    "spike": "A 20-second spike that ends, then a replica that crashes and restarts: nothing added",
    "preempting": "Preemption without a standing queue: 2 replicas whose running requests outgrow their pools",
    "probed": "Probe mode, decode pods: one loading counts as starting, one scaled in does not",
    "pd": ("Prefill and decode apart: decode short, prefill holding what decode has not pulled", DISAGGREGATED),
}


def record(prom_url: str, name: str, started: float, time_scale: float, events: list | None = None) -> None:
    """With TRACE_ENV set, write `name`.json there: SERIES per model from `started` (unix time) to now, and the
    run's `events` ([wall seconds since started, what]); else nothing."""
    directory = os.environ.get(TRACE_ENV)
    if not directory:
        return
    end = time.time()
    series: dict[str, dict[str, list]] = {}
    for key, expr in SERIES.items():
        data = harness.prom_query(prom_url, expr, "/api/v1/query_range", start=started, end=end, step=0.5)
        series[key] = {item["metric"].get("model", ""): [[float(t) - started, float(v)] for t, v in item["values"]]
                       for item in data["result"]}
    Path(directory, f"{name}.json").write_text(json.dumps(
        {"time_scale": time_scale, "series": series, "events": events or []}))


def draw(traces: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(path.read_text()) for path in sorted(traces.glob("*.json"))]
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for model, spec in FLEETS.items():
        title, panels = spec if isinstance(spec, tuple) else (spec, UNIFIED)
        run = next((run for run in runs if model in run["series"].get(panels[-1][0][0], {})), None)
        if run is None:
            continue
        minutes = run["time_scale"] / 60  # simulated minutes per wall second
        figure, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
        figure.suptitle(title)
        for axis, lines in zip(axes, panels):
            for key, label, style in lines:
                points = run["series"].get(key, {}).get(model, [])
                axis.step([t * minutes for t, _ in points], [v for _, v in points], where="post", label=label,
                          **style)
        usage, queue, replicas = axes
        usage.set_ylim(0, 1.05)
        usage.legend(loc="lower right", fontsize=7)
        queue.legend(loc="upper left", fontsize=7)
        for seconds, what in run["events"]:
            replicas.axvline(seconds * minutes, color="grey", alpha=0.3)
            replicas.annotate(what, (seconds * minutes, replicas.get_ylim()[0]), fontsize=7, rotation=90,
                              va="bottom", ha="right", color="grey")
        replicas.axhline(0, color="black", linewidth=0.5)
        replicas.legend(loc="center right", fontsize=7)
        replicas.set_xlabel("simulated minutes")
        figure.tight_layout()
        path = out / f"{model}.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="traces", type=Path, help="draw from the traces in this directory")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.traces is None:
        args.traces = Path(tempfile.mkdtemp(prefix="kvcache-scaling-"))
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/e2e/test_fleet_e2e.py",
                                 "tests/e2e/test_fleet_scaling.py", "tests/e2e/test_fleet_scaling_pd.py"],
                                cwd=harness.REPO,
                                env={**os.environ, TRACE_ENV: str(args.traces)})
        if result.returncode != 0:
            print(f"the fleet tests failed; traces so far in {args.traces}", file=sys.stderr)
            return 1
    for path in draw(args.traces, args.out):
        print(path.relative_to(harness.REPO) if path.is_relative_to(harness.REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
