"""Checks of a dashboard's JSON against the house rules; `problems()` lists what breaks them.

The build refuses to write a dashboard with problems, and the tests run the same checks over
the committed JSON. Rules: every panel reads the `datasource` variable and has a unit and a
description that says what to do when it is red; queries read only series that
exporter/contract.py defines (never a raw `vllm:`/`sglang:` series, never a misspelt name);
counters appear only inside rate()/increase() (so no ratio of lifetime counters); every range is
$__rate_interval; histogram_quantile() takes `sum by (le, ...)` that keeps `target` or `engine`
(buckets of unlike layouts never add up) and is never divided by another quantile; a `_ratio`
gauge is never summed or averaged across series.
"""

from __future__ import annotations

import re
from typing import Iterator

from kvcache_exporter import contract

from kvcache_exporter.dashboards.panels import DATASOURCE, RED_ADVICE

DATASOURCE_UID = DATASOURCE.uid
RAW_ENGINE_PREFIXES = ("vllm:", "sglang:")
# Series a dashboard may read besides the contract: Prometheus' own alert state.
NON_CONTRACT_SERIES = frozenset({"ALERTS"})
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# Labels that keep a quantile's buckets within one engine's layout.
ONE_LAYOUT_LABELS = frozenset({"target", "engine"})


CONTRACT_SERIES = frozenset(series for family in contract.FAMILIES.values() for series in family.series)

_PROMQL_WORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
    "bool", "inf", "nan",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![A-Za-z0-9_:.$])[A-Za-z_:][A-Za-z0-9_:]*")
_RANGE = re.compile(r"\[([^\]]*)\]")
_WRAPPED_COUNTER = r"\b(?:rate|increase)\(\s*{name}(?:\{{[^}}]*\}})?\[[^\]]*\](?:\s+offset\s+\w+)?\s*\)"
_QUANTILE = re.compile(r"histogram_quantile\(")
_QUANTILE_OVER_BUCKETS = re.compile(r"histogram_quantile\(\s*[0-9.]+\s*,\s*sum by \((?P<labels>[^)]*)\)")
_AGGREGATED_RATIO = re.compile(r"\b(?:sum|avg)\b(?:\s*by\s*\([^)]*\))?\s*\(\s*\w+_ratio\b")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*\w+\)$")


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that shows data, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation of the dashboard."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} query {target.get('refId')}", target.get("expr", "")
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("builtIn"):
            continue
        yield f"annotation {annotation.get('name')!r}", annotation.get("target", {}).get("expr", "")


def variable_selectors(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, selector) of every `label_values(selector, label)` query variable."""
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            match = _LABEL_VALUES.match(str(variable.get("query", "")))
            yield f"variable {variable.get('name')!r}", match.group("selector") if match else ""


def metric_names(expr: str) -> list[str]:
    """Series names an expression selects (function names, label names and keywords removed)."""
    text = _STRING.sub('""', expr)
    text = _LABEL_LIST.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = _RANGE.sub(" ", text)
    names = []
    for match in _NAME.finditer(text):
        name = match.group()
        following = text[match.end():].lstrip()[:1]
        if following != "(" and name.lower() not in _PROMQL_WORDS:
            names.append(name)
    return names


def expression_problems(expr: str) -> list[str]:
    if not expr.strip():
        return ["empty query"]
    found = []
    for prefix in RAW_ENGINE_PREFIXES:
        if prefix in expr:
            found.append(f"names a raw engine series ({prefix})")
    names = metric_names(expr)
    for name in names:
        if name not in CONTRACT_SERIES and name not in NON_CONTRACT_SERIES:
            found.append(f"reads {name}, which is not in the kvcache_* contract (exporter/contract.py)")
    for name in sorted({n for n in names if n.endswith(COUNTER_SUFFIXES)}):
        wrapped = len(re.findall(_WRAPPED_COUNTER.format(name=re.escape(name)), expr))
        if wrapped != len(re.findall(rf"\b{re.escape(name)}\b", expr)):
            found.append(f"uses counter {name} outside rate()/increase()")
    for window in _RANGE.findall(_STRING.sub('""', expr)):
        if window != "$__rate_interval":
            found.append(f"range [{window}] is not [$__rate_interval]")
    bucket_sums = [{label.strip() for label in match.group("labels").split(",")}
                   for match in _QUANTILE_OVER_BUCKETS.finditer(expr)]
    if len(_QUANTILE.findall(expr)) != len([labels for labels in bucket_sums if "le" in labels]):
        found.append("histogram_quantile() without sum by (le, ...)")
    if any("le" in labels and not labels & ONE_LAYOUT_LABELS for labels in bucket_sums):
        found.append("histogram_quantile() over a sum that drops target and engine: it adds unlike bucket layouts")
    if divides_quantiles(expr):
        found.append("divides one histogram_quantile() by another: unlike buckets make the quotient an artefact")
    if _AGGREGATED_RATIO.search(expr):
        found.append("sums or averages a ratio gauge across series instead of dividing sums")
    return found


def divides_quantiles(expr: str) -> bool:
    """Whether some `/` has a histogram_quantile() on both sides within its enclosing parentheses."""
    text = _STRING.sub('""', expr)
    opened: list[int] = []
    groups: dict[int, tuple[int, int]] = {}  # position of a `/` -> (start, end) of its enclosing group
    slashes: list[tuple[int, int]] = []  # (position, depth)
    for position, char in enumerate(text):
        if char == "(":
            opened.append(position)
        elif char == ")" and opened:
            start = opened.pop()
            for slash, depth in slashes:
                if slash not in groups and slash > start and depth == len(opened) + 1:
                    groups[slash] = (start, position)
        elif char == "/":
            slashes.append((position, len(opened)))
    for slash, _ in slashes:
        start, end = groups.get(slash, (0, len(text)))
        if "histogram_quantile(" in text[start:slash] and "histogram_quantile(" in text[slash:end]:
            return True
    return False


def _datasource_problems(where: str, ref: object) -> list[str]:
    uid = ref.get("uid") if isinstance(ref, dict) else None
    return [] if uid == DATASOURCE_UID else [f"{where}: datasource is {ref!r}, not the {DATASOURCE_UID} variable"]


def problems(dashboard: dict) -> list[str]:
    found: list[str] = []
    for panel in panels(dashboard):
        where = f"panel {panel.get('title')!r}"
        found += _datasource_problems(where, panel.get("datasource"))
        for target in panel.get("targets", []):
            if "datasource" in target:
                found += _datasource_problems(f"{where} query {target.get('refId')}", target["datasource"])
        if not panel.get("targets"):
            found.append(f"{where}: no query")
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            found.append(f"{where}: no unit")
        if RED_ADVICE not in (panel.get("description") or ""):
            found.append(f"{where}: description does not say what to do when it is red ({RED_ADVICE!r})")
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if not annotation.get("builtIn"):
            found += _datasource_problems(f"annotation {annotation.get('name')!r}", annotation.get("datasource"))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            found += _datasource_problems(f"variable {variable.get('name')!r}", variable.get("datasource"))
    for where, expr in queries(dashboard):
        found += [f"{where}: {problem}" for problem in expression_problems(expr)]
    for where, selector in variable_selectors(dashboard):
        found += [f"{where}: {problem}" for problem in expression_problems(selector)]
    return found
