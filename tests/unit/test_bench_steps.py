"""bench.paths' profile by step (bench/measure.py): py-spy's collapsed stacks, each sample given to the step of
the innermost step function on its stack, the rest to the event loops."""

from __future__ import annotations

import pytest

from bench.measure import STEPS, step_shares
from devtools import harness


def frame(name: str, path: str, line: int = 1) -> str:
    return f"{name} ({harness.REPO}/{path}:{line})"


LOOP = ";".join([frame("Thread.run", "threading.py"), frame("Scheduler._main", "exporter/runtime/scheduler.py"),
                 frame("Target.poll", "exporter/runtime/target.py")])
READ = LOOP + ";" + frame("Target._read_whole", "exporter/runtime/target.py")


def test_each_sample_counts_for_the_innermost_step_on_its_stack():
    collapsed = "\n".join([
        f"{LOOP};{frame('Target._fetch_and_read', 'exporter/runtime/target.py')};"
        f"{frame('Fetcher.fetch', 'exporter/sources/fetch.py')};{frame('StreamReader.read', 'asyncio/streams.py')} 3",
        f"{READ};{frame('_parse', 'exporter/runtime/target.py')} 5",
        f"{READ};{frame('Adapter.adapt', 'exporter/adapters/base.py')};"
        f"{frame('Adapter._collapse', 'exporter/adapters/base.py')} 6",
        # derive called from within adapt's caller, and render calling the exposition's helpers
        f"{READ};{frame('derive', 'exporter/derive.py')};{frame('kv_gauges', 'exporter/derive.py')} 2",
        f"{LOOP};{frame('Target._render', 'exporter/runtime/target.py')};"
        f"{frame('_pool_lines', 'exporter/exposition.py')};{frame('number', 'exporter/exposition.py')} 4",
        f"{frame('MetricsServer._handle', 'exporter/runtime/server.py')};"
        f"{frame('MetricsServer._respond', 'exporter/runtime/server.py')} 2",
        # the scrape's text and its gzip, each in a thread of the pool
        f"{frame('_worker', 'concurrent/futures/thread.py')};"
        f"{frame('Exporter._metrics.<locals>.<lambda>', 'exporter/runtime/app.py')};"
        f"{frame('render', 'exporter/exposition.py')};{frame('_chunks', 'exporter/exposition.py')} 3",
        f"{frame('_worker', 'concurrent/futures/thread.py')};{frame('_gzip', 'exporter/runtime/server.py')};"
        f"{frame('_blocks', 'exporter/runtime/server.py')} 2",
        f"{LOOP} 2",
        f"{frame('BaseEventLoop._run_once', 'asyncio/base_events.py')} 1",
        "",
    ])
    profile = step_shares(collapsed)
    assert profile["samples"] == 30
    expected = {"fetch": 3, "parse": 5, "adapt": 6, "derive": 2, "render": 4, "serve": 7, "loop": 3}
    assert set(profile["shares"]) == set(STEPS)
    assert profile["shares"] == pytest.approx({step: count / 30 for step, count in expected.items()})


def test_a_step_nested_in_another_counts_for_the_inner_one():
    # A poll whose read calls the adapter: the adapter's samples are adapt, not parse.
    collapsed = (f"{READ};{frame('_parse', 'exporter/runtime/target.py')};"
                 f"{frame('Adapter.adapt', 'exporter/adapters/base.py')} 4\n"
                 f"{READ};{frame('_parse', 'exporter/runtime/target.py')} 1\n")
    shares = step_shares(collapsed)["shares"]
    assert shares["adapt"] == pytest.approx(0.8)
    assert shares["parse"] == pytest.approx(0.2)


def test_a_stack_without_its_outer_frames_counts_by_its_innermost_known_function_or_module():
    collapsed = "\n".join([
        f"{frame('Fetcher._body', 'exporter/sources/fetch.py')} 2",
        f"{frame('increase.<locals>.<genexpr>', 'exporter/derive.py')} 3",
        f"{frame('render_target.<locals>.<genexpr>', 'exporter/exposition.py')};"
        f"{frame('label_text', 'exporter/exposition.py')} 1",  # left to the loop: no known function or module
        f"{frame('_pool_lines', 'exporter/exposition.py')};{frame('number', 'exporter/exposition.py')} 4",
        f"{frame('detect', 'exporter/adapters/__init__.py')} 5",
        f"{frame('Scheduler._poll', 'exporter/runtime/scheduler.py')};"
        f"{frame('StreamReader.read', 'asyncio/streams.py')} 5",
    ])
    profile = step_shares(collapsed)
    assert profile["samples"] == 20
    assert profile["shares"] == pytest.approx({"fetch": 0.1, "parse": 0.0, "adapt": 0.25, "derive": 0.15,
                                               "render": 0.2, "serve": 0.0, "loop": 0.3})


def test_no_samples_give_no_shares():
    assert step_shares("") == {"samples": 0, "shares": dict.fromkeys(STEPS, 0.0)}
