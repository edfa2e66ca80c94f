"""docs/metrics.md, the public contract, is the text devtools/contract_doc.py generates from the code."""

from __future__ import annotations

import pytest

from devtools import contract_doc, harness
from kvcache_exporter import contract

DOC = harness.REPO / "docs" / "metrics.md"


def test_the_committed_contract_is_the_generated_one():
    assert DOC.read_text() == contract_doc.markdown(), "docs/metrics.md is out of date: run `make docs`"


def test_every_exposed_family_has_a_row():
    rows = [line.split("|")[1].strip() for line in DOC.read_text().splitlines()
            if line.startswith(("| `kvcache_", "| `process_", "| `python_"))]
    assert rows == [f"`{family.metric}`" for family in contract.FAMILIES.values()]


def test_check_mode_finds_drift(tmp_path, capsys):
    stale = tmp_path / "metrics.md"
    stale.write_text(DOC.read_text().replace("kvcache_usage_ratio", "kvcache_usage_percent"))
    assert (contract_doc.main(["--check", "--output", str(DOC)]), capsys.readouterr().err) == (0, "")
    assert (contract_doc.main(["--check", "--output", str(stale)]), capsys.readouterr().err) == (
        1, f"{stale} is out of date: run `make docs`\n")


def test_a_family_without_a_documented_source_stops_the_generator(monkeypatch):
    monkeypatch.setitem(contract_doc.NOT_REPORTED, "vllm", contract_doc.NOT_REPORTED["vllm"] - {"evictable_tokens"})
    with pytest.raises(LookupError, match="no source documented for vllm evictable_tokens: add it to"):
        contract_doc.markdown()


def test_a_pressure_state_without_a_rule_stops_the_generator(monkeypatch):
    monkeypatch.setattr(contract_doc.contract, "PRESSURE_STATES", contract_doc.contract.PRESSURE_STATES + ("stalled",))
    with pytest.raises(LookupError, match="STATE_RULES .* covers"):
        contract_doc.markdown()
