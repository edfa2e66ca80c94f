"""The one grammar of durations and sizes (exporter/units.py)."""

from __future__ import annotations

import pytest

from kvcache_exporter.units import format_bytes, format_duration, parse_duration, parse_size

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("2m", 120), ("1h30m", 5400), ("500ms", 0.5), ("1d", 86400)])
def test_parse_prometheus_duration(text, seconds):
    assert parse_duration(text, strict=True) == seconds
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "1.5m", "m5", "2m x", "-1s"])
def test_strict_duration_is_what_a_prometheus_rule_takes(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text, strict=True)


@pytest.mark.parametrize("text,seconds", [("5", 5), ("2.5s", 2.5), ("0.25s", 0.25), ("1.5m", 90), (" 1m30s ", 90)])
def test_configuration_durations_take_decimals_and_bare_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m5", "5 s x", "1e3s", "-1s", "5sec"])
def test_malformed_durations_are_refused(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds,text", [(7200, "2h"), (90, "90s"), (120, "2m"), (0.25, "250ms"), (3, "3s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text, strict=True) == seconds


@pytest.mark.parametrize(
    "text, size",
    [("40GiB", 40 * GiB), ("80GB", 80 * 10**9), ("512 MiB", 512 * MiB), ("1.5TiB", 3 * 2**39),
     ("1000", 1000), ("64gi", 64 * GiB), ("2k", 2000), ("16MiB", 16 * MiB)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "40 XB", "-1GiB", "4e9", "40GiBs"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    "count, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (131072, "128 KiB"), (3 * GiB // 2, "1.5 GiB")]
)
def test_format_bytes(count, text):
    assert format_bytes(count) == text
