"""What we ship in PromQL, gathered from every place it lives, and the checks for Prometheus 2 and 3 alike.

Prometheus 3 changed what some expressions compute without making them invalid: range selectors are
left-open (a window holds one sample fewer), classic histogram `le` and summary `quantile` values are
normalised on ingestion (`le="1"` is stored as `le="1.0"`), and some functions were removed or put
behind `--enable-feature=promql-experimental-functions`. `problems()` finds those constructs; the
grammar itself is checked by promtool 2.42 and by Prometheus 3's own parser (tests/promql3/).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Iterator

import yaml

from devtools import lint_dashboards as lint
from devtools.harness import REPO, require_binary
from kvcache_exporter import units

GRAMMAR_DIR = REPO / "tests" / "promql3"  # a node project: scripts/install-test-deps installs its packages

RULE_FILES = (REPO / "alerts" / "kvcache-rules.yml",)
PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"
DASHBOARDS = tuple(sorted((REPO / "dashboards" / "generated").glob("*.json")))
DOCS = (REPO / "README.md", REPO / "alerts" / "runbook.md", *sorted((REPO / "docs").glob("*.md")))
SCRAPE_CONFIGS = (REPO / "deploy" / "compose" / "prometheus" / "prometheus.yml",
                  REPO / "deploy" / "kubernetes" / "prometheus" / "kvcache-scrape-configs.yml")

# Functions of Prometheus 3.13 that need --enable-feature=promql-experimental-functions (their
# `Experimental: true` entries in promql/parser/functions.go of v3.13.0, plus the limitk and
# limit_ratio aggregations), and those 3.0 removed (holt_winters became
# double_exponential_smoothing, itself experimental).
EXPERIMENTAL_FUNCTIONS = frozenset({
    "double_exponential_smoothing", "first_over_time", "histogram_quantiles", "info", "limit_ratio", "limitk",
    "mad_over_time", "max_of", "min_of", "sort_by_label", "sort_by_label_desc", "ts_of_first_over_time",
    "ts_of_last_over_time", "ts_of_max_over_time", "ts_of_min_over_time",
})
REMOVED_FUNCTIONS = frozenset({"holt_winters"})
# A window must hold this many scrapes: with Prometheus 3's left-open ranges a shorter one can hold a
# single sample, and rate() of one sample is nothing.
SCRAPES_PER_WINDOW = 4

# Grafana's variables, replaced by values of the right shape before a parser sees the query.
_GRAFANA_VALUES = {"$__rate_interval": "20s", "$__interval": "5s", "$__range": "1h"}
_GRAFANA_VARIABLE = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_EXACT_BUCKET_MATCH = re.compile(r'\b(le|quantile)\s*!?=\s*"(?!\+Inf")')
_FUNCTION = re.compile(r"\b([a-z_]+)\s*\(")
_RANGE = re.compile(r"\[\s*([^\]:]+?)\s*(?::[^\]]*)?\]")


def duration_seconds(text: str) -> float | None:
    """A PromQL duration literal in seconds, None where it is not one (a variable, say)."""
    try:
        return units.parse_duration(text, strict=True)
    except ValueError:
        return None


def rule_expressions() -> Iterator[tuple[str, str]]:
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                yield f"{path.relative_to(REPO)}: {name}", rule["expr"]
    for group in yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"]:
        for rule in group["rules"]:
            yield f"{PROMETHEUS_RULE.relative_to(REPO)}: {rule.get('alert') or rule.get('record')}", rule["expr"]


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for where, expr in lint.queries(dashboard):
            yield f"{path.name}: {where}", expr
        for where, selector in lint.variable_selectors(dashboard):
            yield f"{path.name}: {where}", selector


def doc_expressions() -> Iterator[tuple[str, str]]:
    """Each line of a ```promql block of the docs (the runbook writes one query a line)."""
    for path in DOCS:
        inside = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                inside = line.strip() == "```promql"
                continue
            if inside and line.strip():
                yield f"{path.relative_to(REPO)}:{number}", line


def all_expressions() -> list[tuple[str, str]]:
    return [*rule_expressions(), *dashboard_expressions(), *doc_expressions()]


def substitute(expr: str) -> str:
    """Grafana's variables replaced as Grafana would: intervals by durations, the rest by a regex."""
    for name, value in _GRAFANA_VALUES.items():
        expr = expr.replace(name, value)
    return _GRAFANA_VARIABLE.sub(".*", expr)


def shortest_scrape_window_seconds() -> float:
    """Four times the longest interval at which a shipped configuration scrapes the exporter."""
    longest = 0.0
    for path in SCRAPE_CONFIGS:
        document = yaml.safe_load(path.read_text())
        jobs = document["scrape_configs"] if isinstance(document, dict) else document
        default = duration_seconds((document.get("global") or {}).get("scrape_interval", "1m")) \
            if isinstance(document, dict) else 60.0
        for job in jobs:
            if "kvcache" in job["job_name"]:
                longest = max(longest, duration_seconds(job.get("scrape_interval", "")) or default)
    return SCRAPES_PER_WINDOW * longest


def problems(expr: str, min_window_seconds: float, dashboard: bool = False) -> list[str]:
    """The constructs whose meaning differs between Prometheus 2 and 3, or that 3 refuses by default."""
    found = []
    bare = _STRING.sub('""', expr)
    for match in _EXACT_BUCKET_MATCH.finditer(expr):
        found.append(f"exact {match.group(1)} match: Prometheus 3 stores {match.group(1)} values normalised "
                     f"(le=\"1\" as \"1.0\"); match a regex or aggregate by {match.group(1)}")
    for name in _FUNCTION.findall(bare):
        if name in REMOVED_FUNCTIONS:
            found.append(f"{name}() was removed in Prometheus 3")
        elif name in EXPERIMENTAL_FUNCTIONS:
            found.append(f"{name}() needs --enable-feature=promql-experimental-functions on Prometheus 3")
    for window in _RANGE.findall(bare):
        if dashboard and window in ("$__interval", "${__interval}"):
            found.append(f"range [{window}] can hold fewer than {SCRAPES_PER_WINDOW} scrapes; use $__rate_interval")
        seconds = duration_seconds(window)
        if seconds is not None and seconds < min_window_seconds:
            found.append(f"range [{window}] is shorter than {SCRAPES_PER_WINDOW} scrape intervals "
                         f"({min_window_seconds:g}s): on Prometheus 3 it can hold a single sample")
    return found


def prometheus3_syntax_errors(exprs: list[str]) -> list[list[int]]:
    """For each expression, the offsets where Prometheus 3's grammar finds an error (none: it parses)."""
    result = subprocess.run([require_binary("node"), str(GRAMMAR_DIR / "parse.mjs")], input=json.dumps(exprs), capture_output=True,
                            text=True, cwd=GRAMMAR_DIR, check=True, timeout=120)
    return json.loads(result.stdout)
