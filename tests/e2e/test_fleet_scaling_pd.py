"""The autoscaling signal on a disaggregated fleet: a simulated vLLM prefill engine and its decode replicas (NIXL
pull: the prefill side holds each prompt's KV until a decode replica pulls it) -> the exporter -> Prometheus with
the shipped rules on a clock TIME_SCALE times faster, and the test as the autoscaler of each role, acting as the
shipped HPA does (tests/e2e/test_fleet_scaling.py: out to the lowest desired count of the scale-up window).

The decode side is the bottleneck. How many replicas each role needs, from the simulator's model (simulator/pd.py):
every prompt is 1,024 tokens, every output 200, no shared prefixes.

- Decode: a request holds its prompt's and output's blocks at once, ceil(1,224 / 16) = 77 of a replica's 770: ten
  run at most. Each runs 200 steps of step_base_s + step_per_token_s x running = 0.02 + 50 µs x 10 = 0.0205 s, so a
  replica serves at most 10 / 4.1 = 2.44 requests a second. RATE 3.2 a second: one replica queues 0.76 a second more
  than it serves, for good; two serve 1.6 each, holding 6.6 requests (66 % of their KV) on average: under the
  low-water mark, so nothing waits for KV through a window, and 2 x 0.66 pools' worth needs both at 75 %. Needed: 2.
- Prefill: 3,277 prompt tokens a second against steps of 8,192 tokens in 0.02 + 50 µs x 8,192 = 0.43 s (19,000
  a second): a sixth busy. Needed: 1, the one there is. But it holds what the one decode replica has not pulled:
  the decode queue grows 0.76 a second, so its pool of 8,192 blocks (128 prompts of 64 blocks) is full of KV held
  for export after ~170 simulated seconds, and its own queue then waits for KV, admitted as the decode side pulls.
  That queue grows 0.76 a second too, and stays under the 128 prompts' worth the held KV frees until the second
  decode replica serves (~280 s: ~85 requests). kvcache_kv_transfer_held_tokens reports it, and the rules ask no
  prefill replica for it; the rules before it read each running prompt as holding the whole pool and asked 2.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import socket
import time

import pytest
import yaml

from devtools import harness, scaling_plots
from devtools.alerting import prometheus_config
from kvcache_exporter.alerts import generate
from kvcache_exporter.simulator.model import EngineConfig
from kvcache_exporter.simulator.pd import PDPair, parse_pd_scenario
from tests.e2e.test_fleet_scaling import COMPRESSED, INTERVAL, SCALE_UP_WINDOW, STARTUP, TICK, TIME_SCALE

MODEL = "pd"
PROMPT, OUTPUT = 1024, 200
RATE = 3.2
PREFILL = {"num_blocks": 8192, "max_num_seqs": 64, "max_num_batched_tokens": 8192}
DECODE = {"num_blocks": 770, "max_num_seqs": 64}
SCENARIO = parse_pd_scenario({
    "prefill": PREFILL, "decode": DECODE, "link": {"lease_s": 3600}, "then": "hold",
    "phases": [{"name": "decode-short", "duration_s": 100_000, "arrival_rate": RATE, "prompt_len": PROMPT,
                "output_len": OUTPUT, "prefix_share": 0}]}, "pd-fleet", "pd-fleet")
HOLD = 15.0  # wall seconds (5 simulated minutes) the counts must stay put once right
DEADLINE = 120.0  # wall seconds; a run settles in ~30


def decode_rate(engine: EngineConfig) -> float:
    """Requests a second one decode replica serves at most (the module's docstring): the requests its KV holds at
    once, each for OUTPUT steps at that many running."""
    held = engine.num_blocks // math.ceil((PROMPT + OUTPUT) / engine.block_size)
    return held / (OUTPUT * (engine.step_base_s + engine.step_per_token_s * held))


def prefill_busy(engine: EngineConfig) -> float:
    """The share of the time the prefill engine computes at RATE."""
    per_second = engine.max_num_batched_tokens / (engine.step_base_s + engine.step_per_token_s
                                                  * engine.max_num_batched_tokens)
    return RATE * PROMPT / per_second


NEEDED_DECODE = math.ceil(RATE / decode_rate(SCENARIO.decode))


class PDFleet:
    """The pair's prefill engine and its decode replicas, the starting ones refusing connections, and the exporter's
    configuration of them (each with its model and role, as an autoscaler's new replica is configured)."""

    def __init__(self, config_path, pair: PDPair):
        self.config_path, self.pair = config_path, pair
        self.exporter = None
        self.starting: list[tuple[socket.socket, float]] = []  # (its refusing socket, when it answers)
        self._configure()

    @property
    def decode_replicas(self) -> int:
        return len(self.pair.decode_urls) + len(self.starting)

    def add_decode(self, now: float) -> None:
        refusing = socket.socket()
        refusing.bind(("127.0.0.1", 0))
        self.starting.append((refusing, now + STARTUP))
        self._configure()

    def start_due(self, now: float) -> bool:
        due = [(refusing, at) for refusing, at in self.starting if at <= now]
        for refusing, at in due:
            self.starting.remove((refusing, at))
            port = refusing.getsockname()[1]
            refusing.close()
            self.pair.add_decode(port)
        if due:
            self._configure()
        return bool(due)

    def _configure(self) -> None:
        urls = self.pair.decode_urls + [f"http://127.0.0.1:{s.getsockname()[1]}/metrics" for s, _ in self.starting]
        targets = [{"name": "pd-prefill", "url": self.pair.prefill_url, "engine": "vllm", "model": MODEL,
                    "role": "prefill"}]
        targets += [{"name": f"pd-decode-{index}", "url": url, "engine": "vllm", "model": MODEL, "role": "decode"}
                    for index, url in enumerate(urls)]
        self.config_path.write_text(yaml.safe_dump({
            "poll_interval": INTERVAL, "pressure": dataclasses.asdict(COMPRESSED), "targets": targets}))
        if self.exporter is not None:
            self.exporter.signal(signal.SIGHUP)

    def stop(self) -> None:
        for refusing, _ in self.starting:
            refusing.close()


# What the decode side's ask was made of at each reading: the shortage, those starting and joined, and the flow (the
# queue's growth and the completions a second, per simulated second).
CAUSES = ("kvcache:fleet_replicas_short:count", "kvcache:fleet_replicas_starting:count",
          "kvcache:fleet_replicas_joined:count", "kvcache:fleet_requests_waiting:deriv",
          "kvcache:fleet_requests_finished:rate", "kvcache:fleet_kv_short_tokens:sum")


def by_role(prom_url: str, series: str) -> dict[str, float]:
    found = harness.prom_vector(prom_url, f'{series}{{model="{MODEL}"}}')
    return {labels.get("role", ""): value for labels, value in found}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One decode replica under RATE; the decode side scaled as its signal asks, the prefill side's signal watched
    (its one engine stays), until the decode count has stayed put for HOLD at NEEDED_DECODE, or DEADLINE."""
    tmp = tmp_path_factory.mktemp("pd-scaling")
    rules = tmp / "kvcache-rules.yml"
    assert generate.main(["--time-scale", str(TIME_SCALE), "--output", str(rules)]) == 0
    readings, actions, causes = [], [], []
    with PDPair("vllm", SCENARIO, TIME_SCALE, seed=5, model_name=MODEL) as pair:
        fleet = PDFleet(tmp / "exporter.yml", pair)
        try:
            with harness.exporter(tmp, "--config", str(fleet.config_path)) as exporter, \
                    harness.prometheus(tmp / "prom", prometheus_config(
                        rules, None, [int(exporter.url.rsplit(":", 1)[1])], INTERVAL)) as prom:
                fleet.exporter = exporter
                started, unix_started = time.monotonic(), time.time()
                last_change = 0.0
                while (now := time.monotonic() - started) < DEADLINE:
                    if fleet.start_due(now):
                        actions.append((now, "ready"))
                        last_change = now
                    desired = by_role(prom.url, "kvcache:fleet_replicas:desired")
                    held = by_role(prom.url, "kvcache_kv_transfer_held_tokens")
                    readings.append((now, fleet.decode_replicas, len(pair.decode_urls), desired, held.get("prefill"),
                                     pair.model.held_blocks() * SCENARIO.prefill.block_size))
                    causes.append((now, *(by_role(prom.url, series).get("decode") for series in CAUSES)))
                    recent = [r[3] for r in readings if r[0] >= now - SCALE_UP_WINDOW]
                    for role, replicas in (("decode", fleet.decode_replicas), ("prefill", 1)):
                        asked = [d.get(role) for d in recent]
                        if now >= SCALE_UP_WINDOW and None not in asked and min(asked) > replicas:
                            actions.append((now, f"add {role}"))
                            if role == "decode":
                                for _ in range(int(min(asked)) - replicas):
                                    fleet.add_decode(now)
                                last_change = now
                    if fleet.decode_replicas == NEEDED_DECODE and not fleet.starting and now - last_change >= HOLD:
                        break
                    time.sleep(TICK)
                scaling_plots.record(prom.url, MODEL, unix_started, TIME_SCALE, actions)
        finally:
            fleet.stop()
    return {"readings": readings, "actions": actions, "causes": causes, "elapsed": now}


def test_the_load_needs_two_decode_replicas_and_one_prefill():
    rate = decode_rate(SCENARIO.decode)
    assert NEEDED_DECODE == 2 and 2.4 < rate < 2.5 and RATE > rate
    assert RATE / NEEDED_DECODE * OUTPUT * (0.02 + 50e-6 * 10) / 10 < COMPRESSED.low_water_ratio  # 66 % of the KV
    assert prefill_busy(SCENARIO.prefill) < 0.2


def test_a_decode_shortage_asks_for_decode_replicas(run):
    adds = [(t, what) for t, what in run["actions"] if what == "add decode"]
    # The one replica the shortage needs, asked for whole at one moment, and no more (no overshoot).
    assert len(adds) == NEEDED_DECODE - 1, (run["actions"], [
        (round(t, 1), replicas, ready, desired.get("decode"), *cause[1:]) for (t, replicas, ready, desired, *_), cause
        in zip(run["readings"], run["causes"]) if any(at - 2 * SCALE_UP_WINDOW <= t <= at for at, _ in adds[1:])])
    assert max(replicas for _, replicas, *_ in run["readings"]) == NEEDED_DECODE, run["actions"]
    last = run["readings"][-1]
    assert last[2] == NEEDED_DECODE and run["elapsed"] - max(t for t, _ in run["actions"]) >= HOLD, run["actions"]
    # Once they are ready the signal asks for no more, not even for one reading: the prefill queue behind the held
    # KV drains first, and the decode queue stands level meanwhile (kvcache:fleet_requests_waiting:deriv counts both).
    figured = figures(run)
    assert figured["decode_desired_max_once_ready"] == NEEDED_DECODE, [
        (round(t, 1), desired.get("decode"), *cause[1:]) for (t, _, ready, desired, *_), cause
        in zip(run["readings"], run["causes"]) if ready == NEEDED_DECODE and desired.get("decode", 0) > NEEDED_DECODE]
    print("pd decode", figured)


def test_prefill_kv_held_for_export_is_reported_not_asked_for(run):
    # The prefill signal never asked for a replica more than its one engine, though it held the decode queue's KV.
    asked = [(t, desired.get("prefill")) for t, _, _, desired, _, _ in run["readings"] if "prefill" in desired]
    assert asked and max(wanted for _, wanted in asked) == 1, asked
    assert not [what for _, what in run["actions"] if what == "add prefill"], run["actions"]
    # While the decode replica was short the prefill engine's pool filled with what it had not pulled (128 prompts),
    # and the exporter reported it.
    held = [(t, reported, truth) for t, _, _, _, reported, truth in run["readings"] if reported is not None]
    pool = PREFILL["num_blocks"] * SCENARIO.prefill.block_size
    assert pool == 128 * PROMPT and max(truth for *_, truth in held) == pool, held[-5:]
    assert max(reported for _, reported, _ in held) == pool, held[-5:]


def figures(run: dict) -> dict:
    """What docs/scaling.md states, in simulated seconds: when the decode side first had NEEDED_DECODE replicas ready
    after the first reading that asked for them, its overshoot and its highest ask from then on; the prefill side's
    highest ask and held KV."""
    asked = next(t for t, _, _, desired, _, _ in run["readings"] if desired.get("decode", 0) >= NEEDED_DECODE)
    ready = next(t for t, _, ready, *_ in run["readings"] if ready == NEEDED_DECODE)
    return {"asked_s": round(asked * TIME_SCALE), "to_target_s": round(ready * TIME_SCALE),
            "overshoot": max(r for _, r, *_ in run["readings"]) - NEEDED_DECODE,
            "decode_desired_max_once_ready": max(d.get("decode", 0) for t, _, _, d, _, _ in run["readings"] if t >= ready),
            "prefill_asked_max": max(d.get("prefill", 0) for _, _, _, d, _, _ in run["readings"]),
            "prefill_held_tokens_max": max(h or 0 for *_, h, _ in run["readings"])}
