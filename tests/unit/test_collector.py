"""The exporter's tuning of the cyclic garbage collector (exporter/runtime/collector.py)."""

from __future__ import annotations

import gc

import pytest

from kvcache_exporter.runtime import collector


@pytest.fixture
def restored_collector():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_what_exists_at_start_is_frozen_and_generation0_collects_rarely(restored_collector):
    kept = [[i] for i in range(1000)]  # containers the process holds from its start (targets, configuration)
    older = gc.get_threshold()[1:]
    collector.tune()
    assert gc.get_threshold() == (collector.GENERATION0_THRESHOLD, *older)
    assert gc.get_freeze_count() >= len(kept)
    # A poll's worth of short-lived containers (a page's samples) no longer triggers a collection.
    before = gc.get_stats()[0]["collections"]
    for _ in range(20):
        _samples = [(f"name_{i}", {"le": str(i)}, float(i)) for i in range(700)]
    assert gc.get_stats()[0]["collections"] == before
