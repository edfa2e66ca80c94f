"""The README's first-screen tables, written from what they summarize so that they cannot drift from it.

    python -m devtools.readme [--check]

Between its markers in README.md: the alerts (alerts/kvcache-rules.yml, as `make alerts` writes it: severity,
what fires in the words of each rule's summary, and for how long; a page's condition on a row of its own), the
pressure states (exporter/contract.py's words, the rule of each from docs/metrics.md's generator with the
thresholds' defaults) and the cost per engine (the first table of docs/performance.md that measures the whole
monitoring path). `make docs` and `make alerts` run it; tests/unit/test_readme.py fails when the committed README
differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from devtools.contract_doc import STATE_RULES
from kvcache_exporter import contract

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RULES = REPO / "alerts" / "kvcache-rules.yml"
PERFORMANCE = REPO / "docs" / "performance.md"
SEVERITIES = ("critical", "warning", "info")  # as alerts/alertmanager.yml routes them: page, chat, record
# The bench's poll interval (docs/performance.md: every path polls or scrapes at 5 s).
BENCH_INTERVAL_SECONDS = 5.0
ENGINES = {"vllm": "vLLM", "sglang": "SGLang (DP=2 x TP=2: two pools)"}
COST_SIZES = (100, 2000)


def markers(section: str) -> tuple[str, str]:
    return (f"<!-- {section}: python -m devtools.readme writes this table (make docs) -->",
            f"<!-- end of {section} -->")


def _without_templates(text: str) -> str:
    """A rule's summary as words: the alerting series' labels (`{{ $labels.target }} (model ...): `) dropped."""
    head, sep, rest = text.partition(": ")
    if sep and "{{" in head:
        text = rest
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text).strip()
    first = text.split(" ", 1)[0]
    return text[0].lower() + text[1:] if first[1:].islower() else text  # "The exporter", not "KV transfers"


def alerts_table(rules_text: str) -> str:
    """One row per alert and condition, most severe first, then in the file's order: an alert's severities share a
    row where their summaries and durations are the same, and each has its own where they differ (the page's
    condition apart from the warning's)."""
    rows: dict[tuple[str, str, str], list[str]] = {}
    for group in yaml.safe_load(rules_text)["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                condition = (rule["alert"], _without_templates(rule["annotations"]["summary"]), rule.get("for", "0s"))
                rows.setdefault(condition, []).append(rule["labels"]["severity"])
    unknown = {s for severities in rows.values() for s in severities} - set(SEVERITIES)
    if unknown:
        raise LookupError(f"{RULES.name}: severities {sorted(unknown)} are not among {SEVERITIES}")
    ordered = sorted(rows.items(), key=lambda item: min(SEVERITIES.index(s) for s in item[1]))
    lines = ["| severity | alert | fires when | for |", "|---|---|---|---|"]
    for (name, summary, for_), severities in ordered:
        shown = ", ".join(sorted(set(severities), key=SEVERITIES.index))
        lines.append(f"| {shown} | [{name}](alerts/runbook.md#{name.lower()}) | {summary} | {for_} |")
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    return re.match(r"(.*?\.)(\s|$)", text, re.S).group(1)


def states_table() -> str:
    """The states in the order the exporter tests them: the first whose rule holds is the pool's state."""
    if set(STATE_RULES) != set(contract.PRESSURE_STATE_MEANINGS):
        raise LookupError(f"STATE_RULES covers {sorted(STATE_RULES)}, PRESSURE_STATE_MEANINGS "
                          f"{sorted(contract.PRESSURE_STATE_MEANINGS)}")
    lines = ["| state | means | when (the first that holds; the defaults of `pressure:`) |", "|---|---|---|"]
    for state, rule in STATE_RULES.items():
        lines.append(f"| `{state}` | {contract.PRESSURE_STATE_MEANINGS[state]} | {_first_sentence(rule)} |")
    return "\n".join(lines)


def _paths_table(performance_text: str) -> tuple[str, str, list[dict[str, str]]]:
    """The first table in docs/performance.md with a `path` and a `head series` column: the heading it is under,
    the commit its text names, and its rows."""
    lines = performance_text.splitlines()
    heading, commit = "", ""
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading, commit = line.lstrip("#").strip(), ""
        commit = commit or next(iter(re.findall(r"\bCommit ([0-9a-f]{7,})", line)), "")
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and "path" in cells and "head series" in cells:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (cell.strip() for cell in row.strip().strip("|").split("|")))))
            return heading, commit, rows
    raise LookupError(f"{PERFORMANCE.name}: no table with `path` and `head series` columns")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def cost_table(performance_text: str) -> str:
    """Head series per engine in Prometheus and the exporter's CPU per poll, at 100 and 2,000 engines."""
    heading, commit, rows = _paths_table(performance_text)

    def row(workload: str, size: int, path: str) -> dict[str, str]:
        for r in rows:
            if r["workload"] == workload and _number(r["N"]) == size and r["path"].startswith(path):
                return r
        raise LookupError(f"{PERFORMANCE.name}: no row for {workload} at {size} engines, path {path}")

    lines = ["| engine page | series per engine in Prometheus: through the exporter (rules' included) "
             "| scraping the engine itself | exporter CPU per poll (cores x 5 s / engines) |", "|---|---|---|---|"]
    for workload, title in ENGINES.items():
        through, direct, cpu = [], [], []
        for size in COST_SIZES:
            exporter, scraped = row(workload, size, "exporter"), row(workload, size, "direct")
            through.append(f"{_number(exporter['head series']) / size:,.0f} at {size:,} engines")
            direct.append(f"{_number(scraped['head series']) / size:,.0f}")
            cores = _number(re.search(r"\+ ([0-9.]+)\)", exporter["CPU, cores (Prometheus + exporter)"]).group(1))
            replicas = exporter["path"].removeprefix("exporter").strip(", ") or "one process"
            cpu.append(f"{cores * BENCH_INTERVAL_SECONDS / size * 1e6:,.0f} µs at {size:,} ({replicas})")
        lines.append(f"| {title} | {', '.join(through)} | {', '.join(sorted(set(direct)))} | {', '.join(cpu)} |")
    anchor = re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
    return "\n".join(lines) + (f"\n\nMeasured at commit {commit} on a 2-core machine, every engine polled every "
                               f"{BENCH_INTERVAL_SECONDS:g} s: [docs/performance.md, {heading}]"
                               f"(docs/performance.md#{anchor}).")


def sections() -> dict[str, str]:
    return {"alerts": alerts_table(RULES.read_text()), "pressure states": states_table(),
            "cost per engine": cost_table(PERFORMANCE.read_text())}


def render(readme: str, tables: dict[str, str]) -> str:
    """`readme` with each section's table between its markers. Raises LookupError naming a missing marker."""
    for section, table in tables.items():
        start, end = markers(section)
        before, found, rest = readme.partition(start + "\n")
        _, found_end, after = rest.partition(end)
        if not (found and found_end):
            raise LookupError(f"README.md lacks the markers of the {section} table:\n{start}\n{end}")
        readme = f"{before}{start}\n{table}\n{end}{after}"
    return readme


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.readme", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if README.md differs")
    args = parser.parse_args(argv)
    current = README.read_text()
    try:
        text = render(current, sections())
    except LookupError as err:
        print(f"python -m devtools.readme: {err.args[0]}", file=sys.stderr)
        return 2
    if args.check:
        if text != current:
            print(f"{README} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
