"""The table machinery every adapter shares: declared series in, a normalized Snapshot out.

An adapter is mostly data: for each concept, the wire names that carry it across versions
(preferred first: the first one present on the page wins), label filters, and which labels
are breakdowns to sum. Everything else on a sample (TP/PP ranks, `pid`) is a duplicate of the
same value and is collapsed with max, never summed; a histogram is taken whole from one such copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .. import contract
from ..sources.parser import ParseError, Sample, parse_labels
from ..snapshot import Histogram, RankValues, Snapshot

Kind = Literal["gauge", "counter", "histogram"]
PREFIX_AND_TOKEN_COUNTERS = frozenset({"prefix_cache_queried_tokens_total", "prefix_cache_hit_tokens_total",
                                       "prompt_tokens_total", "generation_tokens_total"})
# Families of KV beyond the GPU pool, for engines with no offload tier or external cache series.
NO_OFFLOAD = frozenset(contract.names(group="offload")) | {"external_cache_queried_tokens_total",
                                                  "external_cache_hit_tokens_total"}
# Families most engines beyond vLLM and SGLang lack: the evictable split, the waiting reason, a preemption
# counter, and KV beyond the GPU pool.
NO_POOL_DETAIL = frozenset({"evictable_tokens", "requests_waiting_for_capacity", "preemptions_total"}) | NO_OFFLOAD
# KV transfer between disaggregated prefill and decode pools, for engines with no such series.
NO_KV_TRANSFER = frozenset(contract.names(group="transfer"))
# The running-request cap: only TensorRT-LLM's executor exports its own (vLLM's max_num_seqs and SGLang's
# max_running_requests are no series).
NO_RUNNING_CAP = frozenset({"requests_running_max"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# The bucket bounds (in the contract's unit, +Inf included) re-exported per histogram; a histogram not named keeps
# every bound, one given no bound at all is not read. A bucket left out is passed over where its label set is first
# read, so it costs a lookup a poll.
KeptBounds = Mapping[str, frozenset[float]]


def kept_bounds(bounds: Mapping[str, tuple[float, ...] | None]) -> KeptBounds:
    """Bounds by histogram (None: all of them) as the adapters take them."""
    return {name: frozenset((*chosen, math.inf)) for name, chosen in bounds.items() if chosen is not None}


DEFAULT_KEPT = kept_bounds(contract.DEFAULT_LATENCY_BUCKETS)


@dataclass(frozen=True)
class Series:
    concept: str
    names: tuple[str, ...]
    kind: Kind = "gauge"
    match: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    sum_over: tuple[str, ...] = ()
    # A family the engine creates on first use: read it as 0 while any of these names is on the page.
    zero_when_present: tuple[str, ...] = ()
    # For a family with labels of its own (the contract's offload group): its label values, in order ...
    labels: tuple[str, ...] = ()
    # ... then the last one read from a label of the engine's: (its name, engine value -> contract value).
    # Engine values not listed are "other"; those mapped to None (a total, not a breakdown) are left out.
    label_from: tuple[str, dict[str, str | None]] | None = None
    # Into the contract's base unit: values times this (a histogram's sum and bucket bounds; SGLang's ms, MiB).
    scale: float = 1.0


Samples = dict[str, list[Sample]]


def _matches(value: str, wanted: str | tuple[str, ...]) -> bool:
    """A label filter: one value, or any of several ("" where the label may be missing)."""
    return value in wanted if isinstance(wanted, tuple) else value == wanted
def _scaled(value: float, scale: float) -> float:
    """`value` in the contract's unit; a fraction divides by its inverse so that 25 ms reads 0.025, not
    0.025000000000000001."""
    return value / (1 / scale) if scale < 1 else value * scale


_UNSEEN = object()
# Distinct label sets remembered per series; a fleet serving one model shares most of them.
_SLICE_CACHE_LIMIT = 50_000


def reference_collapse(samples: list[Sample], cache: dict, slice_of, series: Series) -> dict:
    """Adapter._collapse's loop over the samples of one series: each output key's sum over its breakdown slices of
    the largest of the slice's duplicate copies. `cache` holds a label text's slice (`slice_of(label_text, series)`
    where it has none yet). `collapse` is this, or the compiled one (cfold.pyx) where it was built."""
    slices: dict[tuple, float] = {}
    for _, label_text, value in samples:
        key = cache.get(label_text, _UNSEEN)
        if key is _UNSEEN:
            key = cache[label_text] = slice_of(label_text, series)
        if key is None:
            continue
        seen = slices.get(key)
        if seen is None or value > seen or seen != seen:  # seen != seen: NaN loses to a number
            slices[key] = value
    totals: dict = {}
    for (out_key, _), value in slices.items():
        totals[out_key] = totals.get(out_key, 0.0) + value
    return totals


def reference_fold_histogram(parts: tuple, caches: tuple, copy_of, series: Series,
                             kept: frozenset[float] | None) -> dict[str, tuple]:
    """Adapter._adapt_histogram's loop over a histogram's samples (`parts`: its _bucket, _sum and _count samples):
    rank -> (buckets [(bound, cumulative)] ascending, sum, count), summed over the breakdown slices of one whole copy
    each, bounds and sum in the contract's unit. `caches` (one per part) hold a label text's (slice, copy, bound)
    (`copy_of` where they have none yet). `fold_histogram` is this, or the compiled one (cfold.pyx) where it was
    built."""
    # (rank, slice) -> copy -> [buckets {bound: cumulative}, sum, count]
    copies: dict[tuple, dict[tuple, list]] = {}
    for part, (samples, cache) in enumerate(zip(parts, caches)):
        for _, label_text, value in samples:
            key = cache.get(label_text, _UNSEEN)
            if key is _UNSEEN:
                key = cache[label_text] = copy_of(label_text, series, part == 0, kept)
            if key is None:
                continue
            slice_key, copy, bound = key
            entry = copies.setdefault(slice_key, {}).setdefault(copy, [{}, None, None])
            if part == 0:
                entry[0][bound] = value
            else:
                entry[part] = value
    totals: dict[str, list] = {}
    for (rank_name, _), by_copy in copies.items():
        whole = [entry for _, entry in sorted(by_copy.items()) if math.inf in entry[0] and entry[1] is not None]
        if not whole:
            continue  # without its +Inf bucket or its sum a histogram is incomplete
        buckets, total, count = whole[0]
        into = totals.setdefault(rank_name, [{}, 0.0, 0.0])
        for bound, cumulative in buckets.items():
            into[0][bound] = into[0].get(bound, 0.0) + cumulative
        into[1] += total
        into[2] += buckets[math.inf] if count is None else count
    return {rank_name: ([(_scaled(bound, series.scale), cumulative) for bound, cumulative in sorted(buckets.items())],
                        _scaled(total, series.scale), count) for rank_name, (buckets, total, count) in totals.items()}




class Adapter:
    engine: ClassVar[str]  # the `engine` label and the configuration's `engine:` value
    title: ClassVar[str]  # the engine's name in messages and documents
    model_label: ClassVar[str] = "model_name"  # the label that names the served model
    marker: ClassVar[str]  # a regex matching the start of this engine's sample names
    # Detected only on a page without any other engine's series: a server that re-exports engine
    # pages next to its own series (Dynamo's worker port) is read as the engine it passes through.
    detect_last: ClassVar[bool] = False
    rank_label: ClassVar[str | None]  # the label that tells data-parallel replicas apart; None: one pool
    series: ClassVar[tuple[Series, ...]]
    # Contract families the engine has no source for: absent for its targets (docs and dashboards say so).
    not_reported: ClassVar[frozenset[str]] = frozenset()
    base_match: ClassVar[dict[str, str]] = {}
    extra_names: ClassVar[tuple[str, ...]] = ()  # read by the `complete` hook
    # The label where the engine names the pool's disaggregation role, and its values -> contract.ROLES;
    # None: the page does not say (the target's `role:` does).
    role_label: ClassVar[tuple[str, dict[str, str]] | None] = None
    # How its prefill pools hold KV until the decode side has it (a key of contract.EXPORT_HOLDS); None: not known,
    # kvcache_kv_transfer_held_tokens is absent.
    export_hold: ClassVar[str | None] = None

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
        self._slices: dict[tuple, dict[str, tuple | None]] = {}  # by (series id, histogram suffix), then label text

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
        return labels.get(self.rank_label, "0") if self.rank_label else "0"

    def _slice_of(self, label_text: str, series: Series) -> tuple | None:
        """(output key, breakdown slice) of a label set, or None when the series' filters reject it. The
        output key is the rank, or (rank, label value) for a family with labels of its own."""
        labels = parse_labels(label_text) if label_text else {}
        if not all(_matches(labels.get(k, ""), v) for wanted in (self.base_match, series.match)
                   for k, v in wanted.items()):
            return None
        out_key = self.rank_of(labels)
        breakdown = ()
        if series.label_from:
            wire_label, values = series.label_from
            wire_value = labels.get(wire_label, "")
            value = values.get(wire_value, "other")
            if value is None:
                return None
            out_key, breakdown = (out_key, value), (wire_value,)
        return out_key, breakdown + tuple(labels.get(label, "") for label in series.sum_over)

    def _collapse(self, samples: list[Sample], series: Series) -> dict:
        """Per output key: max over duplicate copies of each breakdown slice, then the sum over slices.
        Label sets repeat from poll to poll, so a label set's slice is cached by its text."""
        # Keyed by the series, not its concept: several series (tiers, directions) fill one labelled family.
        cache = self._slices.get((id(series), None))
        if cache is None or len(cache) >= _SLICE_CACHE_LIMIT:
            cache = self._slices[id(series), None] = {}
        return collapse(samples, cache, self._slice_of, series)

    def adapt(self, samples: Samples, kept: KeptBounds = DEFAULT_KEPT, memo: dict | None = None) -> Snapshot:
        """The page's samples as a Snapshot. `memo`, one target's (empty at first, kept between its polls and
        replaced when `kept` changes): a histogram whose samples equal the last poll's is not read again; its
        Histogram objects are reused, and the renderer reuses their lines (exposition.Prefixes)."""
        ranks: dict[str, RankValues] = {}

        def rank(name: str) -> RankValues:
            return ranks.setdefault(name, RankValues())

        for series in self.series:
            if series.kind == "histogram":
                bounds = kept.get(series.concept)
                if bounds is None or bounds:  # no bound at all: a histogram whose group is turned off
                    self._adapt_histogram(series, samples, rank, bounds, memo)
                continue
            name = self.first_present(series.names, samples)
            if series.labels or series.label_from:
                if name is not None:
                    self._adapt_labelled(series, samples[name], rank)
                continue
            target = "counters" if series.kind == "counter" else "gauges"
            values = self._collapse(samples[name], series) if name is not None else {}
            if series.zero_when_present and self.first_present(series.zero_when_present, samples):
                # Created at its first increment, rank by rank: a rank on the page without it has counted none
                # yet, also while another rank's is there (SGLang's DP ranks retract one by one).
                for rank_name in self._ranks_on_page(samples, series.zero_when_present):
                    values.setdefault(rank_name, 0.0)
            for rank_name, value in values.items():
                if math.isfinite(value):  # NaN and Inf are "no reading" (sentinels, unset timers), never a value
                    getattr(rank(rank_name), target)[series.concept] = _scaled(value, series.scale)
        snapshot = Snapshot(engine=self.engine, model=self.model_of(samples), version="", ranks=ranks,
                            role=self.role_of(samples), export_hold=self.export_hold)
        self.complete(samples, snapshot)
        return snapshot

    def role_of(self, samples: Samples) -> str | None:
        """The role the first of the adapter's samples that carries the role label names, if one does."""
        if self.role_label is None:
            return None
        label, roles = self.role_label
        for name in sorted(self.wanted):
            for sample in samples.get(name, ()):
                if label in sample.labels:
                    return roles.get(sample.labels[label])
        return None

    def _adapt_labelled(self, series: Series, samples: list[Sample], rank) -> None:
        """A labelled family's values; where two series fill the same label values, the first one wins
        (a newer name before an older one, as within a series' names)."""
        for out_key, value in self._collapse(samples, series).items():
            rank_name, tail = (out_key[0], (out_key[1],)) if series.label_from else (out_key, ())
            if math.isfinite(value):
                rank(rank_name).labelled.setdefault(series.concept, {}).setdefault(series.labels + tail,
                                                                                  _scaled(value, series.scale))

    def _ranks_on_page(self, samples: Samples, names: tuple[str, ...]) -> set[str]:
        found = set()
        for name in self.variants_of(names):
            found.update(self.rank_of(s.labels) for s in samples.get(name, ()))
        return found

    def _adapt_histogram(self, series: Series, samples: Samples, rank, kept: frozenset[float] | None,
                         memo: dict | None) -> None:
        """Each rank's histogram: per breakdown slice one copy whole (buckets, sum and count of the same TP or PP
        rank's series, the first by its labels: tp_rank 0, SGLang's stats rank, where it is there), then the sum
        over the slices. Never a bucket from one copy and the sum from another: the result would be no copy's
        histogram, its buckets possibly at odds with its count. Only the buckets at `kept` bounds (None: all)."""
        name = self.first_present(series.names, samples, suffix="_bucket")
        if name is None:
            return
        if memo is not None:
            # An engine's histogram changes only when requests finish: compared as parsed, name, labels and values.
            read = tuple(samples.get(name + suffix) for suffix in HISTOGRAM_SUFFIXES)
            last = memo.get(id(series))
            if last is not None and last[0] == read:
                for rank_name, histogram in last[1].items():
                    rank(rank_name).histograms[series.concept] = histogram
                return
        caches = []
        for suffix in HISTOGRAM_SUFFIXES:
            cache_key = (id(series), suffix, kept if suffix == "_bucket" else None)
            cache = self._slices.get(cache_key)
            if cache is None or len(cache) >= _SLICE_CACHE_LIMIT:
                cache = self._slices[cache_key] = {}
            caches.append(cache)
        parts = tuple(samples.get(name + suffix, ()) for suffix in HISTOGRAM_SUFFIXES)
        made = {}
        for rank_name, (buckets, total, count) in fold_histogram(parts, tuple(caches), self._copy_of, series,
                                                                 kept).items():
            made[rank_name] = rank(rank_name).histograms[series.concept] = Histogram(buckets, total, count)
        if memo is not None:
            memo[id(series)] = read, made

    def _copy_of(self, label_text: str, series: Series, bucket: bool, kept: frozenset[float] | None) -> tuple | None:
        """((rank, breakdown slice), copy, bucket bound) of a histogram sample, or None when the series' filters
        reject it or it is a bucket whose bound is not `kept`. The copy is every other label (TP and PP ranks, pid),
        ordered so that rank 0 sorts first."""
        labels = parse_labels(label_text) if label_text else {}
        if not all(_matches(labels.get(k, ""), v) for wanted in (self.base_match, series.match)
                   for k, v in wanted.items()):
            return None
        bound = None
        if bucket:
            text = labels.get("le", "")
            try:
                bound = float(text)
            except ValueError:
                raise ParseError(f"{series.concept}: bucket bound le={text!r} is not a number") from None
            if kept is not None and _scaled(bound, series.scale) not in kept:
                return None
        own = {self.rank_label, "le", *series.sum_over}
        copy = tuple(sorted((k, (0, int(v), "") if v.isdigit() else (1, 0, v)) for k, v in labels.items()
                            if k not in own))
        return (self.rank_of(labels), tuple(labels.get(label, "") for label in series.sum_over)), copy, bound

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


# The compiled loops (cfold.pyx, issue #48) where the install could build them; ADAPTER says which run
# (kvcache_exporter_build_info).
try:
    from .cfold import collapse, fold_histogram
except ImportError:  # no C compiler at install
    ADAPTER = "python"
    collapse, fold_histogram = reference_collapse, reference_fold_histogram
else:
    ADAPTER = "cython"
