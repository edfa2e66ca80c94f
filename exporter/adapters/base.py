"""The table machinery every adapter shares: declared series in, a normalized Snapshot out.

An adapter is mostly data: for each concept, the wire names that carry it across versions
(preferred first: the first one present on the page wins), label filters, and which labels
are breakdowns to sum. Everything else on a sample (TP/PP ranks, `pid`) is a duplicate of the
same value and is collapsed with max, never summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..parser import ParseError, Sample
from ..snapshot import Histogram, RankValues, Snapshot

Kind = Literal["gauge", "counter", "histogram"]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Series:
    concept: str
    names: tuple[str, ...]
    kind: Kind = "gauge"
    match: dict[str, str] = field(default_factory=dict)
    sum_over: tuple[str, ...] = ()
    # A family the engine creates on first use: read it as 0 while any of these names is on the page.
    zero_when_present: tuple[str, ...] = ()


Samples = dict[str, list[Sample]]
_UNSEEN = object()
# Distinct (series, label set) pairs remembered; a fleet serving one model shares most of them.
_SLICE_CACHE_LIMIT = 500_000


class Adapter:
    engine: ClassVar[str]
    marker: ClassVar[str]  # a regex matching the start of this engine's sample names
    rank_label: ClassVar[str]  # the label that tells data-parallel replicas apart
    series: ClassVar[tuple[Series, ...]]
    base_match: ClassVar[dict[str, str]] = {}
    extra_names: ClassVar[tuple[str, ...]] = ()  # read by the `complete` hook

    def __init__(self) -> None:
        names: set[str] = set(self.variants_of(self.extra_names))
        for series in self.series:
            names.update(self.variants_of(series.zero_when_present))
            for name in self.variants_of(series.names):
                if series.kind == "histogram":
                    names.update(name + suffix for suffix in HISTOGRAM_SUFFIXES)
                else:
                    names.add(name)
        self.wanted = frozenset(names)
        self._slices: dict[tuple, tuple | None] = {}

    # Re-exporters (SGLang's router, gRPC sidecars, Dynamo, Ray) rewrite the engine's colon prefix.
    prefix_aliases: ClassVar[tuple[str, ...]] = ()

    def variants_of(self, names: tuple[str, ...]) -> list[str]:
        """Spellings under which a declared name may appear: as declared, then under each alias prefix."""
        out = []
        for name in names:
            out.append(name)
            head, sep, tail = name.partition(":")
            out.extend(alias + tail for alias in self.prefix_aliases if sep)
        return out

    def first_present(self, names: tuple[str, ...], samples: Samples, suffix: str = "") -> str | None:
        for name in names:
            for variant in self.variants_of((name,)):
                if variant + suffix in samples:
                    return variant
        return None

    def rank_of(self, labels: dict[str, str]) -> str:
        return labels.get(self.rank_label, "0")

    def _slice_of(self, sample: Sample, series: Series, extra_key: str | None) -> tuple | None:
        """(rank, breakdown slice[, extra label]) of a sample, or None when the series' filters reject it.
        Label sets repeat from poll to poll, so the answer is cached by label text."""
        cache_key = (series.concept, sample.label_text, extra_key)
        slice_key = self._slices.get(cache_key, _UNSEEN)
        if slice_key is _UNSEEN:
            labels = sample.labels
            slice_key = None
            if all(labels.get(k, "") == v for wanted in (self.base_match, series.match) for k, v in wanted.items()):
                slice_key = (self.rank_of(labels), tuple(labels.get(label, "") for label in series.sum_over))
                if extra_key is not None:
                    slice_key += (labels.get(extra_key, ""),)
            if len(self._slices) >= _SLICE_CACHE_LIMIT:
                self._slices.clear()
            self._slices[cache_key] = slice_key
        return slice_key

    def _collapse(self, samples: list[Sample], series: Series, extra_key: str | None = None) -> dict:
        """Per rank: max over duplicate copies of each breakdown slice, then the sum over slices."""
        slices: dict[tuple, float] = {}
        for sample in samples:
            key = self._slice_of(sample, series, extra_key)
            if key is None:
                continue
            value = sample.value
            seen = slices.get(key)
            if seen is None or value > seen or seen != seen:  # seen != seen: NaN loses to a number
                slices[key] = value
        totals: dict = {}
        for key, value in slices.items():
            out_key = key[0] if extra_key is None else (key[0], key[2])
            totals[out_key] = totals.get(out_key, 0.0) + value
        return totals

    def adapt(self, samples: Samples) -> Snapshot:
        ranks: dict[str, RankValues] = {}

        def rank(name: str) -> RankValues:
            return ranks.setdefault(name, RankValues())

        for series in self.series:
            if series.kind == "histogram":
                self._adapt_histogram(series, samples, rank)
                continue
            name = self.first_present(series.names, samples)
            target = "counters" if series.kind == "counter" else "gauges"
            if name is None:
                if series.zero_when_present and self.first_present(series.zero_when_present, samples):
                    for rank_name in self._ranks_on_page(samples, series.zero_when_present):
                        getattr(rank(rank_name), target)[series.concept] = 0.0
                continue
            for rank_name, value in self._collapse(samples[name], series).items():
                if math.isfinite(value):  # NaN and Inf are "no reading" (sentinels, unset timers), never a value
                    getattr(rank(rank_name), target)[series.concept] = value
        snapshot = Snapshot(engine=self.engine, model=self.model_of(samples), version="", ranks=ranks)
        self.complete(samples, snapshot)
        return snapshot

    def _ranks_on_page(self, samples: Samples, names: tuple[str, ...]) -> set[str]:
        found = set()
        for name in self.variants_of(names):
            found.update(self.rank_of(s.labels) for s in samples.get(name, ()))
        return found

    def _adapt_histogram(self, series: Series, samples: Samples, rank) -> None:
        name = self.first_present(series.names, samples, suffix="_bucket")
        if name is None:
            return
        buckets = self._collapse(samples[name + "_bucket"], series, extra_key="le")
        sums = self._collapse(samples.get(name + "_sum", []), series)
        counts = self._collapse(samples.get(name + "_count", []), series)
        per_rank: dict[str, list[tuple[float, float]]] = {}
        for (rank_name, le), value in buckets.items():
            try:
                bound = float(le)
            except ValueError:
                raise ParseError(f"{name}_bucket: bucket bound le={le!r} is not a number") from None
            per_rank.setdefault(rank_name, []).append((bound, value))
        for rank_name, pairs in per_rank.items():
            pairs.sort()
            if not math.isinf(pairs[-1][0]) or rank_name not in sums:
                continue  # without its +Inf bucket or its sum a histogram is incomplete
            count = counts.get(rank_name, pairs[-1][1])
            rank(rank_name).histograms[series.concept] = Histogram(pairs, sums[rank_name], count)

    def model_of(self, samples: Samples) -> str:
        for series in self.series:
            for name in self.variants_of(series.names):
                for sample in samples.get(name, samples.get(name + "_count", ())):
                    model = sample.labels.get("model_name")
                    if model:
                        return model
        return ""

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        """Hook for what a table cannot say (info-style labels and the like)."""
