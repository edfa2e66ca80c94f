"""kvcache_target_replica_info: what a target is a replica of before its engine first answers (an autoscaler's new
replica), from its configuration's `model:` and `role:` or its probe's `model` and `role` parameters, and from its
page once it answers; the fleet rules count such a target that does not answer as starting."""

from __future__ import annotations

import asyncio

import pytest

from devtools import harness
from kvcache_exporter import config as cfg
from kvcache_exporter.runtime.probe import Prober
from kvcache_exporter.runtime.target import new_target

# The vLLM fixture page names its model; the engine answers 503 while it loads its weights.
PAGE = (harness.FIXTURES / "vllm-v1.txt").read_text()
PAGE_MODEL = next(line.split('model_name="', 1)[1].split('"', 1)[0] for line in PAGE.splitlines()
                  if 'model_name="' in line)


def settings(tmp_path, text: str) -> cfg.Config:
    path = tmp_path / "exporter.yml"
    path.write_text(text)
    return cfg.build(str(path), cfg.load_file(str(path)))


def replica_line(target) -> str:
    return target.text.status["target_replica_info"].decode()


def test_a_configured_replica_says_its_model_before_it_answers_and_the_page_s_once_it_does(tmp_path):
    with harness.PageServer({"/metrics": harness.page("loading\n", status=503)}) as server:
        config = settings(tmp_path, f"labels: {{cluster: a}}\ntargets: [{{name: new, url: '{server.url('/metrics')}', "
                                    "model: llama-70b, role: decode}]")
        target = new_target(config.targets[0], config)

        async def poll():
            outcome = await target.poll()
            server.set_route("/metrics", harness.page(PAGE))
            answered = replica_line(target), await target.poll()
            target.close()
            return outcome, answered

        before = replica_line(target)
        failed, (after_failure, answered) = asyncio.run(poll())
    assert not failed.up
    expected = 'kvcache_target_replica_info{target="new",engine="",cluster="a",model="llama-70b",role="decode"} 1.0\n'
    assert before == after_failure == expected
    assert answered.up
    assert replica_line(target) == (f'kvcache_target_replica_info{{target="new",engine="vllm",cluster="a",'
                                    f'model="{PAGE_MODEL}",role="decode"}} 1.0\n')
    assert PAGE_MODEL != "llama-70b"


def test_a_replica_without_a_configured_model_says_none(tmp_path):
    config = settings(tmp_path, "targets: [{name: new, url: 'http://127.0.0.1:9/metrics'}]")
    target = new_target(config.targets[0], config)
    assert replica_line(target) == 'kvcache_target_replica_info{target="new",engine="",model="",role="unified"} 1.0\n'
    target.close()


def test_the_model_key_must_be_a_name(tmp_path):
    with pytest.raises(cfg.ConfigError) as err:
        settings(tmp_path, "targets: [{url: 'http://a:1/metrics', model: ''}]")
    assert str(err.value).startswith(f"{tmp_path / 'exporter.yml'}: targets[0].model: must be a non-empty string")


def test_a_probed_replica_says_the_model_and_role_its_probe_names(tmp_path):
    config = settings(tmp_path, "probe: {enabled: true, allow: [127.0.0.1]}")
    with harness.PageServer({"/metrics": harness.page("loading\n", status=503)}) as server:
        prober = Prober(lambda: config, lambda: 1)
        url = server.url("/metrics")

        async def probe(query):
            try:
                return await prober.probe(query, {})
            finally:
                await prober.close()

        status, target = asyncio.run(probe({"target": [url], "engine": ["vllm"], "model": ["llama-70b"],
                                            "role": ["prefill"]}))
        refused = asyncio.run(probe({"target": [url], "role": ["consumer"]}))
    assert status == 200 and not target.outcome.up
    assert replica_line(target) == (f'kvcache_target_replica_info{{target="{url.split("//")[1].split("/")[0]}",'
                                    'engine="vllm",model="llama-70b",role="prefill"} 1.0\n')
    assert refused == (400, "role must be one of prefill, decode, unified")
