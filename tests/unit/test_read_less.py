"""Reading less (issue #33, lever 2): a target asks for its adapter's series only (`?name[]=`) once it has
read a whole page, and judges the answer, over real HTTP: the simulator answering as prometheus_client
does (honoured, or a multiprocess registry's empty answer) and page servers that ignore the filter,
refuse it, or honour part of it."""

from __future__ import annotations

import asyncio
import logging
import threading
from urllib.parse import parse_qs, urlsplit

import pytest

from devtools import harness, name_filter
from kvcache_exporter import adapters
from kvcache_exporter.config import Config, TargetConfig
from kvcache_exporter.runtime.target import HONOURED, IGNORED, UNTRIED, new_target
from kvcache_exporter.simulator.server import start_engine
from kvcache_exporter.sources import parser

VLLM_PAGE = (harness.FIXTURES / "vllm-v1.txt").read_text()
SLOW = 1e-6  # simulated seconds per second: the state does not move between two reads


def poll(target, times: int) -> list:
    """`times` polls of the target in one event loop; the outcome of each and the filter state after it."""
    async def run():
        seen = []
        for _ in range(times):
            outcome = await target.poll()
            seen.append((outcome, target.name_filter))
        target.close()
        return seen

    return asyncio.run(run())


def target_for(url: str, engine: str = "auto"):
    return new_target(TargetConfig(name="t", url=url, engine=engine), Config(targets=(), timeout=2.0))


class Recorder:
    """A page server route that notes each request's query, then answers as `answer(names asked)` says."""

    def __init__(self, answer):
        self.queries: list[list[str] | None] = []
        self._answer = answer
        self._lock = threading.Lock()

    def __call__(self, handler) -> None:
        names = parse_qs(urlsplit(handler.path).query).get("name[]")
        with self._lock:
            self.queries.append(names)
        self._answer(names)(handler)


@pytest.mark.parametrize("flavor", ["sglang", "vllm-v1", "trtllm"])
def test_an_engine_that_honours_the_filter_is_read_from_its_filtered_answers(flavor):
    with start_engine(flavor, speed=SLOW, name_filter="restrict") as honouring, \
            start_engine(flavor, speed=SLOW, name_filter="ignore") as whole:
        filtered_target, whole_target = target_for(honouring.url), target_for(whole.url)
        seen = poll(filtered_target, 3)
        assert [state for _, state in seen] == [UNTRIED, HONOURED, HONOURED]
        assert all(outcome.up for outcome, _ in seen)
        poll(whole_target, 3)
        assert whole_target.name_filter == IGNORED
    # The same pools and values as from whole pages.
    assert filtered_target.outcome.ranks.keys() == whole_target.outcome.ranks.keys()
    for rank, derived in filtered_target.outcome.ranks.items():
        assert derived.gauges == whole_target.outcome.ranks[rank].gauges
        assert derived.values.counters == whole_target.outcome.ranks[rank].values.counters


def test_the_simulators_filtered_answer_holds_the_names_asked_for_and_nothing_else():
    with start_engine("sglang", speed=SLOW, name_filter="restrict") as engine:
        whole = harness.http_get(engine.url)[1]
        adapter = adapters.detect(whole)
        asked = sorted(adapter.wanted)[:40]
        query = "&".join(f"name[]={name}" for name in asked)
        answer = harness.http_get(f"{engine.url}?{query}")[1]
    on_page = parser.parse(whole, frozenset(asked))
    answered = parser.parse(answer, frozenset(asked))
    assert on_page and answered.keys() == on_page.keys()
    assert parser.unread_lines(answer, answered) == 0
    assert parser.unread_lines(whole, on_page) > 0
    assert answer == name_filter.answer(whole, set(asked))  # the tests' page servers answer as prometheus_client
    assert len(answer) < len(whole)


def test_an_engine_that_ignores_the_filter_costs_no_extra_request():
    """vLLM's /metrics answers a filtered request with the whole page: read as such, then whole pages asked."""
    recorder = Recorder(lambda names: harness.page(VLLM_PAGE))
    with harness.PageServer({"/metrics": recorder}) as server:
        target = target_for(server.url("/metrics"))
        seen = poll(target, 4)
    assert [state for _, state in seen] == [UNTRIED, IGNORED, IGNORED, IGNORED]
    assert all(outcome.up for outcome, _ in seen)
    assert [names is not None for names in recorder.queries] == [False, True, False, False]
    assert set(recorder.queries[1]) == adapters.ADAPTERS["vllm"].wanted


def test_an_empty_answer_to_the_filter_is_refused_and_the_whole_page_read_at_once(caplog):
    """SGLang and trtllm-serve today: a multiprocess registry answers a filtered request with no series. That
    is expected of them, so it is said at debug, not at info on every start."""
    caplog.set_level(logging.DEBUG, logger="kvcache_exporter")
    with start_engine("sglang", speed=SLOW) as engine:
        target = target_for(engine.url)
        seen = poll(target, 3)
    assert [state for _, state in seen] == [UNTRIED, IGNORED, IGNORED]
    assert all(outcome.up and outcome.ranks for outcome, _ in seen)
    said = [(record.levelno, record.getMessage()) for record in caplog.records if "?name[]=" in record.getMessage()]
    assert len(said) == 1 and said[0][0] == logging.DEBUG and "as expected" in said[0][1]


def test_a_filter_honoured_in_part_is_refused():
    """An answer that lacks a series the whole page held (a registry with some collectors unnamed)."""
    adapter = adapters.ADAPTERS["vllm"]
    held = sorted(set(parser.parse(VLLM_PAGE, adapter.wanted)))
    recorder = Recorder(lambda names: harness.page(
        VLLM_PAGE if names is None else name_filter.answer(VLLM_PAGE, set(held[1:]))))
    with harness.PageServer({"/metrics": recorder}) as server:
        seen = poll(target_for(server.url("/metrics")), 3)
    assert [state for _, state in seen] == [UNTRIED, IGNORED, IGNORED]
    assert [names is not None for names in recorder.queries] == [False, True, False, False]
    assert all(outcome.up for outcome, _ in seen)


def test_a_server_honouring_the_whole_filter_is_read_from_the_part_it_sends():
    adapter = adapters.ADAPTERS["vllm"]
    recorder = Recorder(lambda names: harness.page(
        VLLM_PAGE if names is None else name_filter.answer(VLLM_PAGE, set(names))))
    with harness.PageServer({"/metrics": recorder}) as server:
        target = target_for(server.url("/metrics"), engine="vllm")
        seen = poll(target, 3)
    assert [state for _, state in seen] == [UNTRIED, HONOURED, HONOURED]
    assert len(name_filter.answer(VLLM_PAGE, adapter.wanted)) < len(VLLM_PAGE) / 2
    assert [outcome.ranks.keys() for outcome, _ in seen[1:]] == [seen[0][0].ranks.keys()] * 2


def test_a_refused_filter_falls_back_to_the_whole_page_in_the_same_poll():
    """A 414 for the long URL: the whole page at once, and no filter asked again."""
    recorder = Recorder(lambda names: harness.page(VLLM_PAGE) if names is None
                        else harness.page("URI too long\n", status=414))
    with harness.PageServer({"/metrics": recorder}) as server:
        seen = poll(target_for(server.url("/metrics")), 3)
    assert [state for _, state in seen] == [UNTRIED, IGNORED, IGNORED]
    assert all(outcome.up for outcome, _ in seen)
    assert [names is not None for names in recorder.queries] == [False, True, False, False]


def test_after_a_failed_poll_the_filter_is_tried_again():
    """An engine restarts (its polls fail meanwhile) and comes back honouring the filter."""
    honour = {"now": False, "down": False}

    def answer(names):
        if honour["down"]:
            return harness.page("starting\n", status=503)
        return harness.page(name_filter.answer(VLLM_PAGE, set(names)) if names and honour["now"] else VLLM_PAGE)

    recorder = Recorder(answer)
    with harness.PageServer({"/metrics": recorder}) as server:
        target = target_for(server.url("/metrics"))
        states = [state for _, state in poll(target, 2)]
        honour["down"] = True
        states += [state for _, state in poll(target, 1)]
        honour.update(down=False, now=True)
        states += [state for _, state in poll(target, 3)]
    assert states == [UNTRIED, IGNORED, UNTRIED, UNTRIED, HONOURED, HONOURED]
    assert target.outcome.up


@pytest.mark.parametrize("page, other", [
    ("# HELP a x\n# TYPE a gauge\na 1\n\nb{x=\"1\"} 2\n", 1),
    ("# HELP a x\n# TYPE a gauge\na 1\na{q=\"2\"} 3", 0),  # no final newline
    ("\n\na 1\n# EOF\n", 0),
    ("a 1\r\n\r\n", 1),  # a blank line with a CR counts as unread: the page is read whole, never less
    ("", 0),
])
def test_unread_lines_are_the_lines_of_other_series(page, other):
    assert parser.unread_lines(page, parser.parse(page, frozenset({"a"}))) == other


def test_the_filter_is_added_to_the_targets_own_query():
    from kvcache_exporter.sources.fetch import Fetcher, FetchSettings

    names = frozenset({"vllm:num_requests_running", "vllm:e2e_request_latency_seconds_bucket"})
    plain = Fetcher("http://e:8000/metrics", FetchSettings(timeout=1.0, max_bytes=1000))
    with_query = Fetcher("http://e:8000/t/1?shard=2", FetchSettings(timeout=1.0, max_bytes=1000))
    assert plain._filtered_url(names) == ("http://e:8000/metrics?name%5B%5D=vllm%3Ae2e_request_latency_seconds_bucket"
                                          "&name%5B%5D=vllm%3Anum_requests_running")
    assert with_query._filtered_url(names).startswith("http://e:8000/t/1?shard=2&name%5B%5D=vllm%3Ae2e")
    assert parse_qs(urlsplit(with_query._filtered_url(names)).query)["name[]"] == sorted(names)


def test_an_engine_error_on_the_first_filtered_request_is_counted_not_blamed_on_the_filter():
    """A flapping engine (a 502 every other request) whose 502 falls on the first filtered request: the
    poll fails and is counted, and the next poll starts again from a whole page."""
    turns = iter([None, 502, None, None])
    recorder = Recorder(lambda names: harness.page("bad gateway\n", status=502) if next(turns) == 502
                        else harness.page(VLLM_PAGE))
    with harness.PageServer({"/metrics": recorder}) as server:
        target = target_for(server.url("/metrics"))
        seen = poll(target, 3)
    assert [outcome.up for outcome, _ in seen] == [True, False, True]
    assert target.failures["http_status"] == 1
    assert [state for _, state in seen] == [UNTRIED, UNTRIED, UNTRIED]
    assert [names is not None for names in recorder.queries] == [False, True, False]


def test_a_first_filtered_request_that_breaks_the_connection_falls_back_to_the_whole_page():
    """A server that closes the connection on the long query: the whole page in the same poll, no failure."""
    recorder = Recorder(lambda names: harness.page(VLLM_PAGE) if names is None else harness.reset_connection())
    with harness.PageServer({"/metrics": recorder}) as server:
        target = target_for(server.url("/metrics"))
        seen = poll(target, 3)
    assert all(outcome.up for outcome, _ in seen)
    assert sum(target.failures.values()) == 0
    assert [state for _, state in seen] == [UNTRIED, IGNORED, IGNORED]
    # The filtered request broke a kept-alive connection with nothing read: the fetcher tried it once more
    # on a new one (fetch.py), then the target read the whole page.
    assert [names is not None for names in recorder.queries] == [False, True, True, False, False]
