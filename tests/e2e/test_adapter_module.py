"""Adding an engine is one adapter module: a copy of the package with one more module in adapters/ runs as
the exporter process and polls the new engine end to end."""

from __future__ import annotations

import shutil

from devtools import harness
from devtools.harness import PageServer, page


TOY_ADAPTER = '''
from .base import Adapter, Series


class ToyAdapter(Adapter):
    engine = "toy"
    title = "Toy"
    marker = r"toy:"
    rank_label = "replica"
    model_label = "served_model"
    series = (
        Series("usage_ratio", ("toy:kv_usage",)),
        Series("capacity_tokens", ("toy:kv_capacity_tokens",)),
        Series("requests_running", ("toy:running",)),
        Series("requests_waiting", ("toy:waiting",)),
    )
'''


TOY_PAGE = """# TYPE toy:kv_usage gauge
toy:kv_usage{replica="0",served_model="m"} 0.5
toy:kv_usage{replica="1",served_model="m"} 0.95
# TYPE toy:kv_capacity_tokens gauge
toy:kv_capacity_tokens{replica="0",served_model="m"} 1000
toy:kv_capacity_tokens{replica="1",served_model="m"} 1000
# TYPE toy:running gauge
toy:running{replica="0",served_model="m"} 5
toy:running{replica="1",served_model="m"} 19
# TYPE toy:waiting gauge
toy:waiting{replica="0",served_model="m"} 0
toy:waiting{replica="1",served_model="m"} 3
"""


def test_adding_an_engine_is_one_adapter_module(tmp_path):
    """A copy of the package with one new module in adapters/ polls the new engine end to end:
    detected, accepted as `engine:` in the configuration, named in the engine label, derived."""
    root = tmp_path / "checkout"
    shutil.copytree(harness.REPO / "exporter", root / "kvcache_exporter",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "kvcache_exporter" / "adapters" / "toy.py").write_text(TOY_ADAPTER)
    with PageServer({"/metrics": page(TOY_PAGE)}) as engine:
        config = tmp_path / "exporter.yml"
        config.write_text(f"targets:\n  - {{name: toy-a, url: '{engine.url('/metrics')}', engine: toy}}\n"
                          f"  - {{name: toy-b, url: '{engine.url('/metrics')}'}}\n")
        with harness.exporter(tmp_path, "--config", str(config), "--poll-interval", "1s",
                              checkout=root) as proc:
            samples = harness.wait_until(
                lambda: (s := harness.scrape(proc.url)) and harness.value(s, "kvcache_target_up", target="toy-b") == 1
                and s, timeout=20, what="both toy targets polled")
    for target in ("toy-a", "toy-b"):
        # Replica 1: 0.95 x 1000 = 950 used by 19 requests, 3 waiting at usage >= 0.75: saturated.
        # Replica 0: 500 used by 5 requests (100 each), 500 free, nothing waiting: ok, headroom 5.
        assert harness.value(samples, "kvcache_used_tokens", target=target, dp_rank="1", engine="toy", model="m") == 950
        assert harness.value(samples, "kvcache_free_tokens", target=target, dp_rank="0") == 500
        assert harness.value(samples, "kvcache_headroom_requests", target=target, dp_rank="0") == 5
        assert harness.value(samples, "kvcache_pressure_state", target=target, dp_rank="1", state="saturated") == 1
        assert harness.value(samples, "kvcache_pressure_state", target=target, dp_rank="0", state="ok") == 1
