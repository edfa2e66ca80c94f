"""When each target is polled: on its own phase of the poll interval, or phase-locked to the scraper
of /metrics, so that its poll completes just before that scraper's next scrape.

Prometheus scrapes on a lattice (its interval, at an offset of its own) and the exporter polls on
one; on independent clocks the data a scrape reads is half a poll interval old on average and up to
a whole one (docs/performance.md). Locked, it is as old as the poll's lead: the target's expected
poll duration, its place in the fleet's spread and a margin.

Pure: arrival times in, times out (seconds of time.monotonic), so tests drive it with synthetic
arrivals. The cadence never changes, only the phase: a target's next poll is always on its lattice
of one poll interval, at least MIN_GAP of an interval after its last one, so no client of /metrics,
however it times its requests, can make the exporter poll a target more often or starve it.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar

# A scraper is judged on its last HISTORY requests: regular when at least ON_LATTICE of them arrived
# within JITTER of its interval after a point of one lattice (arrivals are only ever late: the event
# loop may be busy when one comes, never early). Two outliers pass (a skipped scrape, a slow
# connection); a third, or a phase that moved, drops the lock until ON_LATTICE requests fit again.
HISTORY = 8
ON_LATTICE = 6
JITTER = 0.1
# The scrape interval must be a whole multiple (1, 2, ...) of the poll interval within this fraction:
# then one poll of every multiple lands just before each scrape. Shorter or in between: own cadence.
MULTIPLE_TOLERANCE = 0.01
SILENT = 2.5  # a scraper not seen for this many of its intervals has gone
MAX_SCRAPERS = 16  # distinct clients remembered; the least recently seen one (never the locked one) goes
# A poll never starts sooner than this fraction of an interval after the target's previous one.
MIN_GAP = 0.75
# Locked, a poll is timed to complete this long before the scrape: a floor for the clock's and the
# loop's jitter, and a share of the interval.
MARGIN_S = 0.1
MARGIN_FRACTION = 0.02
# Recent poll durations of a target; the longest is its expected duration. Not their p90: with four replicas,
# Prometheus and its rules on two cores, a poll beyond the p90 of its last 10 missed its scrape (a target's
# data an interval old at a scrape, in each of two runs at 2,000 SGLang TP=2 engines), where the longest kept
# every scrape's data within 1.06 s (docs/performance.md). One slow poll moves only its own target's lead, for
# 10 polls.
DURATIONS = 10
# The polls of a locked fleet are spread over SPREAD times the poll loop's CPU per interval before the
# margin (at most MAX_SPREAD of the interval): their pages are read as they arrive, instead of queueing
# behind each other in one burst whose tail would miss the scrape.
SPREAD = 1.25
MAX_SPREAD = 0.5
T = TypeVar("T")


def phase_of(name: str) -> float:
    """Where in the interval a target is polled on its own cadence, as a fraction of it: stable across
    restarts and reloads, and spread over the interval across a fleet, as Prometheus spreads its scrapes."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def next_start(previous: float, interval: float, offset: float) -> float:
    """The first time at `offset` modulo `interval` that is at least MIN_GAP intervals after `previous`."""
    earliest = previous + MIN_GAP * interval
    return earliest + (offset - earliest) % interval


def margin(interval: float) -> float:
    return MARGIN_S + MARGIN_FRACTION * interval


@dataclass(frozen=True)
class Lattice:
    """A scraper's regular requests: every `interval` seconds, one of them at `anchor`."""

    interval: float
    anchor: float  # monotonic time of a lattice point (the least delayed of the latest requests)
    last: float  # the latest request

    def multiple_of(self, poll_interval: float) -> int | None:
        """k if the scrape interval is k poll intervals (k >= 1, within MULTIPLE_TOLERANCE), else None."""
        k = round(self.interval / poll_interval)
        if k >= 1 and abs(self.interval - k * poll_interval) <= MULTIPLE_TOLERANCE * k * poll_interval:
            return k
        return None


def fit(arrivals: Iterable[float]) -> Lattice | None:
    """The lattice of a scraper's last HISTORY arrival times, oldest first, if they are regular."""
    times = list(arrivals)[-HISTORY:]
    if len(times) < HISTORY:
        return None
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    interval = gaps[len(gaps) // 2]
    if interval <= 0:
        return None
    window = JITTER * interval
    last = times[-1]
    # Each arrival's lead over the latest one's lattice, in [-interval/2, interval/2); a lattice point
    # is tried at each of them, the one with the most arrivals within the window after it wins, the
    # earliest among equals (the least delayed).
    deviations = sorted((t - last + interval / 2) % interval - interval / 2 for t in times)
    best, best_count = deviations[0], 0
    for start in deviations:
        count = sum(1 for d in deviations if start <= d <= start + window)
        if count > best_count:
            best, best_count = start, count
    if best_count < ON_LATTICE:
        return None
    return Lattice(interval, last + best, last)


@dataclass(frozen=True)
class Lock:
    """The scraper the polls are timed for."""

    scraper: str
    lattice: Lattice
    poll_interval: float

    def offset(self, lead: float) -> float:
        """Where a poll that takes `lead` seconds to be ready starts, modulo the poll interval."""
        return (self.lattice.anchor - min(lead, self.poll_interval)) % self.poll_interval


class _Scraper:
    __slots__ = ("arrivals", "prometheus", "lattice", "fitted")

    def __init__(self) -> None:
        self.arrivals: deque[float] = deque(maxlen=HISTORY)
        self.prometheus = False
        self.lattice: Lattice | None = None  # of `arrivals` once fitted; None: irregular
        self.fitted = False  # since the latest arrival


class ScrapeClock:
    """The clients of /metrics, keyed by address and User-Agent (two Prometheus replicas are two
    scrapers; two jobs of one Prometheus on one address are one, and irregular), and the one the
    polls lock onto. `observe` runs for every scrape: a dictionary lookup and an append."""

    def __init__(self) -> None:
        self._scrapers: dict[str, _Scraper] = {}
        self.locked: Lock | None = None
        self.seen_interval = 0.0  # the interval of the scraper locked to, or of the one it would be; 0: none

    def observe(self, scraper: str, at: float, prometheus: bool = False) -> None:
        """A request for /metrics from `scraper` at monotonic time `at`; `prometheus`: it carried
        Prometheus' scrape timeout header."""
        known = self._scrapers.get(scraper)
        if known is None:
            if len(self._scrapers) >= MAX_SCRAPERS:
                self._forget_one()
            known = self._scrapers[scraper] = _Scraper()
        known.arrivals.append(at)
        known.prometheus = prometheus
        known.fitted = False

    def _forget_one(self) -> None:
        locked = self.locked.scraper if self.locked else None
        others = [(s.arrivals[-1], key) for key, s in self._scrapers.items() if key != locked]
        if others:
            del self._scrapers[min(others)[1]]

    def update(self, poll_interval: float, now: float) -> Lock | None:
        """Decide the lock for now: the scraper locked to while it stays regular, on a whole multiple of
        the poll interval, and not silent; else the best such scraper (Prometheus first, then the
        shortest multiple, then the lowest key: deterministic); else None (own cadence)."""
        candidates = []
        best_seen: tuple | None = None
        for key, scraper in list(self._scrapers.items()):
            if not scraper.fitted:
                scraper.lattice, scraper.fitted = fit(scraper.arrivals), True
            lattice = scraper.lattice
            if lattice is None:
                continue
            if now - lattice.last > SILENT * lattice.interval:
                del self._scrapers[key]
                continue
            k = lattice.multiple_of(poll_interval)
            rank = (not scraper.prometheus, k or math.inf, key)
            if best_seen is None or rank < best_seen[0]:
                best_seen = (rank, lattice.interval)
            if k is not None:
                candidates.append((rank, key, lattice))
        current = self.locked.scraper if self.locked else None
        chosen = next((c for c in candidates if c[1] == current), min(candidates, default=None))
        self.locked = Lock(chosen[1], chosen[2], poll_interval) if chosen else None
        self.seen_interval = self.locked.lattice.interval if self.locked else (best_seen[1] if best_seen else 0.0)
        return self.locked


def lead(expected: float, place: float, spread: float, poll_interval: float) -> float:
    """How long before the scrape a target's poll starts: its expected duration (the longest of its recent
    ones), its `place` (0 to 1) in the fleet's `spread` window, and the margin."""
    return expected + place * spread + margin(poll_interval)


def spread_window(loop_cpu_per_interval: float, poll_interval: float) -> float:
    return min(SPREAD * loop_cpu_per_interval, MAX_SPREAD * poll_interval)


class Timetable:
    """When each target's next poll starts, on its own phase or locked to `scrapes.locked`; what the
    poll loop asks at every wake. Every method runs in the loop's thread. The starts are kept in a heap:
    locked, the loop wakes up to 1/LOCKED_BATCH times a second, and a scan of every target at each wake
    was 6 % of the exporter's CPU at 2,000 targets (docs/performance.md)."""

    def __init__(self, scrapes: ScrapeClock):
        self.scrapes = scrapes
        self.spread = 0.0  # seconds over which a locked fleet's polls are spread (spread_window)
        self._next: dict[str, float] = {}  # target name -> monotonic time its next poll starts
        self._heap: list[tuple[float, str]] = []  # (start, name); an entry whose start is not _next's is stale
        self._listed: Sequence | None = None  # the target list the tables hold
        self._by_name: dict[str, object] = {}
        self._durations: dict[str, deque[float]] = {}  # target name -> its recent poll durations
        self._expected: dict[str, float] = {}  # target name -> the longest of its recent poll durations
        self._places: dict[str, float] = {}  # target name -> phase_of(name)

    def due(self, targets: Sequence[T], now: float, horizon: float, interval: float) -> list[T]:
        """The targets (anything with a `name`) whose poll starts before `horizon`, earliest first, a new
        one at once; each is given its next start, counted from `now` (a process that was suspended
        resumes with one poll each, not a catch-up). Another list than the last one (a reload) replaces
        the targets: a kept name keeps its timing, a removed one is forgotten."""
        if targets is not self._listed:
            self._replace(targets, now)
        due = []
        while self._heap and self._heap[0][0] <= horizon:
            start, name = heapq.heappop(self._heap)
            if self._next.get(name) != start:
                continue
            following = self._next[name] = self._following(name, now, interval)
            heapq.heappush(self._heap, (following, name))
            due.append(self._by_name[name])
        return due

    def earliest(self) -> float:
        """When the next poll of any target starts (monotonic; infinity with no target)."""
        while self._heap and self._next.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else math.inf

    def finished(self, name: str, duration: float) -> None:
        durations = self._durations.get(name)
        if durations is None:
            durations = self._durations[name] = deque(maxlen=DURATIONS)
        durations.append(duration)
        self._expected[name] = max(durations)

    def largest_lead(self, interval: float) -> float:
        """How long before a scrape the fleet's earliest poll starts, locked: the longest expected poll (kept per
        target as its polls end, so that a scrape reads a maximum, not every target's durations), the whole spread
        window and the margin; 0 with no target polled yet."""
        if not self._expected:
            return 0.0
        return lead(max(self._expected.values()), 1.0, self.spread, interval)

    def _replace(self, targets: Sequence[T], now: float) -> None:
        self._listed = targets
        self._by_name = {target.name: target for target in targets}
        for table in (self._next, self._durations, self._expected, self._places):
            for name in [name for name in table if name not in self._by_name]:
                del table[name]
        for name in self._by_name:
            if name not in self._next:
                self._next[name] = now
                heapq.heappush(self._heap, (now, name))

    def _following(self, name: str, previous: float, interval: float) -> float:
        place = self._places.get(name)
        if place is None:
            place = self._places[name] = phase_of(name)
        lock = self.scrapes.locked
        if lock is None:
            offset = place * interval
        else:
            offset = lock.offset(lead(self._expected.get(name, 0.0), place, self.spread, interval))
        return next_start(previous, interval, offset)
