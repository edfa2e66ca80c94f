"""The figures of `bench.paths` as Markdown tables and a plot: each path against N, and B / A.

    python -m bench.paths_report bench/results-paths/results.json   # rewrites results.md and paths.png next to it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .measure import STEPS
from .report import table

# Issue 21's goals for the exporter's path against Prometheus scraping the engines.
MAX_CPU_RATIO = 0.8
MAX_SAMPLES_RATIO = 0.5
MAX_AGE_OVER_A_S = 1.0  # issue 33: B's oldest data at most A's + 1 s
READ_STEPS = ("parse", "adapt", "derive", "render")  # what path replay leaves out
LABELS = {"direct": "A: Prometheus scrapes engines", "exporter": "B: exporter + Prometheus + rules",
          "probe": "probe: Prometheus via /probe + rules", "replay": "B with pages replayed, not read"}


def _cores(figures: dict) -> str:
    parts = figures["cores"]
    split = " + ".join(f"{parts[name]:.3f}" for name in ("prometheus", "exporter") if name in parts)
    return f"{figures['monitoring_cores']:.3f}" + (f" ({split})" if len(parts) > 1 else "")


def _rules(rules: dict) -> str:
    if not rules["recording_s"] and not rules["alerting_s"]:
        return "none loaded"
    return f"{rules['recording_s']:.2f} + {rules['alerting_s']:.2f} ({rules['alerts_active']:,})"


def _at_scrape(figures: dict) -> str:
    """Absent from results taken before phase-locked polling (issue #33)."""
    if "age_at_scrape_median_s" not in figures:
        return "-"
    return f"{figures['age_at_scrape_median_s']:.2f}, {figures['age_at_scrape_max_s']:.2f}"


def _path(path: str, figures: dict) -> str:
    """The path's name, and its exporter's replicas and worker processes where it had more than one (absent
    from results before `--shard` and `workers:`)."""
    replicas, workers = figures.get("replicas", 1), figures.get("workers", 1)
    parts = [path]
    if replicas > 1:
        parts.append(f"{replicas} replicas")
    if workers > 1:
        parts.append(f"{workers} workers each" if replicas > 1 else f"{workers} workers")
    return ", ".join(parts)


def path_table(runs: list[dict], paths: list[str]) -> str:
    head = ["workload", "N", "path", "CPU, cores (Prometheus + exporter)", "samples/s", "head series",
            "Prometheus RSS MB", "TSDB MB/hour", "WAL MB/hour", "oldest data s (median)",
            "data age at scrape s: median, max", "engines up",
            "rules s/evaluation: recording + alerting (alerts active)", "other load, cores"]
    rows = []
    for run in runs:
        for path in paths:
            if path not in run:
                continue
            f = run[path]
            rows.append([run["workload"], f"{run['targets']:,}", _path(path, f), _cores(f), f"{f['samples_per_s']:,.0f}",
                         f"{f['head_series']:,.0f}", f"{f['prometheus_rss_mb']:,.0f}", f"{f['tsdb_mb_per_hour']:,.1f}",
                         f"{f['wal_mb_per_hour']:,.0f}", f"{f['oldest_age_s']:.1f} ({f['oldest_age_median_s']:.1f})",
                         _at_scrape(f),
                         f"{f['engines_up']:,.0f}", _rules(f["rules"]), f"{f['other_load_cores']:.2f}"])
    return table(head, rows)


def ratios(run: dict, path: str) -> dict | None:
    """`path` over path A (direct) for each figure, or None when either was not measured."""
    if path not in run or "direct" not in run:
        return None
    ours, theirs = run[path], run["direct"]
    keys = ("monitoring_cores", "samples_per_s", "head_series", "prometheus_rss_mb", "tsdb_mb_per_hour")
    return {key: ours[key] / theirs[key] if theirs[key] else None for key in keys}


def ratio_table(runs: list[dict], paths: list[str]) -> str:
    head = ["workload", "N", "path / A", "CPU", "samples/s", "head series", "Prometheus RSS", "TSDB bytes/hour",
            f"CPU ≤ {MAX_CPU_RATIO} and samples ≤ {MAX_SAMPLES_RATIO}", f"oldest data ≤ A's + {MAX_AGE_OVER_A_S:g} s"]
    rows = []
    for run in runs:
        for path in paths:
            r = ratios(run, path) if path != "direct" else None
            if r is None:
                continue
            met = r["monitoring_cores"] <= MAX_CPU_RATIO and r["samples_per_s"] <= MAX_SAMPLES_RATIO
            rows.append([run["workload"], f"{run['targets']:,}", _path(path, run[path]),
                         *(f"{r[key]:.2f}" for key in ("monitoring_cores", "samples_per_s", "head_series",
                                                        "prometheus_rss_mb", "tsdb_mb_per_hour")),
                         "yes" if met else "NO",
                         "yes" if run[path]["oldest_age_s"] <= run["direct"]["oldest_age_s"] + MAX_AGE_OVER_A_S
                         else "NO"])
    return table(head, rows)


def step_table(runs: list[dict], interval: float) -> str:
    """Where B's exporter CPU goes (py-spy's step shares times its CPU in the window), as µs per poll, and
    what would close the row: B / A with the whole read free (path replay, measured) and with the read's
    costliest step free (the profile)."""
    head = ["workload", "N", "B / A", f"B over {MAX_CPU_RATIO} A, cores", "exporter µs per poll",
            *(f"{step} µs" for step in STEPS), "B / A, read free (replay)", "B / A, costliest read step free"]
    rows = []
    for run in runs:
        figures = run.get("exporter", {})
        if "profile" not in figures or "direct" not in run:
            continue
        a, b = run["direct"]["monitoring_cores"], figures["monitoring_cores"]
        polls_per_s = run["targets"] / interval
        exporter = figures["cores"]["exporter"]
        shares = figures["profile"]["shares"]
        per_poll = {step: exporter * shares[step] / polls_per_s * 1e6 for step in STEPS}
        costliest = max(READ_STEPS, key=per_poll.get)
        replay = f"{run['replay']['monitoring_cores'] / a:.2f}" if "replay" in run else "-"
        without = b - exporter * shares[costliest]
        rows.append([run["workload"], f"{run['targets']:,}", f"{b / a:.2f}", f"{b - MAX_CPU_RATIO * a:+.3f}",
                     f"{exporter / polls_per_s * 1e6:,.0f}", *(f"{per_poll[step]:,.0f}" for step in STEPS), replay,
                     f"{without / a:.2f} ({costliest})"])
    return table(head, rows) if rows else ""


def markdown(results: dict) -> str:
    settings, machine = results["settings"], results["machine"]
    paths = settings["paths"]
    return "\n".join([
        f"Exporter at {results['code']}. Machine: {machine['cpus']} × {machine['cpu_model']}, Python "
        f"{machine['python']}, {results['prometheus_version']}. Scrape and poll interval {settings['interval']:g} s, "
        f"rules every {settings['evaluation_interval_s']} s, {settings['cycles']} measured intervals after "
        f"{settings['warmup_cycles']} of warm-up. {_fleet(settings)}",
        "", path_table(results["runs"], paths), "", ratio_table(results["runs"], paths), "",
        step_table(results["runs"], settings["interval"]), "",
    ])


def _fleet(settings: dict) -> str:
    every = settings.get("pressure_every", 1)  # runs before the steady fleet existed had every pool under pressure
    if every == 1:
        return "Every pool under KV pressure (the captured pages): every pool raises its KV alerts."
    return f"Steady fleet: one pool in {every} under KV pressure (the captured pages), the others at rest."


def plot(results: dict, path: Path) -> None:
    """Monitoring CPU, samples ingested, Prometheus memory, TSDB growth and the oldest data a query sees against
    N, per path and workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    figures = (("monitoring_cores", "cores", "CPU of the monitoring path"),
               ("samples_per_s", "samples/s", "Samples Prometheus ingests"),
               ("prometheus_rss_mb", "MB", "Prometheus resident memory"),
               ("tsdb_mb_per_hour", "MB per hour", "TSDB growth on disk"),
               ("oldest_age_s", "seconds", "Oldest data a query sees"))
    figure, axes_row = plt.subplots(1, len(figures), figsize=(23, 4.8))
    styles = {"direct": "--s", "exporter": "-o", "probe": ":^", "replay": "-.v"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, workload in zip(colors, dict.fromkeys(run["workload"] for run in runs)):
        rows = [run for run in runs if run["workload"] == workload]
        for name in results["settings"]["paths"]:
            measured = [run for run in rows if name in run]
            if not measured:
                continue
            sizes = [run["targets"] for run in measured]
            for axes, (key, _, _) in zip(axes_row, figures):
                axes.plot(sizes, [run[name][key] for run in measured], styles[name], color=color,
                          label=f"{LABELS[name]}, {workload}")
    for axes, (_, unit, title) in zip(axes_row, figures):
        axes.set(xlabel="engines", ylabel=unit, title=title)
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
    axes_row[0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(results: dict, out: Path) -> str:
    """results.md and paths.png into `out`; returns the Markdown."""
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out / "paths.png")
    return text


if __name__ == "__main__":
    results_path = Path(sys.argv[1])
    print(write(json.loads(results_path.read_text()), results_path.parent))
