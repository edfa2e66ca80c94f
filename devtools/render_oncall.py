"""Redraws the pictures of docs/oncall.md: a fleet with one pool of each kind on-call meets, drawn as Grafana does.

    python -m devtools.render_oncall [--out docs/img/oncall]

Simulated engines run SPEED times faster than real time, each started so that at the drawing its scenario is
where on-call meets it: a pool short of KV (TensorRT-LLM, kv-saturation: no preemption counter, so it reads
saturated, not thrashing), one thrashing (vLLM, kv-saturation), one capped (SGLang, concurrency-cap), one wedged
(vLLM, wedged: admission stalled), one fine (SGLang, steady, two data-parallel ranks) and one down (a loopback port
nothing listens on). The exporter polls them and Debian's Prometheus evaluates the shipped rules on the same
compressed clock (`alerts.generate.compress`, as tests/e2e/test_dashboards_truth.py). Then the fleet dashboard
(at All) and the target dashboard of each pool are drawn with `make dashboards-render` over the run, and the
first row of each (and the fleet's Pressure row) copied into --out as fleet-*.png and <pool>-*.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kvcache_exporter.alerts import generate
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.server import start_engine
from kvcache_exporter.thresholds import DEFAULT
from devtools import grafana_render, harness

SPEED = 10.0
THRESHOLDS = generate.compress(DEFAULT, SPEED)
INTERVAL_S = 1.0  # exporter poll, Prometheus scrape, rule evaluation
DRAW_AT_S = 110.0  # wall seconds after the first engine started
OUT = harness.REPO / "docs" / "img" / "oncall"
# pool -> (flavor, scenario, dp, simulated seconds its scenario has run at the drawing)
POOLS = {
    "chat-trtllm": ("trtllm", "kv-saturation", 1, 520),  # overload phase: 150 s to 600 s
    "chat-vllm": ("vllm-v1", "kv-saturation", 1, 520),
    "batch-sglang": ("sglang", "concurrency-cap", 1, 340),  # capped: 60 s to 420 s
    "code-vllm": ("vllm-v1", "wedged", 1, 750),  # wedged from 240 s on: the stall alert's 5 minutes passed
    "rag-sglang": ("sglang", "steady", 2, 300),
}
DOWN = "summary-vllm"  # configured, never answers
ROWS = {"kvcache-fleet": ("row-01-overview.png", "row-03-pressure.png"), "kvcache-target": ("row-01-overview.png",)}


def exporter_config(urls: dict[str, str]) -> dict:
    targets = [{"name": name, "url": url, "engine": (POOLS[name][0] if name in POOLS else "vllm").split("-")[0]}
               for name, url in urls.items()]
    return harness.polling(targets, INTERVAL_S, 0.8 * INTERVAL_S, 3 * INTERVAL_S, THRESHOLDS, {"cluster": "oncall"})


def run_and_draw(work: Path) -> Path:
    """The fleet up to DRAW_AT_S, then both dashboards drawn over it into work/out/<pool or fleet>/<uid>/."""
    rules = work / "kvcache-rules.yml"
    rules.write_text(generate.render(generate.build(THRESHOLDS)))
    ports = {name: harness.free_port() for name in [*POOLS, DOWN]}
    urls = {name: f"http://127.0.0.1:{port}{FLAVORS[POOLS[name][0] if name in POOLS else 'vllm-v1'].metrics_path}"
            for name, port in ports.items()}
    config = work / "exporter.yml"
    config.write_text(yaml.safe_dump(exporter_config(urls)))
    engines = []
    # The exporter and Prometheus from the start: the rules' `for:` run from the first poll of each engine.
    with harness.exporter(work, "--config", str(config)) as exporter:
        prometheus_config = harness.scraping(exporter, f"{INTERVAL_S:g}s", (rules,))
        with harness.prometheus(work / "prometheus", prometheus_config) as prometheus:
            first = time.time()
            try:
                # The longest scenario first; each other starts when its scenario will be where POOLS says at the
                # drawing.
                for name, (flavor, scenario, dp, at) in sorted(POOLS.items(), key=lambda item: -item[1][3]):
                    time.sleep(max(0.0, first + DRAW_AT_S - at / SPEED - time.time()))
                    engines.append(start_engine(flavor, scenario, port=ports[name], speed=SPEED, seed=len(engines) + 1,
                                                dp=dp))
                    print(f"{name}: {flavor} {scenario} started", flush=True)
                all_up = time.time() + 2 * INTERVAL_S
                time.sleep(max(0.0, first + DRAW_AT_S - time.time()))
                end = time.time()
                out = work / "out"
                # From when every engine answered: the pools' earlier "down" is their start, not their story.
                options = dict(end=end, range_seconds=end - all_up, scrape_interval_seconds=INTERVAL_S)
                draw(prometheus.url, out / "fleet", [grafana_render.GENERATED / "kvcache-fleet.json"], options)
                for name in [*POOLS, DOWN]:
                    draw(prometheus.url, out / name, [grafana_render.GENERATED / "kvcache-target.json"], options,
                         {"target": name})
                return out
            finally:
                for engine in engines:
                    engine.stop()


def draw(prometheus_url: str, out: Path, dashboards: list[Path], options: dict, variables: dict | None = None):
    result = grafana_render.render(prometheus_url, out, dashboards, variables=variables, **options)
    print(result.stdout, end="", flush=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr)


def summarise(name: str, displayed: dict) -> None:
    """What the first screen says, as docs/oncall.md quotes it: the triage table's rows, the state stat."""
    for panel in displayed["panels"]:
        if panel["type"] == "table":
            print(f"{name}: {panel['title']}")
            for row in panel.get("rows", []):
                print("  " + " | ".join(cell["text"] for cell in row))
        elif panel["title"] == "Pressure state":
            print(f"{name}: {panel['title']}: {[value.get('text') for value in panel.get('values', [])]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.render_oncall", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where the pictures go (%(default)s)")
    args = parser.parse_args(argv)
    grafana_render.build_page()
    with tempfile.TemporaryDirectory(prefix="kvcache-oncall-") as scratch:
        try:
            out = run_and_draw(Path(scratch))
        except RuntimeError as err:
            print(f"drawing failed, {args.out} left as it was:\n{err}", file=sys.stderr)
            return 1
        shutil.rmtree(args.out, ignore_errors=True)
        args.out.mkdir(parents=True)
        for drawn in sorted(out.iterdir()):
            for uid in sorted(p.name for p in drawn.iterdir()):
                for row in ROWS[uid]:
                    shutil.copy(drawn / uid / row, args.out / f"{drawn.name}-{row.removeprefix('row-')}")
                summarise(drawn.name, json.loads((drawn / uid / "displayed.json").read_text()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
