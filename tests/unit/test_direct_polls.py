"""Targets polled when asked (runtime/direct.py), as `top --target` and `kv-math --target` poll them:
the exporter's own pipeline, each target keeping its state from one poll to the next."""

from __future__ import annotations

from devtools import harness
from devtools.harness import PageServer, page
from kvcache_exporter import config as cfg
from kvcache_exporter.runtime.direct import DirectPolls


def test_each_target_keeps_its_state_between_polls_and_a_failure_is_counted_not_raised():
    fixture = (harness.FIXTURES / "vllm-v1.txt").read_text()
    with PageServer({"/metrics": page(fixture)}) as server:
        config = cfg.resolve({"target": [server.url("/metrics"), server.url("/missing")]}, {})
        with DirectPolls(config) as polls:
            first = polls.poll_once()
            second = polls.poll_once()
            engine, missing = polls.targets
    assert [outcome.up for outcome in first + second] == [True, False, True, False]
    # vllm-v1 fixture: 29126 blocks of 16 tokens, on one data-parallel rank
    assert [rank.gauges["capacity_tokens"] for rank in second[0].ranks.values()] == [466016]
    assert (engine.failures["http_status"], missing.failures["http_status"]) == (0, 2)  # one Target each, kept
