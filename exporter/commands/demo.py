"""`kvcache-exporter --demo`: simulated vLLM, SGLang and TensorRT-LLM engines side by side, a disaggregated vLLM
prefill/decode pair, and the exporter polling them."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

from .. import config as cfg
from ..adapters import ADAPTERS
from ..runtime import app

DEMO_ENGINES = (
    # (flavor, scenario, target name): vLLM runs into a KV shortage and recovers; SGLang serves steadily;
    # TensorRT-LLM queues behind its running-request cap with KV to spare; a second vLLM has a small GPU
    # pool and a CPU offload tier that serves most of its prefix hits.
    ("vllm-v1", "kv-saturation", "demo-vllm"),
    ("sglang", "steady", "demo-sglang"),
    ("trtllm", "concurrency-cap", "demo-trtllm"),
    ("vllm-v1", "offload-tier", "demo-offload"),
)
# A vLLM prefill/decode pair (NIXL) whose decode pool runs short of KV from the first minute: P/D backpressure.
DEMO_PD = ("vllm", "pd-decode-short", "demo-pd")
DEMO_LISTEN = "127.0.0.1:10490"
DEMO_SPEED = 4.0


def engine_of(flavor: str) -> str:
    """The adapter that reads a simulator flavor's page: the flavors are named after it (`vllm-v1`, `sglang`)."""
    return flavor.partition("-")[0]


def in_words(parts: list[str]) -> str:
    """`a, b and c`, for a help text."""
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def engines_in_words() -> str:
    """What the demo starts, for the help: `vLLM (kv-saturation), SGLang (steady), ... and a vLLM prefill/decode
    pair (pd-decode-short)`."""
    return in_words([f"{ADAPTERS[engine_of(flavor)].title} ({scenario})" for flavor, scenario, _ in DEMO_ENGINES]
                    + [f"a {ADAPTERS[DEMO_PD[0]].title} prefill/decode pair ({DEMO_PD[1]})"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class RealVllm:
    """A running vLLM engine that takes the simulated `demo-vllm`'s place (`make demo-real`)."""

    url: str  # its /metrics
    kv_events_endpoint: str
    replay_endpoint: str | None = None


def run(listen: str | None, listen_key: tuple[str, str], poll_interval: str | None, log_level: str | None,
        real_vllm: RealVllm | None = None, log_format: str | None = None,
        flags: Mapping[str, object] | None = None) -> int:
    """`listen_key` is (where, key) of the listen address, named in the error if it cannot be bound; `flags` the
    command line's, to name a flag as it was typed."""
    from ..simulator.pd import start_pd_pair  # the simulator is loaded for the demo only
    from ..simulator.server import start_engine

    try:
        listen = cfg.parse_listen(listen or DEMO_LISTEN)
    except ValueError as err:
        raise cfg.ConfigError(*listen_key, str(err)) from None
    settings = {}
    for setting, value, convert in (("poll_interval", poll_interval or "1s", cfg.parse_poll_interval),
                                    ("log_level", log_level or "info", cfg.parse_log_level),
                                    ("log_format", log_format or cfg.LOG_FORMATS[0], cfg.parse_log_format)):
        try:
            settings[setting] = convert(value)
        except ValueError as err:
            raise cfg.ConfigError("command line", cfg.flag_name(setting, flags), str(err)) from None
    simulated = DEMO_ENGINES[1:] if real_vllm else DEMO_ENGINES
    # Each engine publishes its KV events too, so that the "What more KV would buy" panels move.
    endpoints = [f"tcp://127.0.0.1:{_free_port()}" for _ in simulated]
    engines = [start_engine(spec[0], spec[1], speed=DEMO_SPEED, seed=DEMO_ENGINES.index(spec),
                            kv_events_endpoint=endpoint) for spec, endpoint in zip(simulated, endpoints)]
    pd_engine, pd_scenario, pd_name = DEMO_PD
    pair = None
    try:
        pair = start_pd_pair(pd_engine, pd_scenario, speed=DEMO_SPEED, seed=len(DEMO_ENGINES), model=pd_name)
        targets = [cfg.TargetConfig(name=name, url=engine.url, labels={"cluster": "demo"},
                                    kv_events=cfg.KVEventsConfig(endpoint=engine.kv_events_endpoint))
                   for engine, (_, _, name) in zip(engines, simulated)]
        # vLLM's page names no role: the configuration does.
        targets += [cfg.TargetConfig(name=f"{pd_name}-{role}", url=url, labels={"cluster": "demo"}, role=role)
                    for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url))]
        if real_vllm:
            events = cfg.KVEventsConfig(endpoint=real_vllm.kv_events_endpoint, replay_endpoint=real_vllm.replay_endpoint)
            targets.insert(0, cfg.TargetConfig(name=DEMO_ENGINES[0][2], url=real_vllm.url, engine="vllm",
                                               labels={"cluster": "demo"}, kv_events=events))
        config = cfg.build("--demo", {"targets": targets, "listen": listen, **settings})
        host, _, port = listen.rpartition(":")

        width = max(len(target.name) for target in targets)

        def banner() -> None:  # once the exporter listens: a port in use is one line of error, no banner
            print("kvcache-exporter demo: " + ("a real vLLM (CPU) and simulated engines" if real_vllm
                                                else "simulated engines, no GPU needed"), flush=True)
            if real_vllm:
                print(f"  {DEMO_ENGINES[0][2]:{width}} vLLM (real, CPU)                  {real_vllm.url}")
            for engine, (flavor, scenario, name) in zip(engines, simulated):
                print(f"  {name:{width}} {flavor:8} scenario {scenario:15} {engine.url}")
            for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url)):
                print(f"  {pd_name + '-' + role:{width}} {pd_engine:8} scenario {pd_scenario:15} {url}")
            print(f"  {'exporter':{width}} http://{host}:{port}/metrics")
            print(f"Try: curl -s http://{host}:{port}/metrics | grep -E 'kvcache_(pressure_state|usage_ratio)'")
            print("Ctrl-C stops everything.", flush=True)

        return app.serve(config, listen_key, on_listening=banner)
    finally:
        for engine in engines:
            engine.stop()
        if pair is not None:
            pair.stop()
