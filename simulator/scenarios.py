"""Scenarios: phase lists in simulated seconds, built in or read from a YAML file.

After the last phase a scenario repeats from its first phase (`then: repeat`, the default and
the choice of every built-in but wedged) or stays in its last phase for good (`then: hold`). A phase that
sets `restart: true` restarts the engine when it begins: in-flight requests are lost, the KV
pool and prefix cache empty, counters and histograms start again from zero. Time 0 is the
engine's start, which is not a restart.

Built-in timelines (simulated seconds; at `--speed 20` divide by 20 for wall seconds; the
"~" times are what seeds 0-4 show). All use the default engine (1024 blocks of 16 tokens,
max_num_seqs 64, 2048 tokens per step) unless noted, and the default workload: 3 req/s,
prompts lognormal median 300, outputs lognormal median 120, 60% of prompts starting with one
of 4 shared 512-token prefixes.

- steady (600 s, repeats): the default workload. Usage moves around 0.3-0.5 (peaks < 0.8),
  nothing queues for long, nothing is preempted.
- kv-saturation (850 s, repeats), outputs lognormal median 240:
    0-60     warm-up at 2 req/s (usage ~0.4);
    60-150   ramp 2 -> 5 req/s: the pool fills; from ~90-110 s usage is >= 0.9 and requests
             queue for KV (waiting_reason "kv");
    150-600  overload at 5 req/s: the pool stays full and the queue grows (to ~350-550),
             queue time and TTFT climb (TTFT means of tens of seconds, then ~100 s); the
             scheduler's decode reserve wears thin and preemptions start at ~140-200 s, then
             come about once a second;
    600-850  recovery at 1 req/s: the queue drains by ~710-780 s, usage falls, preemptions stop.
- concurrency-cap (660 s, repeats), engine with 2048 blocks and max_num_seqs 8:
    0-60     warm-up at 1 req/s;
    60-420   3.6 req/s: from ~65 s the running cap binds (running == 8, waiting_reason
             "cap"), the queue grows (to ~250-370) while usage stays below 0.3; no preemption;
    420-660  drain at 1 req/s: the queue is empty again by ~550-620 s.
- prefix-collapse (600 s, repeats), default workload:
    0-300    90% of prompts share a prefix: prefix-cache hit ratio ~0.55;
    300-600  10% share a prefix: the hit ratio falls to ~0.05-0.07.
- offload-tier (600 s, repeats), engine with 256 blocks and a CPU tier of 4096 blocks (`offload_blocks`):
    1 req/s, 90% of prompts start with one of 16 shared 512-token prefixes (512 blocks: twice the GPU
    pool). The pool keeps few of them; the tier keeps them all, so most cached prompt tokens come back
    from the CPU (load-back) instead of being recomputed.
- offload-tier-full (600 s, repeats), engine with 256 blocks, a CPU tier of 256 blocks and stores 400 times
    slower than the default (50 MB/s: 42 ms a block): the offload-tier workload at 1.5 req/s. The GPU pool
    is saturated within a minute (requests queue for KV, preemptions follow); the tier is full of blocks
    whose stores are still in flight, so it refuses most allocations (vLLM's
    `kv_offload_allocation_failure_total` climbs all along) and what it cannot keep is recomputed.
- restart (360 s, repeats): the default workload; the engine restarts at 180 s (and at every
  repeat), so counters start again from zero and `_created` moves.
- wedged (holds), default workload:
    0-240    serving as steady;
    from 240 wedged for good: the scheduler admits nothing. The running batch drains within
             half a minute (outputs run to 1,500 tokens), then nothing runs and no token is
             generated, while requests keep arriving (the queue grows by 3 a second) and the pool
             holds only evictable prefix-cache blocks (usage 0). As the engines reported upstream,
             nothing but a restart (of the simulator) recovers it.

YAML format (every key optional except `phases`; a phase inherits each workload key it does
not set from the phase before it (after a ramp: the rate it ended at), the first phase from
the default workload):

    name: my-scenario
    then: repeat                 # or hold
    engine: {num_blocks: 1024, block_size: 16, max_num_seqs: 64, max_num_batched_tokens: 2048,
             max_model_len: 8192, enable_prefix_caching: true, step_base_s: 0.02,
             step_per_token_s: 0.00005}
    phases:
      - name: ramp
        duration_s: 90
        arrival_rate: 3          # requests per simulated second (Poisson)
        arrival_rate_end: 8      # optional: linear ramp over the phase (this phase only)
        prompt_len: {dist: lognormal, median: 300, sigma: 0.6, min: 16, max: 3000}
        output_len: {dist: uniform, min: 50, max: 400}   # or a bare number for a fixed length
        prefix_share: 0.6
        num_prefixes: 4
        prefix_len: 512
        restart: false
        wedged: false            # the scheduler admits nothing during the phase (a wedged engine)
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import yaml

from .model import EngineConfig, EngineModel, Reporting, StepEvents
from .workload import ArrivalProcess, LengthDist, Workload

# Ramps change the arrival rate in steps of this many simulated seconds.
RAMP_SLICE_S = 1.0


class ScenarioError(ValueError):
    """A scenario that cannot be loaded; the message names the source and the key."""


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    workload: Workload
    arrival_rate_end: float | None = None
    restart: bool = False
    wedged: bool = False

    @property
    def final_workload(self) -> Workload:
        """The workload as the phase ends (a ramp ends at `arrival_rate_end`)."""
        if self.arrival_rate_end is None:
            return self.workload
        return replace(self.workload, arrival_rate=self.arrival_rate_end)


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[Phase, ...]
    engine: EngineConfig = EngineConfig()
    then: str = "repeat"

    @property
    def cycle_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)


BUILTIN_SCENARIOS: dict[str, dict[str, Any]] = {
    "steady": {
        "phases": [{"name": "steady", "duration_s": 600}],
    },
    "kv-saturation": {
        "phases": [
            {"name": "warm-up", "duration_s": 60, "arrival_rate": 2,
             "output_len": {"dist": "lognormal", "median": 240, "sigma": 0.5, "min": 16, "max": 1500}},
            {"name": "ramp", "duration_s": 90, "arrival_rate": 2, "arrival_rate_end": 5},
            {"name": "overload", "duration_s": 450, "arrival_rate": 5},
            {"name": "recovery", "duration_s": 250, "arrival_rate": 1},
        ],
    },
    "concurrency-cap": {
        "engine": {"num_blocks": 2048, "max_num_seqs": 8},
        "phases": [
            {"name": "warm-up", "duration_s": 60, "arrival_rate": 1},
            {"name": "capped", "duration_s": 360, "arrival_rate": 3.6},
            {"name": "drain", "duration_s": 240, "arrival_rate": 1},
        ],
    },
    "prefix-collapse": {
        "phases": [
            {"name": "shared", "duration_s": 300, "prefix_share": 0.9},
            {"name": "collapsed", "duration_s": 300, "prefix_share": 0.1},
        ],
    },
    "offload-tier": {
        "engine": {"num_blocks": 256, "offload_blocks": 4096},
        "phases": [{"name": "offloaded", "duration_s": 600, "arrival_rate": 1.0, "prefix_share": 0.9,
                    "num_prefixes": 16, "prefix_len": 512}],
    },
    "offload-tier-full": {
        "engine": {"num_blocks": 256, "offload_blocks": 256, "offload_store_bytes_per_s": 50e6},
        "phases": [{"name": "tier-full", "duration_s": 600, "arrival_rate": 1.5, "prefix_share": 0.9,
                    "num_prefixes": 16, "prefix_len": 512}],
    },
    "restart": {
        "phases": [
            {"name": "before", "duration_s": 180},
            {"name": "after-restart", "duration_s": 180, "restart": True},
        ],
    },
    "wedged": {
        "then": "hold",
        "phases": [
            {"name": "serving", "duration_s": 240},
            {"name": "wedged", "duration_s": 60, "wedged": True},
        ],
    },
}


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML scenario file by path."""
    data, source, name = scenario_data(name_or_path, BUILTIN_SCENARIOS, "neither a built-in scenario")
    return parse_scenario(data, source=source, name=name)


def scenario_data(name_or_path: str, builtin: dict[str, Any], unknown: str) -> tuple[Any, str, str]:
    """(data, source, name) of a built-in scenario by name, or of a YAML scenario file by path; `unknown` starts
    the error for neither ("neither a built-in scenario")."""
    if name_or_path in builtin:
        return builtin[name_or_path], name_or_path, name_or_path
    path = Path(name_or_path)
    if not path.is_file():
        raise ScenarioError(f"{name_or_path}: {unknown} ({', '.join(builtin)}) nor a readable file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        problem = " ".join(str(exc).split())
        raise ScenarioError(f"{path}: cannot read scenario: {problem}") from None
    return data, str(path), path.stem


def override_engine(scenario: Scenario, overrides: dict[str, Any]) -> Scenario:
    """`scenario` with some engine fields replaced, validated as a file's `engine:` section is."""
    engine = _parse_engine("engine overrides", {**asdict(scenario.engine), **overrides})
    return replace(scenario, engine=engine)


# -- parsing and validation -----------------------------------------------------------------

_PHASE_KEYS = {"name", "duration_s", "arrival_rate", "arrival_rate_end", "prompt_len", "output_len",
               "prefix_share", "num_prefixes", "prefix_len", "restart", "wedged"}
_LENGTH_KEYS = {"dist", "median", "sigma", "min", "max"}


class _Fields:
    """Typed reads from one mapping, with errors that name the source and the key path."""

    def __init__(self, source: str, where: str, data: Any, allowed: set[str]):
        self.source, self.where = source, where
        if not isinstance(data, dict):
            self.fail(where or "top level", "must be a mapping")
        unknown = sorted(set(map(str, data)) - allowed)
        if unknown:
            self.fail(self.key(unknown[0]), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        self.data = data

    def key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, problem: str) -> NoReturn:
        raise ScenarioError(f"{self.source}: {key}: {problem}")

    def number(self, key: str, default: float, minimum: float = 0.0, maximum: float = math.inf,
               above_minimum: bool = False) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(self.key(key), f"must be a finite number, got {value!r}")
        if value < minimum or (above_minimum and value == minimum) or value > maximum:
            bound = f"> {minimum:g}" if above_minimum else f">= {minimum:g}"
            upper = f" and <= {maximum:g}" if maximum != math.inf else ""
            self.fail(self.key(key), f"must be {bound}{upper}, got {value!r}")
        return float(value)

    def integer(self, key: str, default: int, minimum: int) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(self.key(key), f"must be an integer, got {value!r}")
        if value < minimum:
            self.fail(self.key(key), f"must be >= {minimum}, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            self.fail(self.key(key), f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str, choices: tuple[str, ...] = ()) -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str) or (choices and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a string"
            self.fail(self.key(key), f"must be {expected}, got {value!r}")
        return value


def parse_scenario(data: Any, source: str, name: str) -> Scenario:
    top = _Fields(source, "", data, {"name", "then", "engine", "phases"})
    engine = _parse_engine(source, data.get("engine", {}))
    phases_data = data.get("phases")
    if not isinstance(phases_data, list) or not phases_data:
        top.fail("phases", "must be a non-empty list of phases")
    phases, workload = [], Workload()
    for index, phase_data in enumerate(phases_data):
        phase = _parse_phase(source, f"phases[{index}]", phase_data, workload)
        if phase.workload.prefix_len >= engine.effective_max_model_len:
            top.fail(f"phases[{index}].prefix_len", "must be shorter than the engine's max_model_len and pool")
        phases.append(phase)
        workload = phase.final_workload
    return Scenario(
        name=top.text("name", name),
        phases=tuple(phases),
        engine=engine,
        then=top.text("then", "repeat", choices=("repeat", "hold")),
    )


def _parse_engine(source: str, data: Any, where: str = "engine") -> EngineConfig:
    spec = _Fields(source, where, data, {f.name for f in fields(EngineConfig)})
    base = EngineConfig()
    values: dict[str, Any] = {}
    for f in fields(EngineConfig):
        default = getattr(base, f.name)
        if isinstance(default, bool):
            values[f.name] = spec.boolean(f.name, default)
        elif isinstance(default, int):
            values[f.name] = spec.integer(f.name, default, minimum=0 if f.name == "offload_blocks" else 1)
        else:
            # A step of zero duration would stop the simulated clock; a transfer at no speed would never end.
            values[f.name] = spec.number(f.name, default, above_minimum=f.name == "step_base_s"
                                         or f.name.endswith("_bytes_per_s"))
    if values["reserve_ratio_min"] > values["reserve_ratio_init"]:
        spec.fail(spec.key("reserve_ratio_min"), "must be <= reserve_ratio_init")
    return EngineConfig(**values)


def _parse_phase(source: str, where: str, data: Any, previous: Workload) -> Phase:
    spec = _Fields(source, where, data, _PHASE_KEYS)
    workload = Workload(
        arrival_rate=spec.number("arrival_rate", previous.arrival_rate),
        prompt_len=_parse_length(spec, "prompt_len", previous.prompt_len),
        output_len=_parse_length(spec, "output_len", previous.output_len),
        prefix_share=spec.number("prefix_share", previous.prefix_share, maximum=1.0),
        num_prefixes=spec.integer("num_prefixes", previous.num_prefixes, minimum=1),
        prefix_len=spec.integer("prefix_len", previous.prefix_len, minimum=0),
    )
    ramp_to = spec.number("arrival_rate_end", 0.0) if "arrival_rate_end" in data else None
    if "duration_s" not in data:
        spec.fail(spec.key("duration_s"), "is required")
    return Phase(
        name=spec.text("name", where),
        duration_s=spec.number("duration_s", 0.0, above_minimum=True),
        workload=workload,
        arrival_rate_end=ramp_to,
        restart=spec.boolean("restart", False),
        wedged=spec.boolean("wedged", False),
    )


def _parse_length(phase: _Fields, key: str, previous: LengthDist) -> LengthDist:
    value = phase.data.get(key)
    if value is None:
        return previous
    where = phase.key(key)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            phase.fail(where, f"must be >= 1, got {value!r}")
        return LengthDist(kind="uniform", low=value, high=value)
    spec = _Fields(phase.source, where, value, _LENGTH_KEYS)
    kind = spec.text("dist", "lognormal", choices=("lognormal", "uniform"))
    low = spec.integer("min", 1, minimum=1)
    high = spec.integer("max", max(low, previous.high), minimum=low)
    if kind == "uniform":
        return LengthDist(kind="uniform", low=low, high=high)
    median = spec.number("median", previous.median, minimum=1.0)
    sigma = spec.number("sigma", previous.sigma)
    return LengthDist(kind="lognormal", median=median, sigma=sigma, low=low, high=high)


# -- running --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """A stretch of simulated time with one constant workload (ramps are cut into slices)."""

    start: float
    end: float
    phase: Phase
    workload: Workload
    restart: bool


def _segments(scenario: Scenario) -> Iterator[Segment]:
    start = 0.0
    while True:
        for index, phase in enumerate(scenario.phases):
            holds = scenario.then == "hold" and index == len(scenario.phases) - 1
            yield from _phase_segments(phase, start)
            start += phase.duration_s
            if holds:
                yield Segment(start, math.inf, phase, phase.final_workload, restart=False)
                return


def _phase_segments(phase: Phase, start: float) -> Iterator[Segment]:
    if phase.arrival_rate_end is None:
        yield Segment(start, start + phase.duration_s, phase, phase.workload, phase.restart)
        return
    slices = max(1, math.ceil(phase.duration_s / RAMP_SLICE_S))
    width = phase.duration_s / slices
    begin, end = phase.workload.arrival_rate, phase.arrival_rate_end
    for i in range(slices):
        rate = begin + (end - begin) * (i + 0.5) / slices
        yield Segment(start + i * width, start + (i + 1) * width, phase,
                      replace(phase.workload, arrival_rate=rate), phase.restart and i == 0)


# How arrivals are dispatched over the ranks: `round-robin`, as SGLang's DP controller does by default, or
# `prefix-affinity`, a request of a shared prefix to the rank its prefix picks (the others round-robin), as a
# prefix-aware router would: the fleet index's routing loss (docs/kv-events.md) tells the two apart.
ROUTERS = ("round-robin", "prefix-affinity")


class ScenarioRun:
    """Drives `dp` engine models (one per data-parallel rank) through a scenario's phases.

    Arrivals are dispatched over the ranks by `router` (ROUTERS). The result does not depend on how
    `advance_to` calls cut up time.
    """

    def __init__(self, scenario: Scenario, reporting: Reporting, seed: int = 0, dp: int = 1,
                 record_kv_events: bool = False, router: str = ROUTERS[0]):
        if dp < 1:
            raise ValueError("dp must be >= 1")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        self.router = router
        self.scenario = scenario
        self.reporting = reporting
        self.dp = dp
        self.record_kv_events = record_kv_events
        self.generation = 0  # restarts so far
        self.now = 0.0
        self._segments = _segments(scenario)
        self.segment = next(self._segments)
        self._next_rank = 0
        self.arrivals = ArrivalProcess(self.segment.workload, random.Random(seed),
                                       scenario.engine.effective_max_model_len)
        self.models = self._new_models(0.0)
        self._wedge()

    @property
    def phase(self) -> Phase:
        return self.segment.phase

    def _new_models(self, start: float) -> list[EngineModel]:
        return [EngineModel(self.scenario.engine, self.reporting, start, self.record_kv_events)
                for _ in range(self.dp)]

    def advance_to(self, t: float, on_step: Callable[[EngineModel, StepEvents], None] | None = None) -> None:
        while self.now < t:
            target = min(t, self.segment.end)
            for request in self.arrivals.until(target):
                if self.router == "prefix-affinity" and request.prefix_id is not None:
                    self.models[request.prefix_id % self.dp].submit(request)
                    continue
                self.models[self._next_rank].submit(request)
                self._next_rank = (self._next_rank + 1) % self.dp
            for model in self.models:
                model.advance_to(target, on_step)
            self.now = target
            if target >= self.segment.end:
                self._enter(next(self._segments))

    def _wedge(self) -> None:
        for model in self.models:
            model.wedged = self.segment.phase.wedged

    def set_arrival_rate(self, rate: float) -> None:
        """Poisson arrivals at `rate` from now until the next phase: a router's share of one model's load."""
        self.arrivals.set_workload(replace(self.arrivals.workload, arrival_rate=rate), self.now)

    def _enter(self, segment: Segment) -> None:
        self.segment = segment
        if segment.restart:
            self.generation += 1
            self.models = self._new_models(segment.start)
        self._wedge()
        self.arrivals.set_workload(segment.workload, segment.start)
