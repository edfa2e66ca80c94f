"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from devtools import harness


@pytest.fixture(params=["compiled", "reference"])
def fold(request):
    """The test with the adapters' compiled loops (cfold.pyx), then with their pure-Python reference: what an
    install without a C compiler runs must pass the same tests."""
    if request.param == "reference":
        with harness.reference_fold():
            yield request.param
    else:
        yield request.param
