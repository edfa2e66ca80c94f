"""The pages the fleet benchmark serves, derived from the test fixtures, and the workloads made of them.

- `vllm-v1-35k`: tests/fixtures/vllm-v1.txt (vLLM V1, one API server) without its `_created` gauge
  families (vLLM in multiprocess mode, or with created series disabled, has none) and without the
  FastAPI instrumentator's `http_*` families, serving `--served-model-name llama-3.1-8b`: about 37 KB,
  every `vllm:` family of the fixture kept.
- `sglang-tp2`: tests/fixtures/sglang-0.5.txt (SGLang 0.5.19, DP=2 x TP=2, all schedulers reporting)
  reduced to DP=1: the lines of data-parallel rank 1 dropped and the `dp_rank` label removed, as an
  engine without a DP controller writes them. Two TP ranks repeat every scheduler gauge: about 50 KB.
- `vllm-v1-58k`: the fixture itself (long model name, `_created`, `http_*`), for comparison with
  earlier measurements.
- `vllm-v1-58k-at-rest`, `sglang-tp2-at-rest`: the same pages from a pool with room to spare: KV usage
  0.55, nothing waiting, no preemption or retraction. The captured pages are from pools under
  pressure (vLLM's KV-bound, both preempting), so a fleet of them alone sets off every KV alert.

A workload is the list of pages its targets serve: target i serves page i mod len(pages).
"""

from __future__ import annotations

import re
from pathlib import Path

from .page_server import FIXTURES

_SHORT_MODEL = "llama-3.1-8b"
_FIXTURE_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_FAMILY_START = re.compile(r"(?m)^(?=# HELP )")


def _family_name(block: str) -> str:
    return block.split(" ", 3)[2] if block.startswith("# HELP ") else ""


def drop_families(text: str, unwanted) -> str:
    """The page without the families (HELP/TYPE/sample block) whose name `unwanted` accepts."""
    return "".join(block for block in _FAMILY_START.split(text) if not unwanted(_family_name(block)))


def vllm_v1_35k() -> str:
    text = (FIXTURES / "vllm-v1.txt").read_text()
    text = drop_families(text, lambda name: name.endswith("_created") or name.startswith("http_"))
    return text.replace(_FIXTURE_MODEL, _SHORT_MODEL)


def sglang_tp2() -> str:
    lines = (FIXTURES / "sglang-0.5.txt").read_text().splitlines(keepends=True)
    kept = [line for line in lines if 'dp_rank="1"' not in line]
    return "".join(kept).replace('dp_rank="0",', "").replace(',dp_rank="0"', "")


def vllm_v1_58k() -> str:
    return (FIXTURES / "vllm-v1.txt").read_text()


# The series that put a pool under pressure, and their values at rest. Values of 1 or less stay as they are
# in every variant the page server makes, so the preemption counters do not move.
_AT_REST = {"vllm:kv_cache_usage_perc": "0.55", "vllm:num_requests_waiting": "0.0",
            "vllm:num_requests_waiting_by_reason": "0.0", "vllm:num_preemptions_total": "0.0",
            "sglang:token_usage": "0.55", "sglang:full_token_usage": "0.55", "sglang:num_queue_reqs": "0.0",
            "sglang:num_retracted_requests_total": "0.0"}
_PRESSURE_LINE = re.compile(r"(?m)^(" + "|".join(map(re.escape, _AT_REST)) + r")((?:\{[^}\n]*\})? )\S+$")


def at_rest(text: str) -> str:
    """The page of a pool with room to spare (see the module's text)."""
    return _PRESSURE_LINE.sub(lambda m: m.group(1) + m.group(2) + _AT_REST[m.group(1)], text)


PAGES = {"vllm-v1-35k": vllm_v1_35k, "sglang-tp2": sglang_tp2, "vllm-v1-58k": vllm_v1_58k,
         "vllm-v1-58k-at-rest": lambda: at_rest(vllm_v1_58k()), "sglang-tp2-at-rest": lambda: at_rest(sglang_tp2())}
WORKLOADS = {
    "vllm": ("vllm-v1-35k",),
    "sglang": ("sglang-tp2",),
    "mix": ("vllm-v1-35k", "sglang-tp2"),  # alternating: half the fleet vLLM, half SGLang
    "vllm-58k": ("vllm-v1-58k",),
}
DEFAULT_WORKLOADS = ("vllm", "sglang", "mix")


def write_pages(directory: Path) -> dict[str, Path]:
    """Every bench page as a file in `directory` (the page server reads pages from files)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, build in PAGES.items():
        paths[name] = directory / f"{name}.txt"
        paths[name].write_text(build())
    return paths
