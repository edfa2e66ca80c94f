"""Each test's tier is the directory it lives in (tests/unit, tests/integration, tests/e2e, tests/real): `-m unit`
selects the unit tier."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e", "real")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: in no tier: move it to one of tests/{{{','.join(TIERS)}}}/ "
                                    "(tests/conftest.py marks each test by its directory)")
        item.add_marker(tier)
