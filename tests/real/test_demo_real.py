"""`make demo-real` (devtools/demo_real.py): the demo with the real vLLM CPU engine as `demo-vllm`. It starts, and
the demo's exporter reads the real engine: its pool as vLLM was started (devtools.demo_real.POOL), the load the
demo drives into it, and its KV event stream; the simulated engines beside it answer as in `make demo`."""

from __future__ import annotations

import re
import sys
import time

import pytest

from devtools import demo_real, harness, vllm_engine

pytestmark = pytest.mark.timeout(600)
DEMO_TARGETS = ("demo-vllm", "demo-sglang", "demo-trtllm", "demo-offload")


def ours(samples: dict, name: str, target: str) -> float:
    return sum(harness.series(samples, name, target=target).values())


def test_demo_real_polls_the_real_engine(tmp_path):
    vllm_engine.require_installed()
    started = time.monotonic()
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "devtools.demo_real", "--listen", f"127.0.0.1:{port}"]
    with harness.Process("demo-real", argv, tmp_path, f"{base}/healthz", cwd=harness.REPO) as demo:
        demo.wait_ready(vllm_engine.START_TIMEOUT + 60)
        engine_url = harness.wait_until(lambda: re.search(r"demo-vllm\s+vLLM \(real, CPU\)\s+(\S+)",
                                                          demo.log_path.read_text()), timeout=10,
                                        what="the banner's line for the real engine").group(1)

        def loaded():
            # Every target up in the same scrape: once, on CI, demo-sglang read 0 in the scrape where the real
            # engine's first tokens showed (32 s in; no failed poll in the log), and 1 in each of four runs since.
            samples = harness.scrape(base)
            up = all(ours(samples, "kvcache_target_up", target) == 1 for target in DEMO_TARGETS)
            return samples if up and min(ours(samples, "kvcache_generation_tokens_total", "demo-vllm"),
                                         ours(samples, "kvcache_events_blocks_stored_total", "demo-vllm")) > 0 else None

        samples = harness.wait_until(loaded, timeout=240, interval=1.0,
                                     what=f"{', '.join(DEMO_TARGETS)} up, and the exporter counting the real engine's "
                                          "tokens and KV events")
        page = harness.samples_of(harness.http_get(engine_url)[1])
    print(f"\ndemo-real: {time.monotonic() - started:.0f} s")
    # vLLM counts its null block in num_gpu_blocks; the pool the exporter reports is the usable part.
    assert ours(samples, "kvcache_capacity_blocks", "demo-vllm") == demo_real.POOL["blocks"] - 1
    assert ours(samples, "kvcache_block_size_tokens", "demo-vllm") == 32
    # The exporter mirrors the engine's counter, read by it before the engine's page was read here.
    assert 0 < ours(samples, "kvcache_generation_tokens_total", "demo-vllm") <= \
        harness.value(page, "vllm:generation_tokens_total", model_name=vllm_engine.MODEL_NAME)
