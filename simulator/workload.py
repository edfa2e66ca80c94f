"""The request stream: Poisson arrivals with sampled prompt and output lengths and shared prefixes.

The only randomness of the simulator lives here, in one seeded `random.Random`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .model import Request

# Who the simulated requests are: the LoRA adapters they name (None: the base model) and the tenants
# whose cache salts ("tenant-0", ...) they carry, in the engines' KV events (simulator/kvevents.py).
ADAPTERS = (None, "sql-lora", "chat-lora")
TENANTS = 4


def holder(owner: int) -> tuple[str | None, str]:
    """The adapter and cache salt of the blocks of requests of `owner` (simulator.model.Request.owner)."""
    return ADAPTERS[owner % len(ADAPTERS)], f"tenant-{owner % TENANTS}"


@dataclass(frozen=True)
class LengthDist:
    """Token length distribution: "lognormal" (median, sigma) or "uniform", clamped to [low, high]."""

    kind: str = "lognormal"
    median: float = 256.0
    sigma: float = 0.5
    low: int = 1
    high: int = 4096

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(value, self.low), self.high)


@dataclass(frozen=True)
class Workload:
    """The request stream of one phase. Prefixed prompts are `prefix_len` shared tokens + a sampled tail."""

    arrival_rate: float = 3.0  # Poisson, requests per simulated second
    prompt_len: LengthDist = LengthDist(median=300, sigma=0.6, low=16, high=3000)
    output_len: LengthDist = LengthDist(median=120, sigma=0.5, low=8, high=1000)
    prefix_share: float = 0.6  # share of requests that start with one of the shared prefixes
    num_prefixes: int = 4
    prefix_len: int = 512


class ArrivalProcess:
    """Poisson arrivals with sampled lengths; the rate and mix change with `set_workload`."""

    def __init__(self, workload: Workload, rng: random.Random, max_model_len: int, start_time: float = 0.0):
        self.rng = rng
        self.max_model_len = max_model_len
        self._next_id = 0
        self.set_workload(workload, start_time)

    def set_workload(self, workload: Workload, now: float) -> None:
        # Poisson arrivals are memoryless, so redrawing the next one from `now` is exact.
        self.workload = workload
        rate = workload.arrival_rate
        self._next_arrival = now + self.rng.expovariate(rate) if rate > 0 else math.inf

    def until(self, t: float) -> list[Request]:
        """All requests arriving up to and including `t`, in order."""
        out = []
        while self._next_arrival <= t:
            out.append(self._make_request(self._next_arrival))
            self._next_arrival += self.rng.expovariate(self.workload.arrival_rate)
        return out

    def _make_request(self, arrival: float) -> Request:
        w, rng = self.workload, self.rng
        output_len = min(w.output_len.sample(rng), self.max_model_len // 2)
        prompt_len = w.prompt_len.sample(rng)
        prefix_id = None
        if w.prefix_len and rng.random() < w.prefix_share:
            prefix_id = rng.randrange(w.num_prefixes)
            prompt_len += w.prefix_len
        prompt_len = min(prompt_len, self.max_model_len - output_len)
        rid = self._next_id
        self._next_id += 1
        return Request(rid, arrival, prompt_len, output_len, prefix_id, min(w.prefix_len, prompt_len))
