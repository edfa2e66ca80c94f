"""make test's last lines (devtools/recap.py): every test that did not pass, with its reason, per tier."""

from __future__ import annotations

from devtools import recap

# A JUnit report as pytest writes it: one pass, a setup error and a failure whose message is in the body only.
REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="0" tests="3">
<testcase classname="tests.unit.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_err[x]" time="0.1">
<error message="failed on setup with &quot;RuntimeError: port 1234 in use&quot;">traceback</error></testcase>
<testcase classname="tests.integration.test_b" name="test_fail" time="0.2">
<failure message="">def test_fail():
&gt;   assert 1 == 2
E   assert 1 == 2</failure></testcase>
</testsuite></testsuites>"""


def test_each_test_that_did_not_pass_is_a_line_with_its_reason(tmp_path, capsys):
    report = tmp_path / "unit-integration.xml"
    report.write_text(REPORT)
    assert recap.main([str(report), str(tmp_path / "real.xml")]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "unit-integration: 3 tests, 1 failures, 1 errors, 0 skipped",
        '  ERROR tests/unit/test_a.py::test_err[x]: failed on setup with "RuntimeError: port 1234 in use"',
        "  FAILURE tests/integration/test_b.py::test_fail: E assert 1 == 2",
        "real: no report (the tier did not run to its end)",
    ]
