"""kvcache-sim: serve a simulated vLLM, SGLang or TensorRT-LLM metrics endpoint.

    kvcache-sim --flavor vllm-v1|vllm-v0|sglang|trtllm --scenario NAME|FILE.yml [--listen HOST:PORT]
                [--speed X] [--seed N] [--model NAME] [--tp N] [--dp N] [--router round-robin|prefix-affinity]
                [--kv-events-endpoint tcp://HOST:PORT] [--log-level LEVEL]
    kvcache-sim --pd --flavor vllm-v1|sglang --scenario pd-NAME|FILE.yml [--listen HOST:PORT] [--speed X]
                [--seed N] [--model NAME] [--log-level LEVEL]

Prints `kvcache-sim <flavor> serving http://HOST:PORT/metrics` (`/prometheus/metrics` for trtllm) once listening, runs until
SIGTERM or SIGINT. With --pd: a disaggregated pair, its prefill engine on HOST:PORT and its decode engine on
HOST:PORT+1 (both free ports with port 0), one line `kvcache-sim <flavor> <role> serving URL` each; their queues
are the engines' (vLLM's fetch stages and waiting reasons, SGLang's bootstrap, pre-allocation, transfer, waiting
and inflight queues). A bad argument or scenario file: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any, Callable, NoReturn

from .exposition import FLAVORS
from .pd import BUILTIN_PD_SCENARIOS, FLAVOR_OF, start_pd_pair
from .scenarios import BUILTIN_SCENARIOS, ROUTERS, ScenarioError
from .server import start_engine

PROG = "kvcache-sim"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message}\n")


def _listen_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return int(value)


def _kv_events_endpoint(value: str) -> str:
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Serve a simulated vLLM, SGLang or TensorRT-LLM metrics endpoint.")
    parser.add_argument("--flavor", required=True, choices=list(FLAVORS), help="engine and version imitated")
    parser.add_argument("--scenario", default="steady",
                        help=f"built-in ({', '.join(BUILTIN_SCENARIOS)}) or a YAML scenario file")
    parser.add_argument("--listen", type=_listen_address, metavar="HOST:PORT",
                        help="default 127.0.0.1:8000 (vllm) or 127.0.0.1:30000 (sglang); port 0 picks a free one")
    parser.add_argument("--speed", type=_positive_float, default=1.0,
                        help="simulated seconds per wall second (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="served model name (the model_name label)")
    parser.add_argument("--tp", type=_positive_int, default=1,
                        help="tensor-parallel ranks (SGLang repeats its scheduler gauges per rank)")
    parser.add_argument("--dp", type=_positive_int, default=1, help="data-parallel ranks, each with its own KV pool")
    parser.add_argument("--router", choices=list(ROUTERS), default=ROUTERS[0],
                        help="how requests are dispatched over the DP ranks: round-robin (default) or to the rank "
                             "their shared prefix picks (prefix-affinity)")
    parser.add_argument("--kv-events-endpoint", type=_kv_events_endpoint, metavar="tcp://HOST:PORT",
                        help="publish the prefix cache's KV events (vLLM's and SGLang's ZMQ stream) there; "
                             "DP rank r on PORT + r")
    parser.add_argument("--pd", action="store_true",
                        help="a disaggregated prefill/decode pair (vllm-v1 or sglang; scenarios "
                             f"{', '.join(BUILTIN_PD_SCENARIOS)} or a P/D scenario file)")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], type=str.upper)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = args.listen or ("127.0.0.1", FLAVORS[args.flavor].default_port)
    if args.pd:
        return _serve_pair(args, host, port)
    return _serve(lambda: start_engine(args.flavor, args.scenario, host=host, port=port, speed=args.speed,
                                       seed=args.seed, model=args.model, tp=args.tp, dp=args.dp,
                                       kv_events_endpoint=args.kv_events_endpoint, router=args.router),
                  f"{host}:{port}", lambda engine: [f"{PROG} {args.flavor} serving {engine.url}"])


def _serve_pair(args: argparse.Namespace, host: str, port: int) -> int:
    engine = {flavor: engine for engine, flavor in FLAVOR_OF.items()}.get(args.flavor)
    refused = [flag for flag, given in (("--tp", args.tp != 1), ("--dp", args.dp != 1),
                                        ("--router", args.router != ROUTERS[0]),
                                        ("--kv-events-endpoint", args.kv_events_endpoint)) if given]
    if engine is None or refused:
        problem = (f"--pd serves {' or '.join(FLAVOR_OF.values())}, got {args.flavor}" if engine is None
                   else f"--pd takes no {', '.join(refused)}")
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    scenario = "pd-steady" if args.scenario == "steady" else args.scenario
    ports = (port, port + 1) if port else (0, 0)
    return _serve(lambda: start_pd_pair(engine, scenario, speed=args.speed, seed=args.seed,
                                        **({"model": args.model} if args.model else {}), host=host, ports=ports),
                  f"{host}:{ports[0]} and {ports[1]}",
                  lambda pair: [f"{PROG} {args.flavor} {role} serving {url}"
                                for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url))])


def _serve(start: Callable[[], Any], where: str, banner: Callable[[Any], list[str]]) -> int:
    """Start what `start` serves, print its banner, serve until SIGTERM or SIGINT; a bad scenario or a port in
    use is one line on stderr and exit code 2."""
    try:
        served = start()
    except (ScenarioError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    for line in banner(served):
        print(line, flush=True)
    try:
        stop.wait()
    finally:
        served.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
