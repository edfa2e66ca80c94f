"""Durations and sizes: the one grammar the configuration, the rule generator and kv-math read and write."""

from __future__ import annotations

import re
from decimal import Decimal

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION_TERM = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_PROMETHEUS_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w|y))+")
_LENIENT_DURATION = re.compile(f"(?:{_DURATION_TERM.pattern})+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_duration(text: str, strict: bool = False) -> float:
    """Seconds in a Prometheus duration (`90s`, `1h30m`, `500ms`, `1d`). Unless `strict` (what a
    Prometheus rule file takes), a term may be a decimal (`2.5s`) and a bare number counts seconds."""
    text = text.strip()
    if (_PROMETHEUS_DURATION if strict else _LENIENT_DURATION).fullmatch(text):
        return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_TERM.findall(text))
    if not strict and _NUMBER.fullmatch(text):
        return float(text)
    raise ValueError(f"not a duration: {text!r} (write e.g. 5s, 500ms, 1m30s)")


def format_duration(seconds: float) -> str:
    """The shortest Prometheus duration for `seconds`, to the millisecond."""
    millis = round(seconds * 1000)
    if millis <= 0:
        raise ValueError(f"duration must be positive, got {seconds}s")
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if millis % size == 0:
            return f"{millis // size}{unit}"
    return f"{millis}ms"


def parse_size(text: str) -> int:
    """Bytes in `40GiB`, `80GB`, `512 MiB`, `1.5TiB` or a plain number (decimal units are powers
    of 1000, binary ones of 1024; case does not matter); a fraction of a byte is dropped."""
    match = _SIZE.fullmatch(text)
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not unit:
        raise ValueError(f"not a size: {text!r} (write e.g. 40GiB, 80GB, 512MiB)")
    return int(Decimal(match.group(1)) * unit)


def format_bytes(count: int) -> str:
    """`131072` -> `128 KiB`, `70272` -> `68.62 KiB`."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{count} B"
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"
