"""The README's first screen: its tables are what devtools/readme.py writes from the rules, the contract and the
performance page (so a changed alert, state or measurement shows there or fails here), and its picture is a
small PNG in docs/. tests/e2e/test_docs_examples.py runs its commands."""

from __future__ import annotations

import re
import struct

import yaml

from devtools import readme

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_committed_readme_is_the_generated_one():
    assert readme.main(["--check"]) == 0, "README.md's tables are out of date: run `make docs`"


def test_check_mode_finds_a_changed_table(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(readme.README.read_text().replace("| 2m |", "| 3m |", 1))
    monkeypatch.setattr(readme, "README", stale)
    assert readme.main(["--check"]) == 1
    assert "run `make docs`" in capsys.readouterr().err


def _rules(*alerts: tuple[str, str, str, str]) -> str:
    """A rule file of (alert, severity, for, summary) alerts and a recording rule."""
    return yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": "1"}] + [
        {"alert": name, "expr": "1", "for": for_, "labels": {"severity": severity}, "annotations": {"summary": summary}}
        for name, severity, for_, summary in alerts]}]})


def test_an_alert_whose_severities_say_the_same_is_one_row_most_severe_first():
    storm = "{{ $labels.target }} (model {{ $labels.model }}): the {{ $labels.tier }} tier rains"
    table = readme.alerts_table(_rules(("Quiet", "info", "30m", "{{ $labels.model }}: something to know"),
                                       ("Storm", "warning", "5m", storm), ("Storm", "critical", "5m", storm),
                                       ("Gone", "critical", "5m", "The exporter is gone")))
    assert table.splitlines()[2:] == [
        "| critical, warning | [Storm](alerts/runbook.md#storm) | the tier rains | 5m |",
        "| critical | [Gone](alerts/runbook.md#gone) | the exporter is gone | 5m |",
        "| info | [Quiet](alerts/runbook.md#quiet) | something to know | 30m |",
    ]


def test_a_page_whose_condition_differs_from_the_warnings_is_a_row_of_its_own():
    """What pages is read apart from what warns: the critical rule's words (and duration) on the critical rows."""
    where = "{{ $labels.target }} (model {{ $labels.model }}): "
    table = readme.alerts_table(_rules(("Queue", "warning", "2m", where + "requests queue"),
                                       ("Queue", "critical", "2m", where + "requests queue, and users wait"),
                                       ("Storm", "warning", "5m", "it rains"), ("Storm", "critical", "10m", "it rains")))
    assert table.splitlines()[2:] == [
        "| critical | [Queue](alerts/runbook.md#queue) | requests queue, and users wait | 2m |",
        "| critical | [Storm](alerts/runbook.md#storm) | it rains | 10m |",
        "| warning | [Queue](alerts/runbook.md#queue) | requests queue | 2m |",
        "| warning | [Storm](alerts/runbook.md#storm) | it rains | 5m |",
    ]


def test_the_cost_is_read_from_the_first_whole_path_table():
    rows = "\n".join(f"| {w} | {n:,} | {p} | {cpu} | {series:,} |" for w, n, p, cpu, series in (
        ("vllm", 100, "direct", "0.027", 44_000), ("vllm", 100, "exporter", "0.022 (0.007 + 0.014)", 14_271),
        ("vllm", 2000, "direct", "0.363", 880_000), ("vllm", 2000, "exporter, 8 replicas", "0.379 (0.129 + 0.250)", 284_999),
        ("sglang", 100, "direct", "0.028", 33_500), ("sglang", 100, "exporter", "0.030 (0.009 + 0.021)", 17_132),
        ("sglang", 2000, "direct", "0.348", 670_000),
        ("sglang", 2000, "exporter, 8 replicas", "0.549 (0.185 + 0.363)", 342_263)))
    page = ("### Newest\n\nCommit abc1234, the bench.\n\n"
            "| workload | N | path | CPU, cores (Prometheus + exporter) | head series |\n|---|---|---|---|---|\n"
            f"{rows}\n\n### Older\n\n| workload | N | path | head series |\n|---|---|---|---|\n| vllm | 1 | direct | 9 |\n")
    table = readme.cost_table(page).splitlines()
    # 14,271 / 100 = 143; 284,999 / 2,000 = 142; 44,000 / 100 = 880,000 / 2,000 = 440; 0.014 cores x 5 s / 100 =
    # 700 µs; 0.250 x 5 / 2,000 = 625 µs. SGLang: 171, 335, 0.021 x 5 / 100 = 1,050 µs, 0.363 x 5 / 2,000 = 908 µs.
    assert table[2] == ("| vLLM | 143 at 100 engines, 142 at 2,000 engines | 440 | 700 µs at 100 (one process), "
                        "625 µs at 2,000 (8 replicas) |")
    assert table[3].endswith("| 171 at 100 engines, 171 at 2,000 engines | 335 | 1,050 µs at 100 (one process), "
                             "908 µs at 2,000 (8 replicas) |")
    assert "commit abc1234" in table[-1] and "(docs/performance.md#newest)" in table[-1]


def test_every_pressure_state_has_a_row_in_the_order_the_exporter_tests_them():
    states = [re.match(r"\| `(\w+)` \|", line)[1] for line in readme.states_table().splitlines()[2:]]
    assert states == ["thrashing", "saturated", "capped", "tight", "ok"]


def test_the_picture_is_a_small_png_under_docs():
    (path,) = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", readme.README.read_text().split("## Pointing it at a fleet")[0])
    assert path.startswith("docs/")
    data = (readme.REPO / path).read_bytes()
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert data[:8] == PNG_SIGNATURE and len(data) < 300_000 and width >= 800, (path, len(data), width, height)


def test_the_probe_endpoints_engine_list_is_the_registrys():
    from kvcache_exporter.adapters import ADAPTERS

    (listed,) = re.findall(r"/probe\?target=URL&engine=(auto\|[a-z|]+)", readme.README.read_text())
    engines = listed.split("|")
    assert len(engines) == len(set(engines)) and set(engines) == {"auto", *ADAPTERS}, engines
