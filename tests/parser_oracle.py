"""prometheus_client's parsers as the oracle for the differential tests of exporter.sources.parser."""

from __future__ import annotations

import math

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from kvcache_exporter.sources import parser


def is_openmetrics(text: str) -> bool:
    return text.rstrip().endswith("# EOF")


def oracle_samples(text: str) -> list[tuple]:
    """Every sample of the page per prometheus_client, as comparable tuples."""
    if is_openmetrics(text):
        return sorted(_key(s.name, s.labels, s.value) for family in parse_openmetrics(text) for s in family.samples)
    # The text parser names a counter's samples `x_total` even where the page writes `x` (Triton's
    # prometheus-cpp counters have no suffix): the name on the wire is the one to compare.
    on_page = {line.split("{", 1)[0].split(" ", 1)[0].strip() for line in text.splitlines()
               if line.strip() and not line.lstrip().startswith("#")}
    return sorted(_key(s.name if s.name in on_page else s.name.removesuffix("_total"), s.labels, s.value)
                  for family in parse_text(text) for s in family.samples)


def our_samples(text: str, names: frozenset[str] | None = None) -> list[tuple]:
    names = names if names is not None else frozenset(s[0] for s in oracle_samples(text))
    found = parser.parse(text, names)
    return sorted(_key(s.name, s.labels, s.value) for samples in found.values() for s in samples)


def _key(name: str, labels: dict, value: float) -> tuple:
    # NaN != NaN: compare it as a marker so equal pages compare equal.
    return (name, tuple(sorted(labels.items())), "NaN" if math.isnan(value) else float(value))
