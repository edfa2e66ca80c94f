"""exporter.exposition: one target's lines, read back by prometheus_client's parser."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter import exposition
from kvcache_exporter.contract import FAILURE_REASONS
from kvcache_exporter.derive import DerivedRank
from kvcache_exporter.snapshot import Histogram, RankValues
from kvcache_exporter.runtime.target import PollOutcome


def read_back(text: exposition.TargetText) -> dict[tuple, float]:
    body = b"".join(exposition.render([text], now=1000.0, staleness=60.0)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def outcome_with(histogram: Histogram, model: str = "m") -> PollOutcome:
    rank = DerivedRank({"usage_ratio": 0.5}, RankValues(histograms={"time_to_first_token_seconds": histogram}), "ok")
    return PollOutcome(True, "vllm", model, "", 0.01, 999.0, {"0": rank})


def render(outcome: PollOutcome, prefixes: exposition.Prefixes | None = None) -> exposition.TargetText:
    return exposition.render_target("t", {"pool": "a%sb"}, "http://h/metrics", outcome,
                                    dict.fromkeys(FAILURE_REASONS, 0), prefixes or exposition.Prefixes())


def bucket(samples: dict, le: str) -> float:
    return next(v for (name, labels), v in samples.items()
                if name == "kvcache_time_to_first_token_seconds_bucket" and ("le", le) in labels)


def test_histogram_lines_carry_every_value_and_percent_signs_in_labels():
    samples = read_back(render(outcome_with(Histogram([(0.1, 3.0), (1.0, 7.5e6), (math.inf, 1e21)], 12.25, 1e21),
                                            model="100%-of-%d")))
    assert bucket(samples, "0.1") == 3.0 and bucket(samples, "1.0") == 7.5e6 and bucket(samples, "+Inf") == 1e21
    labels = (("dp_rank", "0"), ("engine", "vllm"), ("model", "100%-of-%d"), ("pool", "a%sb"), ("role", "unified"), ("target", "t"))
    assert samples["kvcache_time_to_first_token_seconds_sum", labels] == 12.25
    assert samples["kvcache_time_to_first_token_seconds_count", labels] == 1e21


def test_non_finite_histogram_values_are_spelled_as_go_does():
    text = render(outcome_with(Histogram([(0.1, math.nan), (math.inf, math.inf)], -math.inf, 2.0)))
    lines = text.series["time_to_first_token_seconds"].decode()
    assert 'le="0.1"} NaN\n' in lines and 'le="+Inf"} +Inf\n' in lines and "_sum{" in lines
    assert "} -Inf\n" in lines
    samples = read_back(text)
    assert math.isnan(bucket(samples, "0.1")) and bucket(samples, "+Inf") == math.inf


def test_new_bucket_bounds_get_their_own_lines():
    prefixes = exposition.Prefixes()
    render(outcome_with(Histogram([(0.1, 1.0), (math.inf, 2.0)], 1.0, 2.0)), prefixes)
    samples = read_back(render(outcome_with(Histogram([(0.5, 4.0), (math.inf, 5.0)], 3.0, 5.0)), prefixes))
    assert bucket(samples, "0.5") == 4.0 and bucket(samples, "+Inf") == 5.0
    assert not any(("le", "0.1") in labels for _, labels in samples)


def test_workers_families_side_by_side_make_the_page_one_process_makes():
    """Two workers' shares (exposition.families), put side by side, are the page of all their targets:
    each family once, with one header, and a stale target's series left out by the worker that holds it."""
    def target(name: str, usage: float, last_success: float) -> exposition.TargetText:
        rank = DerivedRank({"usage_ratio": usage}, RankValues(), "ok")
        outcome = PollOutcome(True, "vllm", "m", "", 0.01, last_success, {"0": rank})
        return exposition.render_target(name, {}, f"http://{name}/metrics", outcome,
                                        dict.fromkeys(FAILURE_REASONS, 0), exposition.Prefixes())

    first = [target("a", 0.25, 999.0), target("b", 0.5, 900.0)]  # b's last success is 100 s old: stale at 60 s
    second = [target("c", 0.75, 999.0)]
    own = {"exporter_workers": "kvcache_exporter_workers 2.0\n"}
    shares = [exposition.TargetText(exposition.families(share, 1000.0, 60.0)) for share in (first, second)]
    sharded = b"".join(exposition.render(shares, 1000.0, 60.0, own)).decode()
    assert sharded == b"".join(exposition.render(first + second, 1000.0, 60.0, own)).decode()
    assert sharded.count("# TYPE kvcache_usage_ratio gauge\n") == 1
    usage = {s.labels["target"]: s.value for family in text_string_to_metric_families(sharded)
             for s in family.samples if s.name == "kvcache_usage_ratio"}
    assert usage == {"a": 0.25, "c": 0.75}
