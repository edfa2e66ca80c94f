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

from ..sources.parser import ParseError, Sample, parse_labels
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
# Distinct label sets remembered per series; a fleet serving one model shares most of them.
_SLICE_CACHE_LIMIT = 50_000


class Adapter:
    engine: ClassVar[str]  # the `engine` label and the configuration's `engine:` value
    title: ClassVar[str]  # the engine's name in messages and documents
    model_label: ClassVar[str] = "model_name"  # the label that names the served model
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
        self._spellings: dict[tuple, list[tuple[str, str]]] = {}
        self._slices: dict[tuple, dict[str, tuple | None]] = {}  # by (concept, extra key), then label text

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
        spellings = self._spellings.get((names, suffix))
        if spellings is None:  # worked out once per adapter: this runs for every series at every poll
            spellings = self._spellings[names, suffix] = [(v, v + suffix) for v in self.variants_of(names)]
        for variant, name in spellings:
            if name in samples:
                return variant
        return None

    def rank_of(self, labels: dict[str, str]) -> str:
        return labels.get(self.rank_label, "0")

    def _slice_of(self, label_text: str, series: Series, extra_key: str | None) -> tuple | None:
        """(output key, breakdown slice) of a label set, or None when the series' filters reject it. The
        output key is the rank, or (rank, bucket bound) for the `le` of a histogram bucket."""
        labels = parse_labels(label_text) if label_text else {}
        if not all(labels.get(k, "") == v for wanted in (self.base_match, series.match) for k, v in wanted.items()):
            return None
        out_key = self.rank_of(labels)
        if extra_key is not None:
            bound = labels.get(extra_key, "")
            try:
                out_key = (out_key, float(bound))
            except ValueError:
                raise ParseError(f"{series.concept}: bucket bound {extra_key}={bound!r} is not a number") from None
        return out_key, tuple(labels.get(label, "") for label in series.sum_over)

    def _collapse(self, samples: list[Sample], series: Series, extra_key: str | None = None) -> dict:
        """Per output key: max over duplicate copies of each breakdown slice, then the sum over slices.
        Label sets repeat from poll to poll, so a label set's slice is cached by its text."""
        cache = self._slices.get((series.concept, extra_key))
        if cache is None or len(cache) >= _SLICE_CACHE_LIMIT:
            cache = self._slices[series.concept, extra_key] = {}
        slices: dict[tuple, float] = {}
        for _, label_text, value in samples:
            key = cache.get(label_text, _UNSEEN)
            if key is _UNSEEN:
                key = cache[label_text] = self._slice_of(label_text, series, extra_key)
            if key is None:
                continue
            seen = slices.get(key)
            if seen is None or value > seen or seen != seen:  # seen != seen: NaN loses to a number
                slices[key] = value
        totals: dict = {}
        for (out_key, _), value in slices.items():
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
        for (rank_name, bound), value in buckets.items():
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
                    model = sample.labels.get(self.model_label)
                    if model:
                        return model
        return ""

    def complete(self, samples: Samples, snapshot: Snapshot) -> None:
        """Hook for what a table cannot say (info-style labels and the like)."""
