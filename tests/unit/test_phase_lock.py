"""exporter.runtime.phase: the scrape lattice learnt from arrival times, and each target's poll timed for it."""

from __future__ import annotations

import random

import pytest

from kvcache_exporter.runtime import phase
from kvcache_exporter.runtime.phase import Lattice, ScrapeClock, fit, next_start

PROMETHEUS = "10.0.0.5 Prometheus/2.53.0"
POLL = 5.0


def regular(start: float, interval: float, count: int, rng: random.Random | None = None,
            late: float = 0.02) -> list[float]:
    """Arrivals of a scraper every `interval` from `start`, each up to `late` seconds late (a busy loop)."""
    rng = rng or random.Random(0)
    return [start + i * interval + rng.uniform(0.0, late) for i in range(count)]


def clock_with(arrivals: list[float], scraper: str = PROMETHEUS, prometheus: bool = True) -> ScrapeClock:
    clock = ScrapeClock()
    for at in arrivals:
        clock.observe(scraper, at, prometheus)
    return clock


def test_a_regular_scraper_gives_its_interval_and_phase():
    arrivals = regular(1000.3, 5.0, 8)
    lattice = fit(arrivals)
    assert lattice is not None
    assert lattice.interval == pytest.approx(5.0, abs=0.03)
    # A lattice point at most the jitter before an arrival: the phase within the interval is 0.3 s.
    assert (lattice.anchor - 1000.3) % 5.0 == pytest.approx(0.0, abs=0.03) or \
        (lattice.anchor - 1000.3) % 5.0 == pytest.approx(5.0, abs=0.03)
    assert lattice.multiple_of(5.0) == 1 and lattice.multiple_of(2.5) == 2 and lattice.multiple_of(1.0) == 5


def test_fewer_than_a_full_history_is_no_lattice_yet():
    assert fit(regular(0.0, 5.0, phase.HISTORY - 1)) is None


def test_the_least_delayed_arrival_sets_the_phase():
    """The loop may notice a scrape late, never early: the lattice sits at the earliest arrivals."""
    on_time = [100.0 + 5.0 * i for i in range(8)]
    delayed = [t + (0.3 if i in (2, 5) else 0.0) for i, t in enumerate(on_time)]
    lattice = fit(delayed)
    assert lattice is not None
    assert min(abs((lattice.anchor - t) % 5.0) for t in on_time) < 1e-9


def test_a_skipped_scrape_and_one_late_arrival_keep_the_lock():
    arrivals = [100.0 + 5.0 * i for i in range(10) if i != 4]  # the 5th scrape never came
    arrivals[6] += 1.4  # one arrival far off the lattice
    lattice = fit(arrivals[-8:])
    assert lattice is not None and lattice.interval == pytest.approx(5.0)


@pytest.mark.parametrize("spread", [1.5, 2.5])
def test_gaps_that_wander_give_no_lattice(spread):
    """Each gap 5 s give or take `spread`: the arrivals wander off any lattice."""
    rng = random.Random(7)
    arrivals, at = [], 0.0
    for _ in range(8):
        at += 5.0 + rng.uniform(-spread, spread)
        arrivals.append(at)
    assert fit(arrivals) is None


@pytest.mark.parametrize("seed", range(5))
def test_arrivals_scattered_beyond_the_jitter_give_no_lattice(seed):
    """Each arrival up to 40 % of the interval off its lattice point (four times JITTER): no lock."""
    rng = random.Random(seed)
    assert fit([5.0 * i + rng.uniform(0.0, 0.4 * 5.0) for i in range(8)]) is None


def test_a_multiple_of_the_poll_interval_locks_and_other_intervals_do_not():
    assert Lattice(15.0, 0.0, 0.0).multiple_of(5.0) == 3
    assert Lattice(5.04, 0.0, 0.0).multiple_of(5.0) == 1  # within 1 %
    assert Lattice(7.0, 0.0, 0.0).multiple_of(5.0) is None
    assert Lattice(2.5, 0.0, 0.0).multiple_of(5.0) is None  # scrapes more often than polls: no single phase


def test_the_clock_locks_onto_a_regular_scraper():
    arrivals = regular(1000.3, 5.0, 8)
    clock = clock_with(arrivals)
    lock = clock.update(POLL, now=arrivals[-1] + 1.0)
    assert lock is not None and lock.scraper == PROMETHEUS
    assert clock.seen_interval == pytest.approx(5.0, abs=0.03)


def test_no_scraper_or_a_silent_one_is_the_own_cadence():
    clock = ScrapeClock()
    assert clock.update(POLL, now=50.0) is None and clock.seen_interval == 0.0
    arrivals = regular(1000.0, 5.0, 8)
    clock = clock_with(arrivals)
    assert clock.update(POLL, now=arrivals[-1] + 4.0) is not None
    assert clock.update(POLL, now=arrivals[-1] + phase.SILENT * 5.0 + 0.1) is None  # gone: two scrapes missed
    assert clock.seen_interval == 0.0


def test_a_scraper_that_turns_irregular_drops_the_lock():
    arrivals = regular(0.0, 5.0, 8)
    clock = clock_with(arrivals)
    assert clock.update(POLL, arrivals[-1]) is not None
    for at in (40.0 + 1.2, 45.0 + 2.9, 50.0 + 1.9):  # three arrivals off the lattice: 5 of the last 8 fit
        clock.observe(PROMETHEUS, at, True)
    assert clock.update(POLL, 52.0) is None
    assert clock.seen_interval == 0.0


def test_the_lock_follows_a_scraper_whose_phase_moved():
    """A Prometheus restarted at another offset: the lock drops, then re-forms at the new phase."""
    old = regular(0.0, 5.0, 8)
    clock = clock_with(old)
    first = clock.update(POLL, old[-1])
    assert first is not None
    new = regular(old[-1] + 5.0 + 2.2, 5.0, 8)  # 2.2 s later in the interval than before
    states = []
    for at in new:
        clock.observe(PROMETHEUS, at, True)
        states.append(clock.update(POLL, at))
    assert states[2] is None  # three arrivals off the old lattice: unlocked
    assert states[-1] is not None
    moved = (states[-1].lattice.anchor - first.lattice.anchor) % 5.0
    assert moved == pytest.approx(2.2, abs=0.05)


def test_a_client_hammering_metrics_does_not_lock_or_move_the_lock():
    rng = random.Random(5)
    arrivals = regular(1000.3, 5.0, 8)
    clock = clock_with(arrivals)
    locked = clock.update(POLL, arrivals[-1])
    # Another client requests /metrics every 1 to 20 ms, faking Prometheus' header, for 20 s.
    at = arrivals[-1]
    while at < arrivals[-1] + 20.0:
        at += rng.uniform(0.001, 0.02)
        clock.observe("10.0.0.66 Prometheus/2.53.0", at, True)
    for extra in regular(arrivals[-1] + 5.0, 5.0, 4):
        clock.observe(PROMETHEUS, extra, True)
    lock = clock.update(POLL, at)
    assert lock is not None and lock.scraper == PROMETHEUS
    assert (lock.lattice.anchor - locked.lattice.anchor) % 5.0 == pytest.approx(0.0, abs=0.05) or \
        (lock.lattice.anchor - locked.lattice.anchor) % 5.0 == pytest.approx(5.0, abs=0.05)


def test_a_flood_of_clients_never_evicts_the_locked_scraper():
    arrivals = regular(0.0, 5.0, 8)
    clock = clock_with(arrivals)
    clock.update(POLL, arrivals[-1])
    for i in range(10 * phase.MAX_SCRAPERS):
        clock.observe(f"10.1.{i // 256}.{i % 256} curl/8", arrivals[-1] + 0.001 * i)
    clock.observe(PROMETHEUS, arrivals[-1] + 5.0, True)
    assert clock.update(POLL, arrivals[-1] + 5.0).scraper == PROMETHEUS
    assert len(clock._scrapers) <= phase.MAX_SCRAPERS


def test_of_an_ha_pair_the_lock_stays_with_the_scraper_it_has():
    a, b = "10.0.0.5 Prometheus/2.53.0", "10.0.0.6 Prometheus/2.53.0"
    clock = ScrapeClock()
    for at in regular(0.0, 5.0, 8):
        clock.observe(b, at, True)
    assert clock.update(POLL, 36.0).scraper == b  # only b so far
    for at in regular(1.7, 5.0, 12):
        clock.observe(a, at, True)
    for at in regular(40.0, 5.0, 4):
        clock.observe(b, at, True)
    assert clock.update(POLL, 57.0).scraper == b  # a would rank first (lower key), but b holds the lock
    fresh = ScrapeClock()
    for at in sorted(regular(0.0, 5.0, 8) + regular(1.7, 5.0, 8)):
        fresh.observe(b if at % 5.0 < 1.0 else a, at, True)
    assert fresh.update(POLL, 40.0).scraper == a  # both at once: the lowest key, so every exporter agrees


def test_prometheus_is_preferred_over_a_regular_client_without_its_header():
    clock = ScrapeClock()
    for at in regular(0.0, 5.0, 8):
        clock.observe("10.0.0.1 kvcache-top", at, False)
        clock.observe("10.0.0.9 Prometheus/2.53.0", at + 2.0, True)
    assert clock.update(POLL, 40.0).scraper == "10.0.0.9 Prometheus/2.53.0"


@pytest.mark.parametrize("offset", [0.0, 1.3, 4.99])
def test_a_next_start_is_on_the_lattice_and_never_sooner_than_min_gap(offset):
    rng = random.Random(3)
    previous = 1000.0
    for _ in range(200):
        following = next_start(previous, POLL, offset)
        assert (following - offset) % POLL == pytest.approx(0.0, abs=1e-6) or \
            (following - offset) % POLL == pytest.approx(POLL, abs=1e-6)
        assert phase.MIN_GAP * POLL - 1e-9 <= following - previous < (1 + phase.MIN_GAP) * POLL
        previous = following + rng.uniform(-0.25, 0.0)  # started up to a tick early


def test_polls_per_target_stay_at_one_per_interval_however_the_lock_moves():
    """A hostile client that becomes the lock and moves its phase as often as the lock lets it:
    the polls of a target stay at most one per interval, plus one per re-lock."""
    rng = random.Random(9)
    clock, now, polls, relocks, locked_phase = ScrapeClock(), 0.0, [], 0, None
    next_poll = 0.0
    scrape = 0.0
    while now < 3600.0:
        scrape += 5.0 + (rng.uniform(1.0, 2.4) if rng.random() < 0.1 else 0.0)  # now and then a jump in phase
        clock.observe("10.0.0.66 evil/1", scrape, True)
        while next_poll <= scrape:
            lock = clock.update(POLL, next_poll)
            phase_now = None if lock is None else round(lock.lattice.anchor % POLL, 2)
            if phase_now != locked_phase:
                relocks += 1
                locked_phase = phase_now
            polls.append(next_poll)
            offset = 0.37 * POLL if lock is None else lock.offset(phase.lead(0.05, 0.37, 0.1, POLL))
            next_poll = next_start(next_poll, POLL, offset)
        now = scrape
    assert min(b - a for a, b in zip(polls, polls[1:])) >= phase.MIN_GAP * POLL - 1e-9
    assert len(polls) <= now / POLL + relocks + 1
    assert relocks >= 10  # the lock did move


def test_a_locked_poll_is_due_its_lead_before_the_scrape():
    """A target's poll starts its longest recent poll before the scrape (the tail makes its scrape), plus its place
    in the spread window and the margin."""
    arrivals = regular(1000.3, 5.0, 8, late=0.0)
    clock = clock_with(arrivals)
    assert clock.update(POLL, arrivals[-1]) is not None
    timetable = phase.Timetable(clock)
    timetable.spread = 0.4

    class Named:
        name = "a"

    for duration in [0.02] * 4 + [0.3] + [0.02] * 5:  # the longest, neither the last nor the 90th percentile
        timetable.finished(Named.name, duration)
    timetable.due([Named()], arrivals[-1], arrivals[-1], POLL)  # polled now; its next start is set
    lead = 0.3 + phase.phase_of(Named.name) * 0.4 + phase.margin(POLL)
    scrape = arrivals[-1] + 5.0
    assert scrape - timetable.earliest() == pytest.approx(lead)


def test_the_largest_lead_is_the_longest_expected_poll_the_spread_and_the_margin():
    """kvcache_exporter_poll_lead_ratio's numerator: the target whose longest recent poll is longest, at the far
    end of the spread window; a poll older than the last DURATIONS and a removed target no longer count."""
    timetable = phase.Timetable(ScrapeClock())
    assert timetable.largest_lead(POLL) == 0.0  # nothing polled yet
    timetable.spread = 0.6
    for duration in [3.0] + [0.02] * phase.DURATIONS:
        timetable.finished("a", duration)  # the 3 s poll is no longer among the last 10
    assert timetable.largest_lead(POLL) == pytest.approx(0.02 + 0.6 + phase.margin(POLL))
    timetable.finished("a", 0.25)
    for duration in (0.1, 0.3, 0.2):
        timetable.finished("b", duration)
    assert timetable.largest_lead(POLL) == pytest.approx(0.3 + 0.6 + phase.margin(POLL))

    class Named:
        name = "a"

    timetable.due([Named()], 0.0, 0.0, POLL)  # "b" is no longer a target
    assert timetable.largest_lead(POLL) == pytest.approx(0.25 + 0.6 + phase.margin(POLL))


def test_the_spread_follows_the_loops_cpu_and_is_capped():
    assert phase.spread_window(0.4, POLL) == pytest.approx(0.5)
    assert phase.spread_window(4.0, POLL) == pytest.approx(phase.MAX_SPREAD * POLL)
