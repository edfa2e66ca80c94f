"""A pool's disaggregation role through the exporter's pipeline (in this process): the page's word first, then
the target's `role:`, then unified; the same on every series of the target, the KV event stream's included."""

from __future__ import annotations

import asyncio

import yaml

from devtools import harness
from kvcache_exporter import config
from kvcache_exporter.runtime.target import new_target

PAGES = ("sglang-pd-prefill.txt", "vllm-pd-decode-nixl.txt", "vllm-v1.txt")


def roles(tmp_path, configured: dict[str, str | None]) -> dict[str, set[str]]:
    """Per page, the `role` values on its target's exposed pool series, with the configured roles."""
    routes = {f"/{page}": harness.page((harness.FIXTURES / page).read_text()) for page in PAGES}
    with harness.PageServer(routes) as server:
        path = tmp_path / "exporter.yml"
        path.write_text(yaml.safe_dump({"targets": [
            {"name": page, "url": server.url(f"/{page}"), **({"role": configured[page]} if configured[page] else {})}
            for page in PAGES]}))
        settings = config.build(str(path), config.load_file(str(path)))
        targets = [new_target(target, settings) for target in settings.targets]

        async def poll_all():
            await asyncio.gather(*(target.poll() for target in targets))
            for target in targets:
                target.close()

        asyncio.run(poll_all())
    found = {}
    for target in targets:
        text = b"".join(target.text.series.values()).decode()
        found[target.name] = {dict(labels)["role"] for _, labels in harness.samples_of(text)}
    return found


def test_the_page_names_the_role_before_the_configuration(tmp_path):
    got = roles(tmp_path, {"sglang-pd-prefill.txt": "decode", "vllm-pd-decode-nixl.txt": "decode",
                           "vllm-v1.txt": None})
    assert got == {"sglang-pd-prefill.txt": {"prefill"},  # engine_type="prefill" wins over `role: decode`
                   "vllm-pd-decode-nixl.txt": {"decode"},  # vLLM names none: the configuration's
                   "vllm-v1.txt": {"unified"}}  # neither: unified
