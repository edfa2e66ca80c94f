"""The last lines `make test` prints: every test of every tier that did not pass, with the line that says why.

Each tier writes a JUnit XML report (pytest --junitxml); a CI log that keeps only its end still names every failure
and error, those of the first tier included (a setup error's summary line is otherwise hundreds of lines up).

    python -m devtools.recap .test-results/*.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

WIDTH = 200  # characters of the reason kept on a test's line


def reason(element: ET.Element) -> str:
    """The line that says why: the message pytest gave, or the last line of the traceback."""
    text = element.get("message") or ""
    if not text.strip():
        traceback = (element.text or "").strip().splitlines()
        text = traceback[-1] if traceback else ""
    line = " ".join(text.split())
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def recap(report: Path) -> list[str]:
    """One line for the report's tier and one per test that failed or errored in it."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    lines, counts = [], {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            for kind in ("failure", "error"):
                for element in case.findall(kind):
                    lines.append(f"  {kind.upper()} {name}: {reason(element)}")
    head = ", ".join(f"{value} {key}" for key, value in counts.items())
    return [f"{report.stem}: {head}", *lines]


def main(argv: list[str]) -> int:
    print("\nrecap of the tiers' reports:")
    for argument in argv:
        report = Path(argument)
        if not report.is_file():
            print(f"{report.stem}: no report (the tier did not run to its end)")
            continue
        try:
            print("\n".join(recap(report)))
        except ET.ParseError as err:
            print(f"{report}: not a JUnit report: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
