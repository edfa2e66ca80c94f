"""What the command line and the README say about engines and flags comes from the registries it describes
(the adapters, the demo's engines, config.FLAGS and config.ENVIRONMENT), so it cannot go stale."""

from __future__ import annotations

import re

import pytest

from devtools import harness
from kvcache_exporter import config as cfg
from kvcache_exporter.adapters import ADAPTERS
from kvcache_exporter.commands import demo, serve

README = (harness.REPO / "README.md").read_text()


def help_of(flag: str) -> str:
    (action,) = [action for action in serve.parser()._actions if flag in action.option_strings]
    return action.help


def test_the_help_names_every_registered_engine():
    description = serve.parser().description
    assert len(ADAPTERS) == 7
    assert [title for title in (adapter.title for adapter in ADAPTERS.values()) if title not in description] == []


def test_the_helps_engine_list_is_the_registrys_in_its_order():
    """The list --help prints, read back as a reader reads it, is the registry's titles: none missing, none extra."""
    text = " ".join(serve.parser().format_help().split())
    (listed,) = re.findall(r"LLM serving engines \(([^)]*)\)", text)
    *first, last = listed.split(" and ")
    assert [name for part in first for name in part.split(", ")] + [last] == \
        [adapter.title for adapter in ADAPTERS.values()]


def test_the_demo_help_names_the_engines_the_demo_starts():
    words = help_of("--demo")
    started = [(ADAPTERS[demo.engine_of(flavor)].title, scenario) for flavor, scenario, _ in demo.DEMO_ENGINES]
    assert len(started) == 4
    assert re.findall(r"(vLLM|SGLang|TensorRT-LLM) \(([a-z-]+)\)", words) == started


def test_the_demos_flavors_are_named_after_the_adapter_that_reads_them():
    from kvcache_exporter.simulator.exposition import FLAVORS

    for flavor, _, _ in demo.DEMO_ENGINES:
        assert flavor in FLAVORS and demo.engine_of(flavor) in ADAPTERS


def test_the_readmes_probe_engines_are_the_registrys():
    (listed,) = re.findall(r"`/probe\?target=URL&engine=([a-z|]+)`", README)
    assert listed.split("|") == list(cfg.engines())


def test_the_readmes_flags_table_has_every_flag_spelling_and_variable():
    table = README[README.index("| flag | environment | default | meaning |"):README.index("Precedence:")]
    rows = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table.splitlines()[2:] if row.strip()}
    for setting, spellings in cfg.FLAGS.items():
        (cell,) = [cell for cell in rows if cell.startswith(f"`{spellings[0]} ")]
        assert re.findall(r"`(--[a-z.-]+)", cell) == list(spellings), cell
        assert rows[cell].startswith(f"`{cfg.ENVIRONMENT[setting]}`"), cell


@pytest.mark.parametrize("setting", [setting for setting, spellings in cfg.FLAGS.items() if len(spellings) > 1])
def test_both_spellings_of_a_flag_give_the_setting_and_the_spelling_is_kept(tmp_path, setting):
    values = {"config": str(tmp_path / "exporter.yml"), "listen": "127.0.0.1:3", "poll_interval": "2s",
              "log_level": "debug"}
    (tmp_path / "exporter.yml").write_text("targets: [{url: 'http://f:1/metrics'}]\n")
    configs = []
    for spelling in cfg.FLAGS[setting]:
        flags = vars(serve.parser().parse_args([spelling, values[setting]]))
        assert flags[setting] == values[setting] and flags[cfg.TYPED] == {setting: spelling}
        assert cfg.given(flags, {}, setting) == ("command line", spelling, values[setting])
        configs.append(cfg.resolve(flags, {}))
    assert configs[0] == configs[1]


def test_the_kubernetes_docs_name_the_registrys_engines():
    text = (harness.REPO / "docs" / "kubernetes.md").read_text()
    (listed,) = re.findall(r"one of the exporter's engines \(([^)]*)\)", text.replace("\n   ", " "))
    assert re.findall(r"`([a-z]+)`", listed) == list(ADAPTERS)
