"""Every PromQL expression we ship parses on Prometheus 2.42 (Debian's promtool) and on Prometheus 3
(its own PromQL grammar, tests/promql3/, run by node). tests/unit/test_promql_compat.py says why."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from devtools import harness, promql_compat

EXPRESSIONS = promql_compat.all_expressions()


def test_prometheus3_grammar_parses_every_expression():
    exprs = [promql_compat.substitute(expr) for _, expr in EXPRESSIONS]
    failures = [(where, expr, offsets) for (where, expr), offsets
                in zip(EXPRESSIONS, promql_compat.prometheus3_syntax_errors(exprs)) if offsets]
    assert failures == []


@pytest.mark.parametrize("expr", ["holt_winters(kvcache_usage_ratio[10m], 0.5, 0.5)", "sum(rate(x[1m]) by (le)",
                                  "kvcache_usage_ratio{target=\"a\""])
def test_prometheus3_grammar_refuses_what_it_does_not_know(expr):
    assert promql_compat.prometheus3_syntax_errors([expr])[0]


def test_promtool_2_42_parses_every_expression(tmp_path):
    rules = [{"record": f"compat:expression_{i}", "expr": promql_compat.substitute(expr)}
             for i, (_, expr) in enumerate(EXPRESSIONS)]
    path = tmp_path / "all.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "compat", "rules": rules}]}))
    result = subprocess.run([harness.require_binary("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout
