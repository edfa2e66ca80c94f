"""The Grafana renderer (devtools/grafana-render/) from Python: build its page, draw dashboards, read what they show.

`make dashboards-render` is the same for a shell. Tests use it to assert on what Grafana 12.4's own code
displays (displayed.json: each stat's text and colour, each table row in its displayed order, the legends)
and to ask Prometheus the very queries Grafana sent (each panel's `queries`, with their parameters).
"""

from __future__ import annotations

import fcntl
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvcache_exporter import units
from devtools import harness, lint_dashboards

RENDER = harness.REPO / "devtools" / "grafana-render"
PAGE = RENDER / "dist" / "index.html"
GENERATED = harness.REPO / "dashboards" / "generated"
BUILD_LOCK = RENDER / ".build.lock"


def build_page() -> None:
    """The page as `make dashboards-render` builds it: Debian's Chromium and `npm ci` first where missing,
    then Vite where a source is newer than the bundle (make decides). One build at a time: pytest's workers
    each build it for their own tests, and a second Vite build beside a running one exits 1 ("Found another Vite
    build process"), failing that worker's tests at setup (CI: three errors)."""
    with open(BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(["make", "-s", str(PAGE.relative_to(harness.REPO))], capture_output=True,
                                text=True, timeout=900, cwd=harness.REPO)
    if result.returncode != 0:
        raise RuntimeError(f"building {PAGE} failed:\n{result.stdout}{result.stderr}")


def render(prometheus_url: str, out: Path, dashboards: list[Path], *, end: float | None = None,
           range_seconds: float | None = None, scrape_interval_seconds: float | None = None,
           variables: dict[str, str] | None = None, panel_timeout_seconds: float = 20) -> subprocess.CompletedProcess:
    """Draws the dashboards into out/<uid>/ (a PNG per panel and per row, displayed.json) over the range ending
    at `end` (epoch seconds; now by default). Exit 1 names each panel whose query failed."""
    args = ["--prometheus", prometheus_url, "--out", str(out), "--panel-timeout", f"{panel_timeout_seconds:g}s"]
    if end is not None:
        args += ["--end", str(round(end * 1000))]
    if range_seconds is not None:
        args += ["--range", f"{round(range_seconds * 1000)}ms"]
    if scrape_interval_seconds is not None:
        args += ["--scrape-interval", f"{scrape_interval_seconds:g}s"]
    for name, value in (variables or {}).items():
        args += ["--var", f"{name}={value}"]
    return subprocess.run([harness.require_binary("node"), str(RENDER / "render.mjs"), *args, *map(str, dashboards)],
                          capture_output=True, text=True, timeout=600, cwd=harness.REPO)


def displayed(out: Path, uid: str) -> dict[str, dict]:
    """What each panel of a drawn dashboard displays, by title."""
    return {panel["title"]: panel for panel in json.loads((out / uid / "displayed.json").read_text())["panels"]}


@dataclass(frozen=True)
class Drawn:
    """One panel as Grafana 12.4's code drew it: its JSON, what it displayed (a stat's texts and colours, a table's
    rows in their order) and, per query, Prometheus' answer to the very query Grafana sent: (labels, [(t, v)]) per
    series."""

    panel: dict
    displayed: dict
    series: dict[str, list[tuple[dict, list[tuple[float, float]]]]]

    @property
    def rate_interval(self) -> float:
        return units.parse_duration(self.displayed["rateInterval"])

    @property
    def rows(self) -> list[dict[str, dict]]:
        """A table's rows in the order Grafana displays them, each cell (text, colorName) by its column's header."""
        return [{cell["column"]: cell for cell in row} for row in self.displayed["rows"]]


def answer(prometheus_url: str, query: dict) -> list[tuple[dict, list[tuple[float, float]]]]:
    """Prometheus' answer to one query Grafana sent, asked with the parameters it sent."""
    if query["instant"]:
        result = harness.prom_query(prometheus_url, query["query"], time=query["time"])["result"]
        return [(item["metric"], [(float(item["value"][0]), float(item["value"][1]))]) for item in result]
    result = harness.prom_query(prometheus_url, query["query"], path="/api/v1/query_range", start=query["start"],
                                end=query["end"], step=query["step"])["result"]
    return [(item["metric"], [(float(t), float(v)) for t, v in item["values"]]) for item in result]


def draw(prometheus_url: str, out: Path, dashboard: Path, **options) -> dict[str, Drawn]:
    """One dashboard drawn into `out` (`render`'s options), each panel as drawn, by title; raises naming the
    panels whose query failed."""
    result = render(prometheus_url, out, [dashboard], **options)
    if result.returncode != 0:
        raise AssertionError(result.stderr)
    spec = json.loads(dashboard.read_text())
    panels = {panel["id"]: panel for panel in lint_dashboards.panels(spec)}
    return {title: Drawn(panels[record["id"]], record,
                         {query["refId"]: answer(prometheus_url, query) for query in record["queries"]})
            for title, record in displayed(out, spec["uid"]).items()}
