"""Each test's tier is the directory it lives in (tests/unit, tests/integration, tests/e2e): `-m unit` selects it."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e", "real")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)
