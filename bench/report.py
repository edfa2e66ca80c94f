"""The figures of a fleet run as a Markdown report and a plot: tables, linear fits, the issue's targets.

    python -m bench.report bench/results/results.json   # rewrites results.md and performance.png next to it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The targets of issue 7, as checked against the figures.
PARSER_SPEEDUP = 50
FLEET_SIZE = 2000
MAX_CORES = 1.0
MAX_RSS_MB = 300
MAX_RENDER_MS = 250


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares line y = intercept + slope x and its R²."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = mean_y - slope * mean_x
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    total = sum((y - mean_y) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1 - residual / total if total else 1.0}


def fits(runs: list[dict]) -> dict:
    """Per workload and process: CPU per cycle and resident memory as lines in N, and how much the CPU
    per poll varies with N (a line through the origin has a constant cost per poll)."""
    out: dict = {}
    for workload in dict.fromkeys(run["workload"] for run in runs):
        rows = [run for run in runs if run["workload"] == workload]
        if len(rows) < 2:
            continue
        sizes = [run["targets"] for run in rows]
        out[workload] = {}
        for process in ("exporter", "prometheus"):
            if not all(process in run for run in rows):
                continue
            per_poll = [run[process]["cpu_per_request_us"] for run in rows]
            lines = {figure: fit(sizes, [run[process][figure] for run in rows])
                     for figure in ("cpu_per_cycle_s", "rss_mb")}
            out[workload][process] = {**lines, "cpu_per_poll_us": {"min": min(per_poll), "max": max(per_poll)}}
    return out


def _number(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(run: dict) -> float | None:
    ours, theirs = run["exporter"].get("cpu_per_request_us"), run.get("prometheus", {}).get("cpu_per_request_us")
    return ours / theirs if ours and theirs else None


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_table(runs: list[dict]) -> str:
    """The exporter's CPU next to Prometheus' on the same pages."""
    head = ["workload", "N", "exporter CPU s/cycle", "cores", "exporter µs CPU/poll", "Prometheus µs CPU/scrape",
            "ratio", "Prometheus RSS MB", "other load, cores (exporter / Prometheus run)"]
    rows = []
    for run in runs:
        ours, theirs = run["exporter"], run.get("prometheus", {})
        rows.append([run["workload"], f"{run['targets']:,}", f"{ours['cpu_per_cycle_s']:.3f}", f"{ours['cores']:.3f}",
                     _number(ours["cpu_per_request_us"]), _number(theirs.get("cpu_per_request_us")),
                     _number(_ratio(run), 2), _number(theirs.get("rss_mb")),
                     f"{ours['other_load_cores']:.1f} / {_number(theirs.get('other_load_cores'), 1)}"])
    return table(head, rows)


def exporter_table(runs: list[dict]) -> str:
    """Freshness, memory and /metrics of the exporter."""
    head = ["workload", "N", "oldest data age s", "polls done", "RSS MB", "peak RSS MB", "/metrics MB",
            "/metrics ms, gzip", "/metrics ms, plain"]
    rows = []
    for run in runs:
        ours = run["exporter"]
        rows.append([run["workload"], f"{run['targets']:,}", f"{ours['oldest_age_s']:.2f}",
                     f"{100 * ours['completed_share']:.1f} %", f"{ours['rss_mb']:.0f}", f"{ours['peak_rss_mb']:.0f}",
                     f"{ours['metrics_mb']:.1f}",
                     f"{ours['render_gzip_ms']:.0f}", f"{ours['render_ms']:.0f}"])
    return table(head, rows)


def parser_table(pages: dict) -> str:
    rows = ["| page | KB | samples read | ours MB/s | prometheus_client MB/s | speed-up |", "|---|---|---|---|---|---|"]
    for name, page in pages.items():
        speed = page["parser"]
        rows.append(f"| {name} | {page['bytes'] / 1000:.1f} | {speed['samples']} | {speed['ours_mb_s']:.0f} "
                    f"| {speed['prometheus_client_mb_s']:.2f} | {speed['speedup']:.0f}x |")
    return "\n".join(rows)


def fit_table(all_fits: dict) -> str:
    rows = ["| workload | process | CPU per cycle: s + µs × N | R² | µs CPU per poll (or scrape), range over N "
            "| RSS: MB + KB × N | R² |", "|---|---|---|---|---|---|---|"]
    for workload, by_process in all_fits.items():
        for process, figures in by_process.items():
            cpu, rss, per_poll = figures["cpu_per_cycle_s"], figures["rss_mb"], figures["cpu_per_poll_us"]
            rows.append(f"| {workload} | {process} | {cpu['intercept']:.3f} s + {cpu['slope'] * 1e6:.0f} µs × N "
                        f"| {cpu['r2']:.4f} | {per_poll['min']:.0f} to {per_poll['max']:.0f} "
                        f"| {rss['intercept']:.0f} MB + {rss['slope'] * 1e3:.1f} KB × N | {rss['r2']:.4f} |")
    return "\n".join(rows)


def target_checks(results: dict) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when not measured, the figures behind it)."""
    runs, interval = results["runs"], results["settings"]["interval"]
    checks = []
    speedups = [page["parser"]["speedup"] for page in results["pages"].values()]
    checks.append((f"parser ≥ {PARSER_SPEEDUP}x prometheus_client, identical samples",
                   min(speedups) >= PARSER_SPEEDUP, f"slowest page {min(speedups):.0f}x"))
    ratios = [r for r in map(_ratio, runs) if r is not None]
    checks.append(("exporter CPU per poll ≤ Prometheus CPU per scrape",
                   max(ratios) <= 1 if ratios else None,
                   f"ratio {min(ratios):.2f} to {max(ratios):.2f}" if ratios else "Prometheus not measured"))
    big = [run for run in runs if run["targets"] >= FLEET_SIZE]
    if not big:
        return checks + [(f"targets at {FLEET_SIZE:,}", None, "no run at that size")]
    worst = {key: max(run["exporter"][key] for run in big)
             for key in ("cores", "oldest_age_s", "rss_mb", "peak_rss_mb", "render_ms", "render_gzip_ms")}
    least_done = min(run["exporter"]["completed_share"] for run in big)
    checks.append((f"{FLEET_SIZE:,} targets at {interval:g} s within one core, every target fresh",
                   worst["cores"] <= MAX_CORES and worst["oldest_age_s"] < 2 * interval and least_done > 0.98,
                   f"{worst['cores']:.2f} cores, oldest data {worst['oldest_age_s']:.1f} s old, "
                   f"{100 * least_done:.1f} % of polls done"))
    checks.append((f"resident memory < {MAX_RSS_MB} MB at {FLEET_SIZE:,}", worst["peak_rss_mb"] < MAX_RSS_MB,
                   f"{worst['rss_mb']:.0f} MB between scrapes, {worst['peak_rss_mb']:.0f} MB at the peak "
                   "(while /metrics is rendered)"))
    for key, how in (("render_gzip_ms", "gzip, as Prometheus scrapes"), ("render_ms", "uncompressed")):
        checks.append((f"/metrics in < {MAX_RENDER_MS} ms at {FLEET_SIZE:,}, {how}", worst[key] < MAX_RENDER_MS,
                       f"{worst[key]:.0f} ms (worst workload)"))
    return checks


def growth_sentence(all_fits: dict) -> str:
    parts = []
    for workload, by_process in all_fits.items():
        figures = by_process.get("exporter")
        if figures:
            cpu, per_poll = figures["cpu_per_cycle_s"], figures["cpu_per_poll_us"]
            parts.append(f"{workload}: {cpu['slope'] * 1e6:.0f} µs per target and cycle, R² {cpu['r2']:.3f}, "
                         f"{per_poll['min']:.0f} to {per_poll['max']:.0f} µs per poll")
    if not parts:
        return ""
    return ("The exporter's CPU per cycle grows linearly with N: a near-constant cost per target poll and "
            "a negligible fixed cost (" + "; ".join(parts) + ").")


def markdown(results: dict) -> str:
    settings, machine = results["settings"], results["machine"]
    lines = [
        f"Exporter at {results.get('code', 'an unrecorded commit')}. "
        f"Machine: {machine['cpus']} × {machine['cpu_model']}, Python {machine['python']}, "
        f"{results['prometheus_version']}. Interval {settings['interval']:g} s, {settings['cycles']} measured cycles "
        f"after {settings['warmup_cycles']} of warm-up. Other load on the machine during the windows: "
        f"{results['other_load_cores']:.2f} cores on average.",
        "", cpu_table(results["runs"]), "", exporter_table(results["runs"]), "", parser_table(results["pages"]), "",
    ]
    all_fits = results.get("fits", {})
    if all_fits:
        lines += [fit_table(all_fits), "", growth_sentence(all_fits), ""]
    lines.append("| target | met | figures |")
    lines.append("|---|---|---|")
    for target, met, figures in target_checks(results):
        lines.append(f"| {target} | {'n/a' if met is None else 'yes' if met else 'NO'} | {figures} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """CPU per cycle, CPU per poll and resident memory against N, the exporter next to Prometheus, per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, interval = results["runs"], results["settings"]["interval"]
    figure, (cycle_axes, poll_axes, memory_axes) = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, workload in zip(colors, dict.fromkeys(run["workload"] for run in runs)):
        rows = [run for run in runs if run["workload"] == workload]
        sizes = [run["targets"] for run in rows]
        for process, style in (("exporter", "-o"), ("prometheus", "--s")):
            if not all(process in run for run in rows):
                continue
            label = f"{process}, {workload}"
            for axes, figure_name in ((cycle_axes, "cpu_per_cycle_s"), (poll_axes, "cpu_per_request_us"),
                                      (memory_axes, "rss_mb")):
                axes.plot(sizes, [run[process][figure_name] for run in rows], style, color=color, label=label)
    cycle_axes.axhline(interval, color="grey", linestyle=":", label="one core")
    memory_axes.axhline(MAX_RSS_MB, color="grey", linestyle=":", label=f"{MAX_RSS_MB} MB (exporter target)")
    cycle_axes.set(xlabel="targets", ylabel=f"CPU seconds per {interval:g} s cycle", title="CPU per poll cycle")
    poll_axes.set(xlabel="targets", ylabel="CPU µs", title="CPU per target poll (exporter) / per scrape (Prometheus)")
    memory_axes.set(xlabel="targets", ylabel="MB", title="Resident memory")
    for axes in (cycle_axes, poll_axes, memory_axes):
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(results: dict, out: Path) -> str:
    """results.md and performance.png into `out`; returns the Markdown."""
    results["fits"] = fits(results["runs"])
    text = markdown(results)
    (out / "results.md").write_text(text)
    plot(results, out / "performance.png")
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1])
    print(write(json.loads(path.read_text()), path.parent))
