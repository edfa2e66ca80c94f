"""The exporter with the reading of each page replayed: `python -m bench.replay_exporter [exporter arguments]`.

Path `replay` of bench.paths. After a target's first successful poll, every poll fetches the page as
always and then, instead of reading it (parse, adapt, derive, render), serves that first poll's
series again; the status lines are rendered as usual, so the data stays fresh. Its CPU is what path
B costs besides reading pages: the scheduler, the fetches, serving and compressing the exporter's
page. A benchmark tool: it replaces exporter.runtime.target.Target.poll in this process only.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from kvcache_exporter import exposition
from kvcache_exporter.commands import main
from kvcache_exporter.runtime.target import PollOutcome, Target
from kvcache_exporter.sources.fetch import FetchError

_poll = Target.poll


async def _replayed_poll(self: Target, timeout: float | None = None) -> PollOutcome:
    series = getattr(self, "replayed_series", None)
    if series is None:
        outcome = await _poll(self, timeout)
        if outcome.up:
            self.replayed_series = self.text.series
        return outcome
    started = time.monotonic()
    try:
        await self.fetcher.fetch(timeout)
    except FetchError:
        return await _poll(self, timeout)  # counted as the exporter counts it
    now = time.time()
    self.outcome = replace(self.outcome, duration=time.monotonic() - started, last_success=now)
    status = exposition.render_target(self.name, self.labels, self.config.url, replace(self.outcome, ranks={}),
                                      self.failures, self._prefixes)
    self.text = exposition.TargetText(status.status, series, now)
    return self.outcome


if __name__ == "__main__":
    Target.poll = _replayed_poll
    sys.exit(main())
